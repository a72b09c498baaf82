"""Our MindSpore Llama against HF transformers (torch, CPU, fp32) on random checkpoints:
prefill logits within 5e-3 and 32 greedy tokens identical, for one request and for a ragged
batch of 8, with block sizes 1, 16 and 128."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving import SamplingParams
from llm_serving.engine.input_builder import build_step_input
from conftest import MODEL_VARIANTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LENS = [1, 5, 17, 33, 64, 100, 129, 250]   # crosses 16- and 128-token block boundaries
NEW_TOKENS = 32


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(123)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def hf_logits_and_greedy(model, prompts, new_tokens: int = NEW_TOKENS):
    """An HF model's logits over each prompt and its ``new_tokens`` greedy tokens, one prompt
    at a time."""
    logits, greedy = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits.append(model(ids).logits[0].numpy())
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, attention_mask=torch.ones_like(ids),
                                 pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
    return logits, greedy


@pytest.fixture(scope="module")
def hf_reference(model_dirs):
    """Per variant: HF logits over each prompt and HF's 32 greedy tokens, one prompt at a time."""
    ref = {}
    torch.manual_seed(0)
    for name, path in model_dirs.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        prompts = _prompts(MODEL_VARIANTS[name]["vocab_size"])
        ref[name] = (prompts, *hf_logits_and_greedy(model, prompts))
    return ref


_llms = {}


def _llm(model_dirs, name, block_size, **kw):
    from llm_serving import LLM
    key = (name, block_size, tuple(sorted(kw.items())))
    if key not in _llms:
        _llms[key] = LLM(model_dirs[name], block_size=block_size, num_blocks=4096 // block_size
                         if block_size > 1 else 2048, **kw)
    return _llms[key]


def _prefill_logits(llm, prompts, loras=None):
    """Logits of every prompt position, all prompts in one ragged forward pass; with
    ``loras`` (a LoRARequest or None per prompt), each prompt under its adapter, the prefix
    cache emptied first (every prompt token is computed)."""
    eng = llm.engine
    if loras is not None:
        assert eng.reset_prefix_cache()
    rids = [eng.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=1),
                            lora_request=lora)
            for p, lora in zip(prompts, loras or [None] * len(prompts))]
    try:
        batch = eng.scheduler.schedule()
        assert len(batch.seqs) == len(prompts), "all prompts should prefill in one step"
        step = build_step_input(batch, eng.config.cache.block_size, set()).step
        logits = eng.runner.forward(step, np.arange(len(step.input_ids)))
    finally:
        for rid in rids:
            eng.abort_request(rid)
    return np.split(logits, np.cumsum([len(p) for p in prompts])[:-1])


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
def test_prefill_logits_match_hf_single_and_batched(model_dirs, hf_reference, name, block_size):
    prompts, ref_logits, _ = hf_reference[name]
    llm = _llm(model_dirs, name, block_size)
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    batched = _prefill_logits(llm, prompts)
    for ours, ref in zip(batched, ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
def test_greedy_tokens_match_hf_generate(model_dirs, hf_reference, name, block_size):
    prompts, _, ref_tokens = hf_reference[name]
    llm = _llm(model_dirs, name, block_size)
    single = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert single.outputs[0].token_ids == ref_tokens[3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
def test_chunked_prefill_mixed_with_decodes_matches_hf(model_dirs, hf_reference, name):
    """A 40-token budget splits long prompts into chunks that share steps with decodes."""
    prompts, _, ref_tokens = hf_reference[name]
    llm = _llm(model_dirs, name, 16, max_num_batched_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref


def test_mindformers_ckpt_gives_same_logits_as_safetensors(model_dirs, hf_reference, tmp_path):
    from llm_serving import LLM
    from llm_serving.model_executor.loader import save_mindformers_ckpt
    name = "llama3-gqa"
    ckpt = tmp_path / "llama.ckpt"
    save_mindformers_ckpt(model_dirs[name], str(ckpt))
    llm = LLM(model_dirs[name], checkpoint=str(ckpt), num_blocks=64)
    prompts, ref_logits, _ = hf_reference[name]
    np.testing.assert_allclose(_prefill_logits(llm, [prompts[4]])[0], ref_logits[4], atol=5e-3,
                               rtol=0)


def test_hf_overrides_rope_scaling_matches_hf_with_the_same_config(model_dirs, hf_reference):
    """hf_overrides (vLLM's --hf-overrides) replacing the checkpoint's llama3 rope scaling with
    linear x4: our logits and greedy tokens are transformers' on the config so changed, and no
    longer the checkpoint's own."""
    from llm_serving import LLM
    name, override = "llama3-gqa", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    import json
    from pathlib import Path
    d = {**json.loads((Path(model_dirs[name]) / "config.json").read_text()), **override}
    config = transformers.AutoConfig.for_model(**d)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[name], config=config,
                                                              dtype=torch.float32).eval()
    prompts, plain_logits, _ = hf_reference[name]
    ref_logits, ref_tokens = hf_logits_and_greedy(model, prompts[-2:])
    assert np.abs(ref_logits[-1] - plain_logits[-1]).max() > 0.05   # the override matters
    llm = LLM(model_dirs[name], num_blocks=256, hf_overrides=override)
    for ours, ref in zip(_prefill_logits(llm, prompts[-2:]), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-2:]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens


def test_hf_overrides_rope_parameters_replace_the_checkpoints_rope(model_dirs, hf_reference):
    """hf_overrides in transformers v5's spelling, {"rope_parameters": {...}} (what vLLM 0.32
    sets over the config), on a checkpoint whose config.json has the v4 keys (rope_theta and
    llama3 rope_scaling): our logits and greedy tokens are transformers' with rope_parameters
    so set, not the checkpoint's own rope."""
    from llm_serving import LLM
    name = "llama3-gqa"
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}
    config = transformers.AutoConfig.from_pretrained(model_dirs[name])
    config.rope_parameters = dict(rope)               # as vLLM applies a dict override
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[name], config=config,
                                                              dtype=torch.float32).eval()
    prompts, plain_logits, _ = hf_reference[name]
    ref_logits, ref_tokens = hf_logits_and_greedy(model, prompts[-2:])
    assert np.abs(ref_logits[-1] - plain_logits[-1]).max() > 0.05   # the override matters
    llm = LLM(model_dirs[name], num_blocks=256, hf_overrides={"rope_parameters": rope})
    for ours, ref in zip(_prefill_logits(llm, prompts[-2:]), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-2:]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens


