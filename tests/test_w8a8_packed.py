"""W8A8 int8 checkpoints of the architectures whose q, k and v are one packed layer in the
checkpoint: InternLM2 (attention.wqkv, per KV group) and Baichuan2 (W_pack; 7B rotary, 13B
ALiBi), written by python -m llm_serving.quantize (the packed layer quantized as one, as
llm-compressor does) or edited from it, against test_w8a8.py's torch emulation of vLLM's W8A8
math. The reference cuts the packed int8 rows and their scale rows here, independently of our
loader, into transformers' Llama (as test_internlm2.py and test_baichuan2.py build theirs), or
runs the packed W_pack whole in test_baichuan2_alibi.py's Baichuan2-13B forward pass."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM
from llm_serving.errors import ModelLoadError
from llm_serving.quantize import quantize_model
from test_baichuan2 import as_llama_checkpoint
from test_baichuan2_alibi import Baichuan13B
from test_internlm2 import LLAMA_NAMES, as_llama
from test_model_parity import _prefill_logits, _prompts
from test_w8a8 import (GREEDY, VOCAB, W8A8Linear, assert_greedy_agrees, assert_logits_agree,
                       assert_two_ranks_agree, emulated_hf, float_again, per_tensor_static,
                       reference)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

QKV = ("q_proj", "k_proj", "v_proj")


def _tiny(preset: str, root: Path) -> str:
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(root / preset), **PRESETS[preset])


def _llama_named(w8a8_dir: str, out: Path, cut, rename) -> str:
    """The quantized layers' tensors under Llama's names (what ``emulated_hf`` reads): a
    packed layer's rows (int8 weight, per-channel scales) cut by ``cut`` into q, k and v, its
    per-tensor scales each part's."""
    llama = {}
    for name, t in load_file(str(Path(w8a8_dir) / "model.safetensors")).items():
        if not name.startswith("model.layers."):
            continue
        module, leaf = name.rsplit(".", 1)
        prefix, part = module.split(".", 3)[:3], module.split(".", 3)[3]
        prefix = ".".join(prefix) + "."
        if part in ("attention.wqkv", "self_attn.W_pack"):
            parts = [t] * 3 if t.size == 1 else cut(t)
            for proj, rows in zip(QKV, parts):
                llama[f"{prefix}self_attn.{proj}.{leaf}"] = np.ascontiguousarray(rows)
        else:
            llama[f"{prefix}{rename.get(part, part)}.{leaf}"] = t
    out.mkdir(parents=True)
    save_file(llama, str(out / "model.safetensors"))
    return str(out)


def _internlm2_cut(cfg: dict):
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    groups, head_dim = heads // kv_heads, cfg["hidden_size"] // heads

    def cut(t):
        per_kv = t.reshape(kv_heads, groups + 2, head_dim, -1)
        return [per_kv[:, :groups].reshape(-1, t.shape[1]),
                per_kv[:, groups].reshape(-1, t.shape[1]),
                per_kv[:, groups + 1].reshape(-1, t.shape[1])]
    return cut


def _mlp_only(float_dir: str, w8a8_dir: str, out: Path) -> str:
    """InternLM2's attention float again, as a checkpoint whose group targets the MLP by a
    pattern on the checkpoint's own names and ignores wqkv and wo by name."""
    return float_again(float_dir, w8a8_dir, out, ".attention.",
                       r"re:model\.layers\.\d+\.feed_forward\..*",
                       ["output"] + [f"model.layers.{i}.attention.{p}"
                                     for i in range(2) for p in ("wqkv", "wo")])


@pytest.fixture(scope="module")
def variants(internlm2_model_dir, tmp_path_factory):
    """{name: (checkpoint, prompts, reference logits, reference greedy tokens)}."""
    root = tmp_path_factory.mktemp("w8a8-packed")
    i2 = quantize_model(internlm2_model_dir, str(root / "i2"))
    i2_cut = _internlm2_cut(json.loads((Path(i2) / "config.json").read_text()))
    i2_llama = as_llama(Path(internlm2_model_dir), root / "i2-float-llama")
    b2 = _tiny("tiny-baichuan2", root)
    b2_llama = as_llama_checkpoint(b2, root / "b2-float-llama")
    prompts = _prompts(VOCAB)[:6]
    out = {}
    for name, float_llama, d, cut, rename in (
            ("internlm2-dynamic-channel", i2_llama, i2, i2_cut, LLAMA_NAMES),
            ("internlm2-static-tensor", i2_llama,
             per_tensor_static(i2, root / "i2-static", lambda _: 0.03), i2_cut, LLAMA_NAMES),
            ("internlm2-mlp-only", i2_llama,
             _mlp_only(internlm2_model_dir, i2, root / "i2-mlp"), i2_cut, LLAMA_NAMES),
            ("baichuan2-dynamic-channel", b2_llama,
             quantize_model(b2, str(root / "b2")), lambda t: np.split(t, 3), {})):
        emulated = _llama_named(d, root / (name + "-ref"), cut, rename)
        out[name + ":model"] = model = emulated_hf(float_llama, emulated)
        out[name] = (d, prompts, *reference(model, prompts))
        out[name + ":emulated"] = (float_llama, emulated)
    return out


