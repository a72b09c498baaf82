"""Qwen3MoeForCausalLM (Qwen3-30B-A3B's architecture) against HF transformers'
Qwen3MoeForCausalLM on torch CPU, fp32, on the built-in tiny Qwen3-MoE (8 experts, top 2,
layer 1 of 3 dense through mlp_only_layers): prefill logits within 5e-3 for one request and a
ragged batch, on our kernels and on the MindSpore-op path (Ascend's), and 32 greedy tokens
identical with decode steps replayed from CPU graphs; a .ckpt round trip; a real server."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ConfigError, ModelLoadError
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import (GREEDY, _prefill_logits, _prompts, hf_logits_and_greedy,
                               assert_two_ranks_give)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024

# Qwen3-30B-A3B's config.json (the MoE and attention keys)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "hidden_act": "silu",
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}


@pytest.fixture(scope="module")
def hf_model(qwen3_moe_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_moe_model_dir,
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    return model


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """HF's logits over each prompt and its 32 greedy tokens, one prompt at a time."""
    prompts = _prompts(VOCAB)
    return (prompts, *hf_logits_and_greedy(hf_model, prompts))


@pytest.fixture(scope="module")
def moe_llm(qwen3_moe_model_dir):
    return LLM(qwen3_moe_model_dir, block_size=16, num_blocks=256)


def test_qwen3_moe_config_json_is_read_as_transformers_reads_it():
    c = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert (c.architecture, c.head_dim, c.num_experts, c.num_experts_per_tok,
            c.moe_intermediate_size) == ("Qwen3MoeForCausalLM", 128, 128, 8, 768)
    assert c.qk_norm and c.norm_topk_prob and not c.qkv_bias
    assert all(c.is_moe_layer(i) for i in range(48))
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    # transformers' defaults: norm_topk_prob false, step 1, no dense layers
    cfg = {k: v for k, v in QWEN3_30B_A3B.items()
           if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    assert not ModelConfig.from_dict(cfg).norm_topk_prob
    c = ModelConfig.from_dict(dict(cfg, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ModelLoadError, match="num_experts_per_tok .9. must not exceed "
                                             "num_experts .8."):
        ModelConfig.from_dict(dict(cfg, num_experts=8, num_experts_per_tok=9))
    assert not ModelConfig.from_dict(dict(cfg, num_experts=0)).is_moe_layer(0)
    with pytest.raises(ModelLoadError, match="mlp_only_layers must be a list"):
        ModelConfig.from_dict(dict(cfg, mlp_only_layers="0"))


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_hf_single_and_batched(qwen3_moe_model_dir, moe_llm, hf_reference,
                                                    native_ops, monkeypatch):
    prompts, ref_logits, _ = hf_reference
    llm = moe_llm
    if native_ops:                  # the layers' MindSpore-op path, which Ascend runs
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(qwen3_moe_model_dir, block_size=16, num_blocks=256)
        assert not llm.engine.runner.model.model.layers[0].mlp._use_cpu
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_norm_topk_prob_false_weights_experts_by_their_probabilities(qwen3_moe_model_dir,
                                                                      tmp_path):
    """Without norm_topk_prob (transformers' default), the chosen experts keep their softmax
    probabilities over all experts: HF's logits still."""
    d = tmp_path / "qwen3-moe-unnormalized"
    shutil.copytree(qwen3_moe_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["norm_topk_prob"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    prompts = [p for p in _prompts(VOCAB) if len(p) in (17, 100)]
    ref_logits, _ = hf_logits_and_greedy(model, prompts, 1)
    llm = LLM(str(d), block_size=16, num_blocks=64)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_greedy_tokens_match_hf_generate_with_replayed_decode_steps(moe_llm, hf_reference):
    """The routing changes with every step's data: replayed steps call the MoE block on it."""
    prompts, _, ref_tokens = hf_reference
    single = moe_llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert single.outputs[0].token_ids == ref_tokens[3]
    outs = moe_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
    stats = moe_llm.engine.runner.graphs.stats
    assert stats.replayed_steps > 20 and not stats.failed


def test_replayed_decode_steps_give_the_eager_tokens_and_logprobs(qwen3_moe_model_dir):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, int(rng.integers(3, 40))).tolist()}
               for _ in range(7)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2,
                             ignore_eos=True, max_tokens=10 + 4 * i) for i in range(7)]
    runs = {}
    for eager in (False, True):
        llm = LLM(qwen3_moe_model_dir, num_blocks=128, block_size=16, max_num_seqs=5,
                  enforce_eager=eager)
        runs[eager] = (llm.generate(prompts, params), llm.engine.runner.graphs)
    (replayed, graphs), (eager, _) = runs[False], runs[True]
    assert graphs.stats.replayed_steps > 10 and len(graphs.stats.captured) >= 2
    assert not graphs.stats.failed
    for r, e in zip(replayed, eager):
        assert r.outputs[0].token_ids == e.outputs[0].token_ids
        assert r.outputs[0].logprobs == e.outputs[0].logprobs


def test_mindspore_ckpt_gives_the_same_logits(qwen3_moe_model_dir, hf_reference, tmp_path):
    """A .ckpt written by save_mindformers_ckpt: the router and experts keep their HF names."""
    from llm_serving.model_executor.loader import save_mindformers_ckpt
    ckpt = save_mindformers_ckpt(qwen3_moe_model_dir, str(tmp_path / "qwen3moe.ckpt"))
    prompts, ref_logits, _ = hf_reference
    llm = LLM(qwen3_moe_model_dir, checkpoint=ckpt, num_blocks=64)
    np.testing.assert_allclose(_prefill_logits(llm, [prompts[4]])[0], ref_logits[4], atol=5e-3,
                               rtol=0)


def test_two_tensor_parallel_ranks_give_hf_greedy_tokens(qwen3_moe_model_dir, hf_reference):
    """Each rank holds half of every expert (16 of its 32 columns) and the whole router; the
    experts' partial sums are all-reduced once per MoE layer."""
    prompts, _, ref_tokens = hf_reference
    assert_two_ranks_give(prompts[:6], ref_tokens[:6], qwen3_moe_model_dir)


def test_tensor_parallel_size_must_divide_each_expert(qwen3_moe_model_dir, tmp_path):
    d = tmp_path / "qwen3-moe-odd-experts"
    shutil.copytree(qwen3_moe_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 33
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="2 does not divide the model's "
                                          "moe_intermediate_size .33.") as e:
        LLM(str(d), tensor_parallel_size=2, num_blocks=64)
    assert e.value.key == "tensor_parallel_size"


def test_server_serves_qwen3_moe_as_the_offline_engine_does(tmp_path, qwen3_moe_model_dir,
                                                            moe_llm):
    """start.py on the Qwen3-MoE checkpoint: an OpenAI client's greedy completion is the
    offline engine's."""
    import openai

    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, qwen3_moe_model_dir, agent_ports=(free_port(),))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(model="tiny", prompt="Give three tips", max_tokens=16,
                                      temperature=0)
    finally:
        assert stop_server(proc) == 0
    assert r.usage.completion_tokens == 16 and r.choices[0].text
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert r.choices[0].text == moe_llm.generate("Give three tips", params)[0].outputs[0].text
