"""GPTBigCodeForCausalLM (StarCoder, WizardCoder: llm-serving's ``wizard_coder``) against HF
transformers' GPTBigCodeForCausalLM on torch CPU, fp32, on the built-in tiny GPTBigCode (random
weights in safetensors): prefill logits within 5e-3 for one prompt and a ragged batch of 8, on
our kernels and on the MindSpore-op path (Ascend's); 32 greedy tokens identical with decode
steps replayed from captures, after chunked prefill, with multi_query false, on two
tensor-parallel ranks and with multi-stream micro-batches; a server started on
``builtin:tiny-gpt-bigcode`` answers llm-serving's generate route and an OpenAI completion with
the offline engine's tokens."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.cli_args import STOP_WITH_PARENT_ENV
from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import (GREEDY, _prefill_logits, _prompts, hf_logits_and_greedy,
                               assert_two_ranks_give)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024
ROOT = Path(__file__).resolve().parents[1]

# bigcode/starcoder's config.json (WizardCoder-15B-V1.0 has the same keys), trimmed
STARCODER = {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode",
             "activation_function": "gelu", "n_embd": 6144, "n_head": 48, "n_inner": 24576,
             "n_layer": 40, "n_positions": 8192, "layer_norm_epsilon": 1e-05,
             "multi_query": True, "scale_attn_weights": True, "vocab_size": 49152,
             "bos_token_id": 0, "eos_token_id": 0, "attention_softmax_in_fp32": True,
             "scale_attention_softmax_in_fp32": True}


def _hf(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == "GPTBigCodeForCausalLM"
    return model


@pytest.fixture(scope="module")
def hf_reference(gpt_bigcode_model_dir):
    prompts = _prompts(VOCAB)
    return (prompts, *hf_logits_and_greedy(_hf(gpt_bigcode_model_dir), prompts))


@pytest.fixture(scope="module")
def bigcode_llm(gpt_bigcode_model_dir):
    return LLM(gpt_bigcode_model_dir, block_size=16, num_blocks=256)


def test_starcoder_config_json_is_read_as_transformers_reads_it():
    c = ModelConfig.from_dict(STARCODER)
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.intermediate_size, c.max_position_embeddings) == (
        "GPTBigCodeForCausalLM", 6144, 40, 48, 1, 128, 24576, 8192)
    assert c.gelu_approximate == "none" and c.tie_word_embeddings and c.multi_query
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    # transformers' defaults: n_inner 4 x n_embd, gelu_pytorch_tanh, multi_query
    c = ModelConfig.from_dict({"model_type": "gpt_bigcode", "n_embd": 64, "n_head": 4,
                               "n_layer": 2, "vocab_size": 1024})
    assert (c.intermediate_size, c.gelu_approximate, c.num_kv_heads) == (256, "tanh", 1)
    assert ModelConfig.from_dict(dict(STARCODER, multi_query=False)).num_kv_heads == 48
    with pytest.raises(ModelLoadError, match="activation_function"):
        ModelConfig.from_dict(dict(STARCODER, activation_function="relu"))
    with pytest.raises(ModelLoadError, match="scale_attn_weights"):
        ModelConfig.from_dict(dict(STARCODER, scale_attn_weights=False))


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_hf_single_and_batched(gpt_bigcode_model_dir, bigcode_llm,
                                                    hf_reference, native_ops, monkeypatch):
    prompts, ref_logits, _ = hf_reference
    llm = bigcode_llm
    if native_ops:                  # the layers' MindSpore-op path, which Ascend runs
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(gpt_bigcode_model_dir, block_size=16, num_blocks=256)
        assert not llm.engine.runner.model.transformer.ln_f._use_cpu
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_greedy_tokens_match_hf_generate_with_replayed_decode_steps(bigcode_llm, hf_reference):
    prompts, _, ref_tokens = hf_reference
    single = bigcode_llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert single.outputs[0].token_ids == ref_tokens[3]
    outs = bigcode_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
    stats = bigcode_llm.engine.runner.graphs.stats
    assert stats.replayed_steps > 20 and not stats.failed


def test_chunked_prefill_mixed_with_decodes_matches_hf(gpt_bigcode_model_dir, hf_reference):
    """A 40-token budget cuts the long prompts into chunks (their positions continue into
    the learned position table) that share steps with other requests' decodes."""
    prompts, _, ref_tokens = hf_reference
    llm = LLM(gpt_bigcode_model_dir, block_size=16, num_blocks=256, max_num_batched_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for out, ref in zip(outs, ref_tokens):
        assert out.outputs[0].token_ids == ref
    assert llm.engine.runner.graphs.stats.replayed_steps > 0


def test_multi_head_kv_and_exact_gelu_match_hf(gpt_bigcode_model_dir, tmp_path):
    """multi_query false (c_attn packs q, k, v per head) with the exact GELU (StarCoder's
    activation_function "gelu")."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    d = make_tiny_model(str(tmp_path / "mha"), **dict(PRESETS["tiny-gpt-bigcode"],
                                                       num_kv_heads=4, seed=3))
    cfg = json.loads(Path(d, "config.json").read_text())
    assert cfg["multi_query"] is False
    cfg["activation_function"] = "gelu"
    Path(d, "config.json").write_text(json.dumps(cfg))
    prompts = [p for p in _prompts(VOCAB) if len(p) in (5, 33, 250)]
    ref_logits, ref_tokens = hf_logits_and_greedy(_hf(d), prompts, 16)
    llm = LLM(d, block_size=16, num_blocks=128)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens


def test_two_tensor_parallel_ranks_give_hf_greedy_tokens(gpt_bigcode_model_dir, hf_reference):
    """Each rank holds 2 of the 4 query heads, half of the MLP and of the vocabulary, and the
    single KV head whole (replicated), with the whole position table."""
    prompts, _, ref_tokens = hf_reference
    assert_two_ranks_give(prompts[:6], ref_tokens[:6], gpt_bigcode_model_dir)


def test_server_on_builtin_model_answers_llm_serving_and_openai(tmp_path, bigcode_llm):
    """start.py --model builtin:tiny-gpt-bigcode (made on first use under LLM_SERVING_HOME):
    llm-serving's /models/llama2/generate and an OpenAI completion give the offline engine's
    greedy text."""
    import openai
    import requests

    from test_http_server import free_port, stop_server
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "start.py"), "--model", "builtin:tiny-gpt-bigcode",
         "--port", str(port), "--num-blocks", "256", "--max-model-len", "1024"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LLM_SERVING_HOME": str(tmp_path / "home"),
             STOP_WITH_PARENT_ENV: str(os.getpid())})
    try:
        deadline, line = time.monotonic() + 180, ""
        while time.monotonic() < deadline and "ready" not in line and proc.poll() is None:
            line = proc.stdout.readline()
        assert "ready" in line, proc.stderr.read()[-2000:] if proc.poll() is not None else line
        url = f"http://127.0.0.1:{port}"
        body = {"inputs": "def fib(n):", "parameters": {"max_new_tokens": 12,
                                                        "do_sample": False}}
        r = requests.post(url + "/models/llama2/generate", json=body, timeout=120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        c = client.completions.create(model="builtin:tiny-gpt-bigcode", prompt="def fib(n):",
                                      max_tokens=12, temperature=0)
    finally:
        code = stop_server(proc)
    assert code == 0
    assert r.status_code == 200, r.text
    ref = bigcode_llm.generate("def fib(n):", SamplingParams(temperature=0.0,
                                                              max_tokens=12))[0].outputs[0]
    obj = r.json()
    assert obj["generated_text"] == ref.text and obj["generated_tokens"] == len(ref.token_ids)
    assert [t["id"] for t in obj["tokens"]] == ref.token_ids
    assert c.choices[0].text == ref.text and c.usage.completion_tokens == len(ref.token_ids)
    shutil.rmtree(tmp_path / "home", ignore_errors=True)


def test_multi_stream_sequential_gives_the_same_logits_and_tokens(gpt_bigcode_model_dir):
    """The multi-stream schedule (two micro-batches through forward_attn / forward_ffn, after
    wte + wpe) under chunked prefill, prefix caching and preemption: the unsplit run's tokens
    and logprobs."""
    from test_multistream import ALWAYS, ENGINE, _check_same, _run, _workload
    prompts, params = _workload(seed=1)
    ref = _run(LLM(gpt_bigcode_model_dir, **ENGINE), prompts, params)
    on = LLM(gpt_bigcode_model_dir, enable_multi_stream=True,
             multi_stream=dict(ALWAYS, overlap="sequential"), **ENGINE)
    _check_same(on, ref, prompts, params)
