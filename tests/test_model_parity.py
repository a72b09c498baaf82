"""Our MindSpore Llama against HF transformers (torch, CPU, fp32) on random checkpoints:
prefill logits within 5e-3 and 32 greedy tokens identical, for one request and for a ragged
batch of 8, with block sizes 1, 16 and 128."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving import SamplingParams
from conftest import MODEL_VARIANTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LENS = [1, 5, 17, 33, 64, 100, 129, 250]   # crosses 16- and 128-token block boundaries
NEW_TOKENS = 32


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(123)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_reference(model_dirs):
    """Per variant: HF logits over each prompt and HF's 32 greedy tokens, one prompt at a time."""
    ref = {}
    torch.manual_seed(0)
    for name, path in model_dirs.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        prompts = _prompts(MODEL_VARIANTS[name]["vocab_size"])
        logits, greedy = [], []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                logits.append(model(ids).logits[0].numpy())
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, attention_mask=torch.ones_like(ids),
                                     pad_token_id=0)
                greedy.append(out[0, len(p):].tolist())
        ref[name] = (prompts, logits, greedy)
    return ref


_llms = {}


def _llm(model_dirs, name, block_size, **kw):
    from llm_serving import LLM
    key = (name, block_size, tuple(sorted(kw.items())))
    if key not in _llms:
        _llms[key] = LLM(model_dirs[name], block_size=block_size, num_blocks=4096 // block_size
                         if block_size > 1 else 2048, **kw)
    return _llms[key]


def _prefill_logits(llm, prompts):
    """Logits of every prompt position, all prompts in one ragged forward pass."""
    eng = llm.engine
    rids = [eng.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=1)) for p in prompts]
    try:
        batch = eng.scheduler.schedule()
        assert len(batch.seqs) == len(prompts), "all prompts should prefill in one step"
        step = eng._build_step(batch)[0]
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
