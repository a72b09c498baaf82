"""Qwen3ForCausalLM (q and k normalized per head before rotary, a head_dim that is not
hidden_size / num_heads, tied embeddings) against HF transformers' Qwen3ForCausalLM on torch
CPU, fp32: the built-in tiny Qwen3's prefill logits within 5e-3 and 32 greedy tokens
identical, for one request and a ragged batch of 8, on our kernels and on the MindSpore-op
path (Ascend's); replayed decode steps and two tensor-parallel ranks give the same tokens."""
from __future__ import annotations


import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import (GREEDY, _prefill_logits, _prompts, hf_logits_and_greedy,
                               assert_two_ranks_give)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024


@pytest.fixture(scope="module")
def hf_reference(qwen3_model_dir):
    """HF's logits over each prompt and its 32 greedy tokens, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_model_dir,
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    prompts = _prompts(VOCAB)
    return (prompts, *hf_logits_and_greedy(model, prompts))


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_model_dir):
    return LLM(qwen3_model_dir, block_size=16, num_blocks=256)


def test_qwen3_config_json_is_read_as_transformers_reads_it():
    # Qwen3-0.6B's config.json
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
           "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
           "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
           "sliding_window": None, "max_window_layers": 28, "hidden_act": "silu"}
    c = ModelConfig.from_dict(cfg)
    assert (c.architecture, c.head_dim, c.q_size) == ("Qwen3ForCausalLM", 128, 2048)
    assert c.qk_norm and not c.qkv_bias and not c.o_bias and c.tie_word_embeddings
    # no head_dim: transformers' Qwen3Config default (128), not hidden_size / heads
    del cfg["head_dim"], cfg["architectures"]
    c = ModelConfig.from_dict(cfg)
    assert (c.architecture, c.head_dim) == ("Qwen3ForCausalLM", 128)
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    with pytest.raises(ModelLoadError, match="sliding-window"):
        ModelConfig.from_dict(dict(cfg, use_sliding_window=True, sliding_window=4096))


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_hf_single_and_batched(qwen3_model_dir, qwen3_llm, hf_reference,
                                                    native_ops, monkeypatch):
    prompts, ref_logits, _ = hf_reference
    llm = qwen3_llm
    if native_ops:                  # the layers' MindSpore-op path, which Ascend runs
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(qwen3_model_dir, block_size=16, num_blocks=256)
        assert not llm.engine.runner.model.model.layers[0].self_attn.q_norm._use_cpu
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_mindspore_ckpt_gives_the_same_logits(qwen3_model_dir, hf_reference, tmp_path):
    """A .ckpt written by save_mindformers_ckpt: the q/k norms keep their HF names there."""
    from llm_serving.model_executor.loader import save_mindformers_ckpt
    ckpt = save_mindformers_ckpt(qwen3_model_dir, str(tmp_path / "qwen3.ckpt"))
    prompts, ref_logits, _ = hf_reference
    llm = LLM(qwen3_model_dir, checkpoint=ckpt, num_blocks=64)
    np.testing.assert_allclose(_prefill_logits(llm, [prompts[4]])[0], ref_logits[4], atol=5e-3,
                               rtol=0)


def test_greedy_tokens_match_hf_generate_with_replayed_decode_steps(qwen3_llm, hf_reference):
    prompts, _, ref_tokens = hf_reference
    single = qwen3_llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert single.outputs[0].token_ids == ref_tokens[3]
    outs = qwen3_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
    stats = qwen3_llm.engine.runner.graphs.stats
    assert stats.replayed_steps > 20 and not stats.failed


def test_replayed_decode_steps_give_the_eager_tokens_and_logprobs(qwen3_model_dir):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, int(rng.integers(3, 40))).tolist()}
               for _ in range(9)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2,
                             ignore_eos=True, max_tokens=12 + 5 * i) for i in range(9)]
    runs = {}
    for eager in (False, True):
        llm = LLM(qwen3_model_dir, num_blocks=128, block_size=16, max_num_seqs=6,
                  enforce_eager=eager)
        runs[eager] = (llm.generate(prompts, params), llm.engine.runner.graphs)
    (replayed, graphs), (eager, _) = runs[False], runs[True]
    assert graphs.stats.replayed_steps > 20 and len(graphs.stats.captured) >= 3
    assert not graphs.stats.failed
    for r, e in zip(replayed, eager):
        assert r.outputs[0].token_ids == e.outputs[0].token_ids
        assert r.outputs[0].logprobs == e.outputs[0].logprobs


def test_two_tensor_parallel_ranks_give_hf_greedy_tokens(qwen3_model_dir, hf_reference):
    """Each rank holds 2 of the 4 query heads and 1 of the 2 KV heads, and the whole q/k norm
    weights."""
    prompts, _, ref_tokens = hf_reference
    assert_two_ranks_give(prompts[:6], ref_tokens[:6], qwen3_model_dir)


def test_server_serves_qwen3_as_the_offline_engine_does(tmp_path, qwen3_model_dir, qwen3_llm):
    """start.py on the Qwen3 checkpoint: an OpenAI client's greedy completion and chat are the
    offline engine's tokens."""
    import openai

    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, qwen3_model_dir, agent_ports=(free_port(),))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(model="tiny", prompt="Give three tips", max_tokens=8,
                                      temperature=0)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
            temperature=0)
    finally:
        assert stop_server(proc) == 0
    assert r.usage.completion_tokens == 8 and r.choices[0].text
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert r.choices[0].text == qwen3_llm.generate("Give three tips", params)[0].outputs[0].text
    offline = qwen3_llm.chat([{"role": "user", "content": "Hello"}], params)[0].outputs[0]
    assert chat.choices[0].message.content == offline.text


def test_yarn_rope_scaling_matches_hf(qwen3_model_dir, tmp_path):
    """Qwen3's long-context setting (rope_scaling yarn, as its model cards give it): HF's
    logits and greedy tokens. original_max_position_embeddings 64, so that the prompts' positions
    reach past it and the ramp between kept and interpolated frequencies matters; the
    attention factor (0.1 ln 4 + 1) scales cos and sin."""
    import json
    import shutil
    d = tmp_path / "qwen3-yarn"
    shutil.copytree(qwen3_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    prompts = [p for p in _prompts(VOCAB) if len(p) in (5, 129, 250)]
    ref_logits, ref_tokens = hf_logits_and_greedy(model, prompts, 16)
    llm = LLM(str(d), block_size=16, num_blocks=128)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens
