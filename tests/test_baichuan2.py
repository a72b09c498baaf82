"""BaichuanForCausalLM, Baichuan2-7B's layout (q/k/v packed in W_pack, a NormHead, rotary
positions), against HF transformers' LlamaForCausalLM on the same weights converted here,
independently of our loader: W_pack split into q_proj/k_proj/v_proj by rows and lm_head's
rows L2-normalized (torch.nn.functional.normalize), as Baichuan2's remote code computes them.
Prefill logits within 5e-3 (one prompt, a ragged batch, our kernels and the MindSpore-op path)
and 32 greedy tokens identical with replayed decode steps; two tensor-parallel ranks; a .ckpt;
a real server answering llm-serving's /models/llama2/generate."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import (GREEDY, _prefill_logits, _prompts, hf_logits_and_greedy,
                               assert_two_ranks_give)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 1024


@pytest.fixture(scope="module")
def baichuan2_dir(tmp_path_factory):
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("baichuan2") / "tiny-baichuan2"),
                           **PRESETS["tiny-baichuan2"])


def as_llama_checkpoint(src: str, dst: Path, normalize_head: bool = True) -> str:
    """Baichuan2-7B's checkpoint as an HF LlamaForCausalLM one (the first Baichuan's, whose
    head is plain, with ``normalize_head`` False)."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    weights = safetensors_torch.load_file(str(Path(src) / "model.safetensors"))
    out = {}
    for name, w in weights.items():
        if name.endswith("self_attn.W_pack.weight"):
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), w.chunk(3, dim=0)):
                out[name.replace("W_pack", part)] = rows.contiguous()
        elif name == "lm_head.weight" and normalize_head:
            out[name] = torch.nn.functional.normalize(w.float(), dim=-1)
        else:
            out[name] = w
    dst.mkdir(parents=True)
    safetensors_torch.save_file(out, str(dst / "model.safetensors"))
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "num_key_value_heads": cfg["num_attention_heads"], "rope_theta": 10000.0,
             "attention_bias": False, "mlp_bias": False}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        llama[key] = cfg[key]
    (dst / "config.json").write_text(json.dumps(llama))
    shutil.copy(Path(src) / "generation_config.json", dst)     # the same stop tokens
    return str(dst)


