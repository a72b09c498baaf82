"""InternLMForCausalLM (internlm-7b, internlm-20b: what llm-serving served as internlm_7b) is
Llama with biases on the q, k, v and o projections under Llama's weight names. transformers
has it only as remote code, so the reference is its LlamaForCausalLM with attention_bias on the
same weights (torch CPU, fp32): the built-in tiny InternLM's prefill logits within 5e-3 and 32
greedy tokens identical, for one request and a ragged batch of 8 and on two tensor-parallel
ranks; and a real server answers llm-serving's /models/internlm routes with the offline engine's
text."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import requests

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import (GREEDY, _prefill_logits, _prompts, hf_logits_and_greedy,
                               assert_two_ranks_give)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024


def as_llama(internlm_dir, out_dir):
    """The same weights as a transformers LlamaForCausalLM: InternLM's config keys in Llama's
    spelling (its weight names are Llama's already)."""
    shutil.copytree(internlm_dir, out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    rotary = cfg.pop("rotary")
    assert rotary["type"] == "dynamic"      # keeps the base within max_position_embeddings
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama",
               attention_bias=cfg.pop("bias"), rope_theta=rotary["base"],
               num_key_value_heads=cfg["num_attention_heads"])
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return str(out_dir)


@pytest.fixture(scope="module")
def hf_reference(internlm_model_dir, tmp_path_factory):
    llama_dir = as_llama(internlm_model_dir, tmp_path_factory.mktemp("ref") / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir,
                                                              dtype=torch.float32).eval()
    assert model.config.attention_bias
    assert model.model.layers[0].self_attn.o_proj.bias.abs().sum() > 0
    prompts = _prompts(VOCAB)
    return (prompts, *hf_logits_and_greedy(model, prompts))


@pytest.fixture(scope="module")
def internlm_llm(internlm_model_dir):
    return LLM(internlm_model_dir, block_size=16, num_blocks=256)


def test_internlm_config_json_is_read_as_its_remote_code_reads_it():
    # internlm-chat-7b's config.json (the HF repository's, auto_map left out)
    cfg = {"architectures": ["InternLMForCausalLM"], "bias": True, "bos_token_id": 1,
           "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
           "intermediate_size": 11008, "max_position_embeddings": 2048,
           "model_type": "internlm", "num_attention_heads": 32, "num_hidden_layers": 32,
           "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
           "torch_dtype": "float16", "vocab_size": 103168,
           "rotary": {"base": 10000, "type": "dynamic"}}
    c = ModelConfig.from_dict(cfg)
    assert (c.architecture, c.num_kv_heads, c.head_dim, c.rope_theta) == (
        "InternLMForCausalLM", 32, 128, 10000.0)
    assert c.qkv_bias and c.o_bias and c.rope_scaling is None
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    # InternLMConfig's defaults: biases on, the rotary base 10000
    del cfg["bias"], cfg["rotary"], cfg["architectures"]
    c = ModelConfig.from_dict(cfg)
    assert c.qkv_bias and c.o_bias and c.rope_theta == 10000.0
    c = ModelConfig.from_dict(dict(cfg, bias=False, rotary={"base": 50000, "type": "origin"}))
    assert not c.qkv_bias and not c.o_bias and c.rope_theta == 50000.0
    with pytest.raises(ModelLoadError, match="rotary"):
        ModelConfig.from_dict(dict(cfg, rotary={"base": 10000, "type": "yarn"}))


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_hf_single_and_batched(internlm_model_dir, internlm_llm,
                                                    hf_reference, native_ops, monkeypatch):
    prompts, ref_logits, _ = hf_reference
    llm = internlm_llm
    if native_ops:                  # the layers' MindSpore-op path, which Ascend runs
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(internlm_model_dir, block_size=16, num_blocks=256)
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_greedy_tokens_match_hf_generate(internlm_llm, hf_reference):
    prompts, _, ref_tokens = hf_reference
    single = internlm_llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert single.outputs[0].token_ids == ref_tokens[3]
    outs = internlm_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref


def test_two_tensor_parallel_ranks_give_hf_greedy_tokens(internlm_model_dir, hf_reference):
    """Each rank holds 2 of the 4 heads with their q, k and v biases; o's bias is added once,
    after the sum of the ranks' partial outputs."""
    prompts, _, ref_tokens = hf_reference
    assert_two_ranks_give(prompts[:6], ref_tokens[:6], internlm_model_dir)


def test_mindspore_ckpt_gives_the_same_logits(internlm_model_dir, hf_reference, tmp_path):
    """A .ckpt with mindformers' names (attention.wo.bias and the q/k/v biases included)."""
    from llm_serving.model_executor.loader import save_mindformers_ckpt
    ckpt = save_mindformers_ckpt(internlm_model_dir, str(tmp_path / "internlm.ckpt"))
    prompts, ref_logits, _ = hf_reference
    llm = LLM(internlm_model_dir, checkpoint=ckpt, num_blocks=64)
    np.testing.assert_allclose(_prefill_logits(llm, [prompts[4]])[0], ref_logits[4], atol=5e-3,
                               rtol=0)


def test_server_answers_llm_servings_internlm_routes(tmp_path, internlm_model_dir,
                                                     internlm_llm):
    """start.py on the InternLM checkpoint: llm-serving's client body on
    /models/internlm/generate and generate_stream gets the offline engine's greedy text."""
    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, internlm_model_dir, agent_ports=(free_port(),))
    body = {"inputs": "Give three tips for staying healthy.",
            "parameters": {"max_new_tokens": 8, "do_sample": False}}
    try:
        r = requests.post(url + "/models/internlm/generate", json=body, timeout=120)
        lines = requests.post(url + "/models/internlm/generate_stream", json=body,
                              timeout=120).text.splitlines()
    finally:
        assert stop_server(proc) == 0
    ref = internlm_llm.generate(body["inputs"], SamplingParams(temperature=0.0, max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == ref[0].outputs[0].text != ""
    assert json.loads(lines[-1])["data"][0]["generated_text"] == ref[0].outputs[0].text
