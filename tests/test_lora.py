"""LoRA adapters (docs/lora.md) through LLM(...): random PEFT adapters for the tiny Llama
against HF transformers with each adapter merged into its weights by the test (logits within
5e-3, 16 greedy tokens equal); a step mixing the base model and two adapters; the prefix cache
never sharing KV between adapters; the WorkAgent's transport and its LRU of adapters; and
the adapters refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving import LLM, LoRARequest, SamplingParams
from lora_adapters import hf_logits_and_greedy, make_adapter, merged_hf_model
from test_model_parity import _prefill_logits

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """a: every target module, rank 8; b: q and v only, rank 4, rsLoRA; c: gate/up/down."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(str(root / "a"), tiny_model_dir, r=8, alpha=16, seed=1),
        "b": make_adapter(str(root / "b"), tiny_model_dir, r=4, alpha=8, seed=2,
                          targets=("q_proj", "v_proj"), rslora=True),
        "c": make_adapter(str(root / "c"), tiny_model_dir, r=16, alpha=8, seed=3,
                          targets=("gate_proj", "up_proj", "down_proj")),
    }


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 1024, n).tolist() for n in (7, 40, 90)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters, prompts):
    """Per adapter (None: the base model), per prompt: HF's logits and greedy tokens."""
    ref = {}
    for name in (None, "a", "b", "c"):
        model = merged_hf_model(tiny_model_dir, adapters[name] if name else None)
        ref[name] = [hf_logits_and_greedy(model, p, NEW) for p in prompts]
    return ref


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=256, enable_lora=True, max_loras=2, max_cpu_loras=2)