@pytest.fixture(scope="module")
def hf_reference(baichuan2_dir, tmp_path_factory):
    path = as_llama_checkpoint(baichuan2_dir, tmp_path_factory.mktemp("ref") / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(VOCAB)
    return (prompts, *hf_logits_and_greedy(model, prompts))


@pytest.fixture(scope="module")
def baichuan2_llm(baichuan2_dir):
    return LLM(baichuan2_dir, block_size=16, num_blocks=256)


def test_baichuan2_7b_config_json_is_read():
    # Baichuan2-7B-Chat's config.json (auto_map left out)
    cfg = {"architectures": ["BaichuanForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
           "intermediate_size": 11008, "max_position_embeddings": 4096,
           "model_max_length": 4096, "model_type": "baichuan", "num_attention_heads": 32,
           "num_hidden_layers": 32, "pad_token_id": 0, "rms_norm_eps": 1e-06,
           "_from_model_config": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.29.2", "use_cache": True, "vocab_size": 125696,
           "z_loss_weight": 0, "tokenizer_class": "BaichuanTokenizer"}
    c = ModelConfig.from_dict(cfg)
    assert (c.architecture, c.num_kv_heads, c.head_dim, c.rope_theta) == (
        "BaichuanForCausalLM", 32, 128, 10000.0)
    assert c.norm_head and not c.qkv_bias and c.max_position_embeddings == 4096
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        ModelConfig.from_dict(dict(cfg, num_key_value_heads=8))


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_hf_single_and_batched(baichuan2_dir, baichuan2_llm, hf_reference,
                                                    native_ops, monkeypatch):
    prompts, ref_logits, _ = hf_reference
    llm = baichuan2_llm
    if native_ops:
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(baichuan2_dir, block_size=16, num_blocks=256)
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def test_greedy_tokens_match_hf_with_replayed_decode_steps(baichuan2_llm, hf_reference):
    prompts, _, ref_tokens = hf_reference
    outs = baichuan2_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens
    stats = baichuan2_llm.engine.runner.graphs.stats
    assert stats.replayed_steps > 20 and not stats.failed


def test_mindspore_ckpt_gives_the_same_logits(baichuan2_dir, hf_reference, tmp_path):
    from llm_serving.model_executor.loader import save_mindformers_ckpt
    ckpt = save_mindformers_ckpt(baichuan2_dir, str(tmp_path / "baichuan2.ckpt"))
    prompts, ref_logits, _ = hf_reference
    llm = LLM(baichuan2_dir, checkpoint=ckpt, num_blocks=64)
    np.testing.assert_allclose(_prefill_logits(llm, [prompts[4]])[0], ref_logits[4], atol=5e-3,
                               rtol=0)


def test_two_tensor_parallel_ranks_give_hf_greedy_tokens(baichuan2_dir, hf_reference):
    """Each rank holds 2 of the 4 heads' rows of each W_pack part and half the NormHead's
    (normalized) rows."""
    prompts, _, ref_tokens = hf_reference
    assert_two_ranks_give(prompts[:6], ref_tokens[:6], baichuan2_dir)


def test_server_answers_llm_serving_generate(tmp_path, baichuan2_dir, baichuan2_llm):
    """start.py on the Baichuan2 checkpoint: llm-serving's /models/llama2/generate gives the
    offline engine's greedy text."""
    import requests

    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, baichuan2_dir, agent_ports=(free_port(),))
    try:
        body = {"inputs": "Give three tips", "parameters": {"max_new_tokens": 12,
                                                            "ignore_eos": True}}
        r = requests.post(url + "/models/llama2/generate", json=body, timeout=120)
    finally:
        assert stop_server(proc) == 0
    assert r.status_code == 200, r.text
    offline = baichuan2_llm.generate("Give three tips", SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert r.json()["generated_text"] == offline.text and offline.text


def test_served_as_baichuan2pa_the_inputs_get_llm_servings_prompt_format(
        tmp_path, baichuan2_dir, baichuan2_llm):
    """llm-serving's baichuan2_13b_pa.yaml serves the model as 'baichuan2pa', and its
    send_request puts the inputs in '<reserved_106>{}<reserved_107>' (Baichuan2's user and
    assistant markers): its routes answer for that prompt here too, whole and streamed; the
    OpenAI route takes the prompt as sent."""
    import requests

    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, baichuan2_dir, agent_ports=(free_port(),),
                                model_name="baichuan2pa")
    question = "Give three tips {for} health"
    try:
        body = {"inputs": question, "parameters": {"max_new_tokens": 12, "ignore_eos": True}}
        whole = requests.post(url + "/models/llama2/generate", json=body, timeout=120)
        streamed = requests.post(url + "/models/baichuan2pa/generate_stream", json=body,
                                 timeout=120)
        completion = requests.post(url + "/v1/completions", json={
            "model": "baichuan2pa", "prompt": question, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}, timeout=120)
    finally:
        assert stop_server(proc) == 0
    assert whole.status_code == streamed.status_code == completion.status_code == 200
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    wrapped, plain = (o.outputs[0].text for o in baichuan2_llm.generate(
        [f"<reserved_106>{question}<reserved_107>", question], params))
    assert wrapped != plain
    assert whole.json()["generated_text"] == wrapped
    last = json.loads(streamed.text.splitlines()[-1])["data"][0]
    assert last["generated_text"] == wrapped
    assert completion.json()["choices"][0]["text"] == plain


def test_the_first_baichuan_has_a_plain_head(baichuan2_dir, tmp_path):
    """Baichuan-13B and Baichuan-7B (BaiChuanForCausalLM), vocabulary 64000, have a plain
    lm_head, which vLLM does not normalize (it tells Baichuan2 by its 125696 tokens): the same
    weights with the vocabulary padded to 64000 give HF's Llama logits with the head as it is,
    under either class name."""
    src = Path(baichuan2_dir)
    d = tmp_path / "baichuan1"
    shutil.copytree(src, d)
    weights = safetensors_torch.load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        pad = torch.randn(64000 - w.shape[0], w.shape[1], generator=g) * w.std()
        weights[name] = torch.cat([w, pad]).contiguous()
    safetensors_torch.save_file(weights, str(d / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    prompts = _prompts(VOCAB)[1:4]
    for arch in ("BaichuanForCausalLM", "BaiChuanForCausalLM"):
        (d / "config.json").write_text(json.dumps(dict(cfg, vocab_size=64000,
                                                       architectures=[arch])))
        c = ModelConfig.from_pretrained(str(d))
        assert not c.norm_head and not c.alibi and c.architecture == arch
        ours = _prefill_logits(LLM(str(d), num_blocks=64), prompts)
        ref_dir = as_llama_checkpoint(str(d), tmp_path / f"ref-{arch}", normalize_head=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            ref_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for o, p in zip(ours, prompts):
                ref = model(torch.tensor([p])).logits[0].numpy()
                np.testing.assert_allclose(o, ref, atol=5e-3, rtol=0)