# ---- prompt logprobs (SamplingParams.prompt_logprobs) against HF's log_softmax --------------

PROMPT_LP_K = 5


def _check_prompt_logprobs(out, prompt, ref, k=PROMPT_LP_K):
    """vLLM's shape (None, then per token its own Logprob and the top-k) and HF's numbers."""
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    for i in range(1, len(prompt)):
        row, tok, entry = ref[i - 1], prompt[i], pl[i]
        np.testing.assert_allclose(entry[tok].logprob, row[tok], atol=1e-4, rtol=0)
        assert entry[tok].rank == int(np.count_nonzero(row >= row[tok]))
        top = np.argsort(-row)[:k]
        assert list(entry)[0] == tok                          # the prompt token first
        rest = [t for t in entry if t != tok or entry[t].rank <= k]
        assert sorted(rest, key=lambda t: entry[t].rank) == top.tolist()
        np.testing.assert_allclose([entry[t].logprob for t in top], row[top], atol=1e-4, rtol=0)
        assert len(entry) == k + (tok not in top)


@pytest.mark.parametrize("budget", [2048, 24])
def test_prompt_logprobs_match_hf_log_softmax(tiny_model_dir, tiny_hf_logprobs, budget):
    """Whole prompts in one step, and (budget 24) split over several prefill chunks that share
    steps with other requests' decodes; n > 1 and a request without them in the same batch."""
    from llm_serving import LLM
    prompts, ref = tiny_hf_logprobs
    llm = LLM(tiny_model_dir, num_blocks=256, block_size=16, max_num_batched_tokens=budget)
    params = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=PROMPT_LP_K),
              SamplingParams(max_tokens=6, n=2, seed=3, prompt_logprobs=PROMPT_LP_K),
              SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=PROMPT_LP_K,
                             logprobs=2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, out in enumerate(outs):
        if params[i].prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check_prompt_logprobs(out, prompts[i], ref[i])
    # Only k=0: the prompt token's own logprob.
    zero = llm.generate({"prompt_token_ids": prompts[2]},
                        SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:])
    np.testing.assert_allclose([zero.prompt_logprobs[i][t].logprob
                                for i, t in enumerate(prompts[2]) if i],
                               ref[2][np.arange(len(prompts[2]) - 1), prompts[2][1:]],
                               atol=1e-4, rtol=0)