@pytest.mark.parametrize("name", ["internlm2-dynamic-channel", "internlm2-static-tensor",
                                  "internlm2-mlp-only", "baichuan2-dynamic-channel"])
def test_logits_and_greedy_tokens_match_the_emulated_w8a8_model(variants, name):
    d, prompts, ref_logits, ref_tokens = variants[name]
    llm = LLM(d, block_size=16, num_blocks=256)
    int8 = [n for n, c in llm.engine.runner.model.cells_and_names() if getattr(c, "int8", 0)]
    assert len(int8) == (2 if name.endswith("mlp-only") else 4) * 2
    assert not name.endswith("mlp-only") or all(".mlp." in n for n in int8)
    assert_logits_agree(_prefill_logits(llm, prompts), ref_logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_agrees(variants[name + ":model"], prompts,
                         [o.outputs[0].token_ids for o in outs], ref_tokens)


@pytest.mark.parametrize("name", ["internlm2-dynamic-channel", "baichuan2-dynamic-channel"])
def test_two_tensor_parallel_ranks_match_the_emulation_of_their_slices(variants, name):
    """Each rank cuts its own heads' q, k and v rows (and scale rows) out of every packed
    layer (InternLM2's: its own KV group's)."""
    d, prompts, _, _ = variants[name]
    assert_two_ranks_agree(d, emulated_hf(*variants[name + ":emulated"], splits=2), prompts[:4])


class _Int8Matmul:
    """``x @ w.T`` in Baichuan13B's forward pass as W8A8 (``W8A8Linear``) on the checkpoint's
    int8 weight and scales: the whole W_pack as one layer."""

    def __init__(self, q, scale):
        self.T, self.linear = self, W8A8Linear(q, scale)

    def __rmatmul__(self, x):
        return self.linear(x)


def test_baichuan2_13b_alibi_matches_the_emulated_forward_pass(tmp_path):
    b13 = _tiny("tiny-baichuan2-alibi", tmp_path)
    d = quantize_model(b13, str(tmp_path / "w8a8"))
    ref = Baichuan13B(b13)
    tensors = load_file(str(Path(d) / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        ref.w[name[:-len("_scale")]] = _Int8Matmul(tensors[name[:-len("_scale")]], tensors[name])
    prompts = _prompts(VOCAB)[:6]
    ref_logits = [ref.logits(p) for p in prompts]
    llm = LLM(d, block_size=16, num_blocks=256)
    assert_logits_agree(_prefill_logits(llm, prompts), ref_logits)
    float_logits = Baichuan13B(b13).logits(prompts[-1])
    assert np.abs(float_logits - ref_logits[-1]).max(1).min() > 1e-2    # not the float model


def test_quantize_names_the_packed_layers_and_keeps_the_head_float(variants, tmp_path):
    """The packed layer is one int8 layer with a scale per row; the LM head, by the
    checkpoint's name, is ignored and float; a quantized LM head (Baichuan's lm_head, InternLM2's
    output) is refused by name."""
    d = variants["internlm2-dynamic-channel"][0]
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == ["output"]
    t = load_file(str(Path(d) / "model.safetensors"))
    wqkv = t["model.layers.0.attention.wqkv.weight"]
    assert wqkv.dtype == np.int8 and t["model.layers.0.attention.wqkv.weight_scale"].shape == (
        len(wqkv), 1)
    assert t["output.weight"].dtype == np.float32 and "output.weight_scale" not in t
    b2 = Path(variants["baichuan2-dynamic-channel"][0])
    bad = tmp_path / "b2-head"
    shutil.copytree(b2, bad)
    t = load_file(str(bad / "model.safetensors"))
    assert t["model.layers.0.self_attn.W_pack.weight"].dtype == np.int8
    t["lm_head.weight_scale"] = np.ones((len(t["lm_head.weight"]), 1), np.float32)
    t["lm_head.weight"] = np.zeros(t["lm_head.weight"].shape, np.int8)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="'lm_head.weight.*quantized LM head"):
        LLM(str(bad), num_blocks=16)
    bad = tmp_path / "i2-head"
    shutil.copytree(d, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["output.weight"] = np.zeros(t["output.weight"].shape, np.int8)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="'output.weight'.*quantized LM head"):
        LLM(str(bad), num_blocks=16)
