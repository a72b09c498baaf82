"""A checkpoint's own FP8 KV-cache scales (per-layer k_scale / v_scale, compressed-tensors'
kv_cache_scheme), as vLLM-CPU uses them: the cache holds fp8(k / k_scale), attention reads it
times k_scale (the same for v). Checked against transformers with an attention that rounds
key and value as that cache does, on tiny Llama and Qwen3 (per-head q/k norms) checkpoints
with scales added."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from lora_adapters import hf_logits_and_greedy
from safetensors.numpy import load_file, save_file

from llm_serving import LLM, LoRARequest, SamplingParams
from llm_serving.errors import ModelLoadError

NEW_TOKENS = 12
# per layer (k_scale, v_scale): not powers of two, so rounding k / k_scale to FP8 differs from
# rounding k; small enough that the largest keys and values saturate at +-448 unscaled-wise
SCALES = [(0.0113, 0.0071), (0.0093, 0.0052)]
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


def _with_scales(src: str, dst, scales=SCALES, quantization=None, names=("k_scale", "v_scale"),
                 attention="model.layers.{}.self_attn"):
    """A copy of the model at ``src`` with each layer's KV scales added (one scalar tensor
    each, named ``<attention>.<name>``), and config.json's quantization_config."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for i, pair in enumerate(scales):
        for name, s in zip(names, pair):
            tensors[f"{attention.format(i)}.{name}"] = np.asarray(s, np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    if quantization is not None:
        _set_quantization(str(dst), quantization)
    return str(dst)


def _set_quantization(path: str, quantization: dict) -> None:
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


def _scaled_fp8_attention(scales):
    """HF's sdpa attention over key / value stored as fp8(x / scale) (saturated at +-448,
    torch's rounding to nearest) and read back times the scale, per layer (module.layer_idx;
    a layer whose scales are None keeps them in float32)."""
    def attention(module, query, key, value, attention_mask, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        if scales[module.layer_idx] is not None:
            ks, vs = scales[module.layer_idx]
            key = (key / ks).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * ks
            value = (value / vs).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * vs
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    return attention


def _hf(model_dir: str, scales, model=None):
    """HF logits over the prompt and its greedy tokens, with the scaled FP8 attention (in
    ``model`` if given, else the model at ``model_dir``)."""
    name = f"kv_fp8_{id(scales)}"
    transformers.AttentionInterface.register(name, _scaled_fp8_attention(scales))
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.set_attn_implementation(name)
    return hf_logits_and_greedy(model.eval(), PROMPT, NEW_TOKENS)


PROMPT = np.random.default_rng(11).integers(3, 1024, 40).tolist()
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                        prompt_logprobs=0)


def _ours(llm) -> tuple:
    """Our prompt logprob of each prompt token (from position 1) and greedy tokens."""
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    return np.array(lp), out.outputs[0].token_ids


def _prompt_logprobs(logits: np.ndarray) -> np.ndarray:
    lp = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
    return lp[np.arange(len(PROMPT) - 1), PROMPT[1:]]


def _scaled(src: str, dst, **names) -> tuple:
    """(checkpoint with KV scales, HF reference with them, HF reference with unit scales)."""
    path = _with_scales(src, dst, **names)
    return path, _hf(path, SCALES), _hf(path, [(1.0, 1.0)] * len(SCALES))


@pytest.fixture(scope="module")
def scaled_llama(tiny_model_dir, tmp_path_factory):
    return _scaled(tiny_model_dir, tmp_path_factory.mktemp("kvs") / "llama")


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt_bigcode"])
def scaled(request, tmp_path_factory):
    """The tiny Llama's, the tiny Qwen3's (per-head q/k norms) or the tiny GPTBigCode's
    (c_attn, multi-query; scales named transformer.h.N.attn.k_scale) ``_scaled``."""
    if request.param == "llama":
        return request.getfixturevalue("scaled_llama")
    dst = tmp_path_factory.mktemp("kvs") / request.param
    if request.param == "qwen3":
        return _scaled(request.getfixturevalue("qwen3_model_dir"), dst)
    return _scaled(request.getfixturevalue("gpt_bigcode_model_dir"), dst,
                   attention="transformer.h.{}.attn")


def test_fp8_cache_with_checkpoint_scales_matches_hf(scaled):
    """kv_cache_dtype fp8 with the checkpoint's k_scale / v_scale: the prompt's logprobs within
    2e-3 of HF rounding k / k_scale and v / v_scale to FP8, the same greedy tokens; and the
    scales matter here (measured: ours within 3e-4 of it, unit scales 0.18-0.32 away)."""
    path, (ref_logits, ref_tokens), (unit_logits, _) = scaled
    llm = LLM(path, kv_cache_dtype="fp8", num_blocks=64)
    lp, tokens = _ours(llm)
    llm.engine.shutdown()
    ref, unit = _prompt_logprobs(ref_logits), _prompt_logprobs(unit_logits)
    np.testing.assert_allclose(lp, ref, atol=2e-3, rtol=0)
    assert tokens == ref_tokens
    assert np.abs(unit - ref).max() > 5e-2


def test_two_tensor_parallel_ranks_fold_their_own_rows(scaled_llama):
    """Two WorkAgents, each folding the scales into its own q/k/v rows and o_proj columns:
    HF's logprobs and tokens."""
    path, (ref_logits, ref_tokens), _ = scaled_llama
    llm = LLM(path, kv_cache_dtype="fp8", tensor_parallel_size=2, num_blocks=64)
    lp, tokens = _ours(llm)
    llm.engine.shutdown()
    np.testing.assert_allclose(lp, _prompt_logprobs(ref_logits), atol=2e-3, rtol=0)
    assert tokens == ref_tokens


def test_float_cache_ignores_the_scales(scaled_llama):
    """With a float32 KV cache the scales are not used (vLLM's rule): HF without rounding."""
    path = scaled_llama[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = _prompt_logprobs(hf(torch.tensor([PROMPT])).logits[0].numpy())
    llm = LLM(path, kv_cache_dtype="float32", num_blocks=64)
    lp, _ = _ours(llm)
    llm.engine.shutdown()
    np.testing.assert_allclose(lp, ref, atol=1e-4, rtol=0)


def test_layers_kept_in_float_by_skip_layers_do_not_use_the_scales(scaled):
    """kv_cache_dtype_skip_layers 1: layer 0's cache FP8 with its scales, layer 1's float32
    without (HF rounding layer 0 only), the same tokens."""
    path = scaled[0]
    logits, ref_tokens = _hf(path, [SCALES[0], None])
    llm = LLM(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["1"], num_blocks=64)
    lp, tokens = _ours(llm)
    llm.engine.shutdown()
    np.testing.assert_allclose(lp, _prompt_logprobs(logits), atol=2e-3, rtol=0)
    assert tokens == ref_tokens


def test_lora_adapters_take_the_folded_scales(tmp_path, tiny_model_dir):
    """A LoRA adapter on q, k, v and o over FP8 KV with the checkpoint's scales: HF with the
    adapter merged and the scaled rounding (its deltas are scaled as the weights are)."""
    from lora_adapters import make_adapter, merged_hf_model
    path = _with_scales(tiny_model_dir, tmp_path / "m")
    adapter = make_adapter(str(tmp_path / "a"), path, targets=("q_proj", "k_proj", "v_proj",
                                                               "o_proj"))
    logits, ref_tokens = _hf(path, SCALES, merged_hf_model(path, adapter))
    llm = LLM(path, kv_cache_dtype="fp8", num_blocks=64, enable_lora=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY,
                       lora_request=LoRARequest("a", 1, adapter))[0]
    llm.engine.shutdown()
    lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    np.testing.assert_allclose(lp, _prompt_logprobs(logits), atol=2e-3, rtol=0)
    assert out.outputs[0].token_ids == ref_tokens


def test_kv_cache_scheme_turns_auto_into_fp8(tiny_model_dir, tmp_path):
    """A quantization_config with only a kv_cache_scheme (llm-compressor's, for a float model
    with calibrated KV scales): kv_cache_dtype auto stores FP8 with the scales, as vLLM does;
    the same greedy tokens as HF with the scaled rounding."""
    path = _with_scales(tiny_model_dir, tmp_path / "m")
    _, ref_tokens = _hf(path, SCALES)       # (transformers needs compressed-tensors for it)
    _set_quantization(path, {"quant_method": "compressed-tensors", "format": "dense",
                             "config_groups": {}, "kv_cache_scheme": KV_SCHEME, "ignore": []})
    llm = LLM(path, num_blocks=64)
    assert llm.engine.config.model.kv_storage_dtype == "fp8_e4m3"
    _, tokens = _ours(llm)
    llm.engine.shutdown()
    assert tokens == ref_tokens


@pytest.mark.parametrize("scheme,kv,match", [
    ({**KV_SCHEME, "strategy": "attn_head"}, "auto", "strategy 'attn_head'.*per-head"),
    ({**KV_SCHEME, "type": "int"}, "auto", "type 'int'"),
    ({**KV_SCHEME, "symmetric": False}, "auto", "asymmetric"),
    (KV_SCHEME, "fp8_e5m2", "fp8_e5m2 is not served"),
])
def test_unserved_kv_schemes_are_refused_by_name(tiny_model_dir, tmp_path, scheme, kv, match):
    path = _with_scales(tiny_model_dir, tmp_path / "m", quantization={
        "quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": scheme})
    with pytest.raises(Exception, match=match):
        LLM(path, kv_cache_dtype=kv, num_blocks=64)


@pytest.mark.parametrize("scales,names,match", [
    ([(np.full(2, 0.01), 0.02), (0.01, 0.02)], ("k_scale", "v_scale"),
     r"model\.layers\.0\.self_attn\.k_scale.*per-head"),
    ([(0.01, 0.0), (0.01, 0.5)], ("k_scale", "k_zero_point"),
     r"model\.layers\.1\.self_attn\.k_zero_point.*nonzero zero points"),
])
def test_kv_scale_tensors_not_served_are_refused_naming_the_tensor(tiny_model_dir, tmp_path,
                                                                  scales, names, match):
    path = _with_scales(tiny_model_dir, tmp_path / "m", scales=scales, names=names)
    with pytest.raises(ModelLoadError, match=match):
        LLM(path, kv_cache_dtype="fp8", num_blocks=64)


def test_a_lone_kv_scale_serves_k_and_v(tiny_model_dir, tmp_path):
    """The deprecated kv_scale (one per layer) is k_scale and v_scale both, as vLLM takes it;
    a q_scale (FP8 attention, not on CPU) and zero KV zero points load and are not used."""
    path = _with_scales(tiny_model_dir, tmp_path / "m",
                        scales=[(s, 0.5, 0.0) for s, _ in SCALES],
                        names=("kv_scale", "q_scale", "v_zero_point"))
    _, ref_tokens = _hf(path, [(s, s) for s, _ in SCALES])
    llm = LLM(path, kv_cache_dtype="fp8", num_blocks=64)
    _, tokens = _ours(llm)
    llm.engine.shutdown()
    assert tokens == ref_tokens


def test_reload_folds_the_same_scales(scaled_llama):
    """reload_weights from the checkpoint folds its scales again (the tokens stay HF's), and
    a reload whose k_scale differs from the one loaded at start is refused naming the layer."""
    path, (_, ref_tokens), _ = scaled_llama
    llm = LLM(path, kv_cache_dtype="fp8", num_blocks=64)
    llm.collective_rpc("reload_weights")
    _, tokens = _ours(llm)
    changed = [(n, w * 2 if n == "model.layers.1.self_attn.k_scale" else w)
               for n, w in load_file(f"{path}/model.safetensors").items()]
    with pytest.raises(Exception, match="layer 1's KV scales"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": changed})
    again = _ours(llm)[1]
    llm.engine.shutdown()
    assert tokens == ref_tokens and again == ref_tokens


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_w8a8_checkpoint_with_a_kv_cache_scheme(tiny_model_dir, w8a8_model_dir, tmp_path,
                                                activations):
    """A W8A8 int8 checkpoint with a kv_cache_scheme and KV scales (auto: fp8), the scales
    folded into the int8 layers' weight scales (and o_proj's static input scale): its logits
    and greedy tokens agree with the torch emulation of the int8 layers with HF's scaled FP8
    attention, as tests/test_w8a8.py's do without scales."""
    from test_model_parity import _prefill_logits
    from test_w8a8 import (_static_tensor_checkpoint, assert_greedy_agrees,
                           assert_logits_agree, emulated_hf, hf_logits_and_greedy)
    src = w8a8_model_dir if activations == "dynamic" else _static_tensor_checkpoint(
        tiny_model_dir, w8a8_model_dir, tmp_path / "static")
    path = _with_scales(src, tmp_path / "m")
    with open(f"{path}/config.json") as f:
        quantization = json.load(f)["quantization_config"]
    _set_quantization(path, {**quantization, "kv_cache_scheme": KV_SCHEME})
    refs = {}          # the emulation with the scales, and with unit scales
    for name, scales in (("scaled", SCALES), ("unit", [(1.0, 1.0)] * len(SCALES))):
        model = emulated_hf(tiny_model_dir, path)
        transformers.AttentionInterface.register(f"kv_{name}", _scaled_fp8_attention(scales))
        model.set_attn_implementation(f"kv_{name}")
        refs[name] = model, hf_logits_and_greedy(model, [PROMPT], NEW_TOKENS)
    llm = LLM(path, num_blocks=64)
    assert llm.engine.config.model.kv_storage_dtype == "fp8_e4m3"
    ours = _prefill_logits(llm, [PROMPT])
    tokens = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    llm.engine.shutdown()
    model, (ref_logits, ref_tokens) = refs["scaled"]
    assert_logits_agree(ours, ref_logits)      # measured: within 4e-6
    assert_greedy_agrees(model, [PROMPT], [tokens], ref_tokens)
    assert np.abs(ours[0] - refs["unit"][1][0][0]).max() > 0.1     # measured: 0.6
