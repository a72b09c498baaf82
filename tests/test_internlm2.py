"""InternLM2ForCausalLM (internlm2-chat-7b, internlm2.5: remote code in transformers) is Llama's
math under other names, q, k and v packed per KV group in attention.wqkv. The reference is
transformers' LlamaForCausalLM on the same weights unpacked here (torch CPU, fp32), with the
checkpoint's dynamic NTK rope scaling: the built-in tiny InternLM2's prefill logits within 5e-3
and 32 greedy tokens identical for one request and a ragged batch of 8, the same tokens on two
tensor-parallel ranks (each unpacking its own KV head's q, k and v), and a real server
answering llm-serving's /models/internlm/generate body with the offline engine's text."""
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
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 1024
LLAMA_NAMES = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
               "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
               "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def as_llama(internlm2_dir, out_dir):
    """The checkpoint as a transformers LlamaForCausalLM: names mapped, and each layer's wqkv
    [kv heads * (groups + 2) * head_dim, hidden] cut into q, k and v."""
    cfg = json.loads((internlm2_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    groups = heads // kv_heads
    tensors = safetensors_torch.load_file(str(internlm2_dir / "model.safetensors"))
    llama = {"model.embed_tokens.weight": tensors.pop("model.tok_embeddings.weight"),
             "lm_head.weight": tensors.pop("output.weight"),
             "model.norm.weight": tensors.pop("model.norm.weight")}
    for name, t in tensors.items():
        layer, part = name[len("model.layers."):].split(".", 1)
        p = f"model.layers.{layer}."
        if part == "attention.wqkv.weight":
            per_kv = t.view(kv_heads, groups + 2, head_dim, -1)
            llama[p + "self_attn.q_proj.weight"] = per_kv[:, :groups].reshape(-1, t.shape[1])
            llama[p + "self_attn.k_proj.weight"] = per_kv[:, groups].reshape(-1, t.shape[1])
            llama[p + "self_attn.v_proj.weight"] = per_kv[:, groups + 1].reshape(-1, t.shape[1])
        else:
            llama[p + LLAMA_NAMES[part.rsplit(".", 1)[0]] + ".weight"] = t
    out_dir.mkdir(parents=True)
    safetensors_torch.save_file({k: v.contiguous() for k, v in llama.items()},
                                str(out_dir / "model.safetensors"))
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama",
               attention_bias=cfg.pop("bias"))
    (out_dir / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(internlm2_dir / f, out_dir / f)
    return str(out_dir)


@pytest.fixture(scope="module")
def hf_reference(internlm2_model_dir, tmp_path_factory):
    from pathlib import Path
    llama_dir = as_llama(Path(internlm2_model_dir), tmp_path_factory.mktemp("ref") / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir,
                                                              dtype=torch.float32).eval()
    assert model.config.rope_scaling["rope_type"] == "dynamic"
    prompts = _prompts(VOCAB)
    return (prompts, *hf_logits_and_greedy(model, prompts))


@pytest.fixture(scope="module")
def internlm2_llm(internlm2_model_dir):
    return LLM(internlm2_model_dir, block_size=16, num_blocks=256)


def test_internlm2_config_json_is_read_as_its_remote_code_reads_it():
    # internlm2-chat-7b's config.json (auto_map left out)
    cfg = {"architectures": ["InternLM2ForCausalLM"], "attn_implementation": "eager",
           "bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "model_type": "internlm2",
           "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
           "pad_token_id": 2, "rms_norm_eps": 1e-05,
           "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1000000,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 92544}
    c = ModelConfig.from_dict(cfg)
    assert (c.architecture, c.num_kv_heads, c.head_dim, c.rope_theta) == (
        "InternLM2ForCausalLM", 8, 128, 1e6)
    assert not c.qkv_bias and not c.o_bias
    assert c.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
    assert c.max_position_embeddings == 32768
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    del cfg["architectures"], cfg["bias"]              # InternLM2Config's default: biases
    c = ModelConfig.from_dict(cfg)
    assert c.architecture == "InternLM2ForCausalLM" and c.qkv_bias and c.o_bias
    with pytest.raises(ModelLoadError, match="dynamic needs a numeric 'factor'"):
        ModelConfig.from_dict(dict(cfg, rope_scaling={"type": "dynamic"}))


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_hf_single_and_batched(internlm2_model_dir, internlm2_llm,
                                                    hf_reference, native_ops, monkeypatch):
    prompts, ref_logits, _ = hf_reference
    llm = internlm2_llm
    if native_ops:                  # the layers' MindSpore-op path, which Ascend runs
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(internlm2_model_dir, block_size=16, num_blocks=256)
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_greedy_tokens_match_hf_generate(internlm2_llm, hf_reference):
    prompts, _, ref_tokens = hf_reference
    single = internlm2_llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert single.outputs[0].token_ids == ref_tokens[3]
    outs = internlm2_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref


def test_two_tensor_parallel_ranks_give_hf_greedy_tokens(internlm2_model_dir, hf_reference):
    """Each rank holds 2 of the 4 query heads and 1 of the 2 KV heads: its own KV group's q, k
    and v out of every wqkv."""
    prompts, _, ref_tokens = hf_reference
    assert_two_ranks_give(prompts[:6], ref_tokens[:6], internlm2_model_dir)


def test_a_wqkv_of_the_wrong_size_is_refused_by_name(internlm2_model_dir, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(internlm2_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=4)))
    with pytest.raises(Exception, match=r"model\.layers\.0\.attention\.wqkv\.weight"):
        LLM(str(d), num_blocks=16)


def test_server_answers_llm_servings_internlm_routes(tmp_path, internlm2_model_dir,
                                                     internlm2_llm):
    """start.py on the InternLM2 checkpoint: llm-serving's client body on
    /models/internlm/generate gets the offline engine's greedy text."""
    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, internlm2_model_dir, agent_ports=(free_port(),))
    body = {"inputs": "Give three tips for staying healthy.",
            "parameters": {"max_new_tokens": 8, "do_sample": False}}
    try:
        r = requests.post(url + "/models/internlm/generate", json=body, timeout=120)
    finally:
        assert stop_server(proc) == 0
    ref = internlm2_llm.generate(body["inputs"], SamplingParams(temperature=0.0, max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == ref[0].outputs[0].text != ""