def _req(adapters, name, lora_id=None):
    ids = {"a": 1, "b": 2, "c": 3}
    return None if name is None else LoRARequest(name, lora_id or ids[name], adapters[name])


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_adapter_matches_hf_with_the_adapter_merged(lora_llm, adapters, prompts, reference,
                                                    name):
    lora = _req(adapters, name)
    for i, p in enumerate(prompts):
        ref_logits, ref_tokens = reference[name][i]
        ours = _prefill_logits(lora_llm, [p], [lora])[0]
        np.testing.assert_allclose(ours, ref_logits, atol=5e-3, rtol=0)
        out = lora_llm.generate({"prompt_token_ids": p}, GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == ref_tokens
        # the adapter changes the answer (else this would test nothing)
        assert ref_tokens != reference[None][i][1]


def test_one_step_mixing_base_and_two_adapters(lora_llm, adapters, prompts, reference):
    """Base, a and b rows in the same steps (prefill and decode): each request gets its own
    reference, and the base rows are bit for bit the base model's alone."""
    loras = [None, _req(adapters, "a"), _req(adapters, "b")] * 3
    ps = [p for p in prompts for _ in range(3)]
    names = [None, "a", "b"] * 3
    chunks = _prefill_logits(lora_llm, ps, loras)
    alone = _prefill_logits(lora_llm, prompts, [None] * 3)
    for k, (chunk, name) in enumerate(zip(chunks, names)):
        np.testing.assert_allclose(chunk, reference[name][k // 3][0], atol=5e-3, rtol=0)
        if name is None:
            np.testing.assert_array_equal(chunk, alone[k // 3])
    outs = lora_llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, lora_request=loras)
    for k, (out, name) in enumerate(zip(outs, names)):
        assert out.outputs[0].token_ids == reference[name][k // 3][1], (k, name)


def test_prefix_cache_keeps_each_adapters_kv(lora_llm, adapters, prompts, reference):
    """The same 90-token prompt under a, b, the base and a again: each gets its own answer;
    only the second run of a adapter hits the cache."""
    llm, p = lora_llm, prompts[2]
    llm.reset_prefix_cache()
    runs = [("a", 0), ("b", 0), (None, 0), ("a", 80), ("b", 80), (None, 80)]
    for name, cached in runs:
        out = llm.generate({"prompt_token_ids": p}, GREEDY,
                           lora_request=_req(adapters, name))[0]
        assert out.outputs[0].token_ids == reference[name][2][1], name
        assert out.num_cached_tokens == cached, name


def test_max_loras_one_serializes_adapters(tiny_model_dir, adapters, prompts, reference):
    """With max_loras 1 a step holds one adapter: requests of a, b and the base model given
    together all finish with their own answers; the WorkAgent keeps one adapter loaded."""
    llm = LLM(tiny_model_dir, num_blocks=256, enable_lora=True, max_loras=1,
              distributed_executor_backend="mp")
    try:
        names = ["a", "b", None, "c", "a"]
        outs = llm.generate([{"prompt_token_ids": prompts[1]}] * len(names), GREEDY,
                            lora_request=[_req(adapters, n) for n in names])
        for out, name in zip(outs, names):
            assert out.outputs[0].token_ids == reference[name][1][1], name
    finally:
        llm.engine.shutdown()


def test_workagent_keeps_max_cpu_loras_least_recent_dropped(lora_llm, adapters, prompts):
    runner = lora_llm.engine.runner
    for name in ("a", "b", "c", "b"):
        lora_llm.generate({"prompt_token_ids": prompts[0]}, GREEDY,
                          lora_request=_req(adapters, name))
    assert [lid for lid, _ in runner.loras.loaded] == [3, 2]


def test_bad_adapters_are_refused_by_name(lora_llm, tiny_model_dir, adapters, tmp_path):
    def refused(lora, match):
        with pytest.raises(ValueError, match=match):
            lora_llm.generate("Hello", GREEDY, lora_request=lora)
    refused(LoRARequest("x", 11, str(tmp_path / "nowhere")), "lora_path: .* not a directory")
    big = make_adapter(str(tmp_path / "big"), tiny_model_dir, r=32, seed=4)
    refused(LoRARequest("big", 12, big), "LoRA rank 32 is greater than max_lora_rank 16")
    dora = make_adapter(str(tmp_path / "dora"), tiny_model_dir, seed=5, use_dora=True)
    refused(LoRARequest("dora", 13, dora), "use_dora: DoRA")
    head = make_adapter(str(tmp_path / "head"), tiny_model_dir, seed=6,
                        target_modules=["q_proj", "lm_head"])
    refused(LoRARequest("head", 14, head), "target_modules: 'lm_head' is not supported")
    save = make_adapter(str(tmp_path / "save"), tiny_model_dir, seed=7,
                        modules_to_save=["lm_head"])
    refused(LoRARequest("save", 15, save), "modules_to_save")
    bias = make_adapter(str(tmp_path / "bias"), tiny_model_dir, seed=8, bias="all")
    refused(LoRARequest("bias", 16, bias), "bias: 'all'")
    # one id is one adapter: another path under a's id would share a's cached KV
    refused(LoRARequest("other", 1, adapters["b"]), "lora_int_id 1 is adapter")
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("zero", 0, adapters["a"])


def test_adapter_of_another_model_is_refused(lora_llm, model_dirs, tmp_path):
    # the same layers, another intermediate_size (160, not 128)
    other = make_adapter(str(tmp_path / "other"), model_dirs["llama3-gqa"], seed=9)
    with pytest.raises(ValueError, match="do not fit the base model"):
        lora_llm.generate("Hello", GREEDY, lora_request=LoRARequest("o", 21, other))


def test_lora_request_needs_enable_lora(tiny_llm, adapters):
    with pytest.raises(ValueError, match="lora_request: LoRA adapters are served with "
                                         "enable_lora=True"):
        tiny_llm.generate("Hello", GREEDY, lora_request=_req(adapters, "a"))


def test_lora_config_is_checked(tiny_model_dir, adapters):
    from llm_serving import EngineArgs
    from llm_serving.errors import ConfigError
    with pytest.raises(ConfigError, match="max_cpu_loras: 1 is fewer than max_loras"):
        EngineArgs(tiny_model_dir, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="max_lora_rank: expected a positive integer"):
        EngineArgs(tiny_model_dir, enable_lora=True, max_lora_rank=0)
    with pytest.raises(ConfigError, match="enable_lora: .*tensor_parallel_size 2"):
        EngineArgs(tiny_model_dir, enable_lora=True,
                   tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ConfigError, match="lora_modules: adapters are served with enable_lora"):
        EngineArgs(tiny_model_dir, lora_modules=[f"a={adapters['a']}"]).create_engine_config()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_adapter_requests_resume_with_their_adapter(tiny_model_dir, adapters,
                                                              prompts, reference, mode):
    """A pool of 13 blocks holds two of these prompts (6 blocks each), not their outputs (7
    each): running requests are preempted (recomputed or swapped) and come back with their
    own adapter; n = 2 children share their parent's adapter."""
    llm = LLM(tiny_model_dir, num_blocks=13, enable_lora=True, max_loras=2,
              preemption_mode=mode, swap_space=0.01)
    names = ["a", None, "b", "a", "b", None]
    outs = llm.generate([{"prompt_token_ids": prompts[2]}] * len(names), GREEDY,
                        lora_request=[_req(adapters, n) for n in names])
    for out, name in zip(outs, names):
        assert out.outputs[0].token_ids == reference[name][2][1], name
    assert llm.engine.stats.num_preemptions > 0
    assert (llm.engine.stats.num_swap_preemptions > 0) == (mode == "swap")
    two = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, n=2)
    out = llm.generate({"prompt_token_ids": prompts[1]}, two,
                       lora_request=_req(adapters, "b"))[0]
    assert [o.token_ids for o in out.outputs] == [reference["b"][1][1]] * 2


def test_requests_behind_an_adapter_waiting_for_a_slot_go_ahead(tiny_model_dir, adapters,
                                                                prompts, reference):
    """max_loras 1, a running: b waits for the adapter slot, and the base request and the
    second a request queued behind b start at once (as vLLM passes b over); b runs once a
    is done, and every answer is its own."""
    llm = LLM(tiny_model_dir, num_blocks=256, enable_lora=True, max_loras=1)
    eng, names = llm.engine, ["a", "b", None, "a"]
    rids = [eng.add_request({"prompt_token_ids": prompts[1]}, GREEDY,
                            lora_request=_req(adapters, n)) for n in names]
    done = {o.request_id: o for o in eng.step() if o.finished}
    running = {s.request_id for s in eng.scheduler.running}
    assert running == {rids[0], rids[2], rids[3]}
    assert [s.request_id for s in eng.scheduler.waiting] == [rids[1]]
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    for rid, name in zip(rids, names):
        assert done[rid].outputs[0].token_ids == reference[name][1][1], name


def test_beam_search_runs_with_each_prompts_adapter(lora_llm, adapters, prompts,
                                                    tiny_model_dir):
    """LLM.beam_search with one adapter per prompt: each prompt's beams are transformers'
    beam search on the base model with that prompt's adapter merged."""
    from llm_serving import BeamSearchParams
    names = ["a", None]
    outs = lora_llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]],
                                BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True),
                                lora_request=[_req(adapters, n) for n in names])
    for p, name, out in zip(prompts, names, outs):
        model = merged_hf_model(tiny_model_dir, adapters[name] if name else None)
        ids = torch.tensor([p])
        ref = model.generate(ids, num_beams=2, num_return_sequences=2, max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, eos_token_id=None,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)
        assert [b.tokens[len(p):] for b in out.sequences] == \
            [s[len(p):].tolist() for s in ref]