def test_prompt_logprobs_with_prefix_caching_and_preemption(tiny_model_dir, tiny_hf_logprobs):
    """A request asking for prompt logprobs computes the rows another request cached; one
    preempted (recompute) in the middle of its chunked prompt keeps what it scored and
    reuses only those cached blocks."""
    from llm_serving import LLM
    from llm_serving.engine.scheduler import SchedulerOutput
    prompts, ref = tiny_hf_logprobs
    prompt = {"prompt_token_ids": prompts[3]}
    llm = LLM(tiny_model_dir, num_blocks=256, block_size=16, max_num_batched_tokens=40,
              enable_prefix_caching=True)
    plain = llm.generate(prompt, SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    cached = llm.generate(prompt, SamplingParams(max_tokens=2))[0]
    assert cached.num_cached_tokens == 144                  # the cache holds the prefix
    scored = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=PROMPT_LP_K))[0]
    assert scored.num_cached_tokens == 0                    # ... but these rows are computed
    _check_prompt_logprobs(scored, prompts[3], ref[3])

    eng = llm.engine
    eng.block_manager.reset()                               # forget the cached prefix
    hits = eng.block_manager.prefix_hits
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                 prompt_logprobs=PROMPT_LP_K))
    seq = eng.requests[rid].seqs[0]
    eng.step()
    eng.step()                                              # two 40-token chunks
    assert len(seq.prompt_logprobs) == 81
    eng.scheduler._preempt(seq, SchedulerOutput())          # recompute: its KV is dropped
    assert seq.num_computed_tokens == 0
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    _check_prompt_logprobs(outs[-1], prompts[3], ref[3])
    assert eng.block_manager.prefix_hits - hits == 80       # it reused the 5 blocks it scored


def assert_two_ranks_give(prompts, ref_tokens, model_dir) -> None:
    """Two tensor-parallel WorkAgents (one per core when there are two) give ``ref_tokens``
    greedily for ``prompts`` (token ids), and leave no shared memory behind."""
    import os
    from llm_serving import LLM
    from llm_serving.executor.shm_channel import segments_of
    pin = "0|1" if len(os.sched_getaffinity(0)) >= 2 else None
    before = segments_of()
    llm = LLM(model_dir, tensor_parallel_size=2, cpu_affinity=pin, block_size=16,
              num_blocks=256)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        llm.engine.shutdown()
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
    assert not segments_of() - before, "shared memory left behind"


def test_logprob_token_ids_are_scored_as_transformers_scores_them(tiny_model_dir, tiny_llm):
    """vLLM's logprob_token_ids: at each generated position the chosen token and exactly the
    asked ids (in place of the top logprobs, even with logprobs set), each with the log_softmax
    transformers gives the same sequence; a batch mixes them with top-2 and plain rows, and
    an id beyond max_logprobs's count or the vocabulary is refused by name."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32).eval()
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (9, 40, 17)]
    asked = [5, 900, 17, 301]
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                             logprob_token_ids=asked),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=4, max_tokens=5, ignore_eos=True,
                             logprobs=3, logprob_token_ids=asked[:2])]
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, p, out in zip(prompts, params, outs):
        gen = list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt + gen])).logits[0], -1).numpy()
        for i, (tok, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + i]
            want = ([tok] + [t for t in p.logprob_token_ids if t != tok]
                    if p.logprob_token_ids else None)
            if want is None:                      # the top 2 as before
                want = [tok] + [t for t in np.argsort(-row)[:2].tolist() if t != tok]
            assert list(entry) == want
            np.testing.assert_allclose([entry[t].logprob for t in want], row[want],
                                       atol=1e-4, rtol=0)
    for bad, field in ((list(range(21)), "max_logprobs"), ([10**6], "token ids are in")):
        with pytest.raises(ValueError, match=f"logprob_token_ids.*{field}"):
            tiny_llm.generate("Hi", SamplingParams(max_tokens=1, logprob_token_ids=bad))
