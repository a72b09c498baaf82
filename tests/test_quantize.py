"""``python -m llm_serving.quantize``, as a user runs it: per-channel int8 weights, the
checkpoint's dtype kept for what it does not quantize (scales in the weight's dtype, as
llm-compressor writes them). Tensors are read back with safetensors'
torch reader, independent of ours."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM
from llm_serving.model_executor.tiny_model import make_tiny_model
from llm_serving.quantize import main, quantize_model, quantize_per_channel
from test_w8a8 import (GREEDY, _prefill_logits, _prompts, assert_greedy_agrees,
                       assert_logits_agree, checkpoint_tensors, emulated_hf, reference)

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
LINEAR = "model.layers.0.self_attn.q_proj.weight"


def _shard(f: Path) -> dict:
    """The tensors of one safetensors file, in their dtypes (torch)."""
    from safetensors.torch import load_file
    return load_file(str(f))


def _st_dtypes(d: Path) -> dict:
    """{tensor: torch dtype name} over the directory's safetensors files."""
    return {k: str(t.dtype) for f in d.glob("*.safetensors") for k, t in _shard(f).items()}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _listing(d: Path) -> list:
    return sorted(p.name for p in d.iterdir())


def test_quantize_writes_per_channel_int8_and_refuses_a_quantized_model(
        tiny_model_dir, w8a8_model_dir, tmp_path):
    src, out = checkpoint_tensors(tiny_model_dir), checkpoint_tensors(w8a8_model_dir)
    w = src[LINEAR]
    q, s = out[LINEAR], out[LINEAR + "_scale"]
    assert q.dtype == np.int8 and s.shape == (len(w), 1) and s.dtype == np.float32
    assert np.abs(q).max(axis=1).min() == 127          # each row's largest weight is +-127
    np.testing.assert_allclose(q * s, w, atol=float(s.max()) / 2 + 1e-9, rtol=0)
    assert _st_dtypes(Path(w8a8_model_dir))["lm_head.weight"] == "torch.float32"
    np.testing.assert_array_equal(out["model.embed_tokens.weight"],
                                  src["model.embed_tokens.weight"])
    assert quantize_per_channel(np.zeros((2, 3), np.float32))[0].tolist() == [[0] * 3] * 2
    assert main(["--model", w8a8_model_dir, "--out", str(tmp_path / "again")]) == 2
    assert not (tmp_path / "again").exists()


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """The tiny Llama in bf16, in two shards."""
    return make_tiny_model(str(tmp_path_factory.mktemp("bf16") / "tiny-bf16"),
                           dtype="bfloat16", num_shards=2)


def test_a_bf16_model_keeps_bf16_and_is_served(bf16_model, tmp_path):
    """What is not quantized stays bf16 bit for bit and the scales are bf16 (as llm-compressor
    writes a bf16 model's); q is the round-to-nearest of w by the bf16 scale as stored; the
    engine serves it (fp32) as the emulation of its tensors."""
    out = Path(quantize_model(bf16_model, str(tmp_path / "w8a8")))
    dtypes, src, got = _st_dtypes(out), checkpoint_tensors(bf16_model), checkpoint_tensors(out)
    assert {dtypes[k] for k in dtypes if k.endswith(".weight") and k in got and
            got[k].dtype != np.int8} == {"torch.bfloat16"}
    assert {dtypes[k] for k in dtypes if k.endswith("_scale")} == {"torch.bfloat16"}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        np.testing.assert_array_equal(got[name], src[name])
    w, q, s = src[LINEAR], got[LINEAR], got[LINEAR + "_scale"]
    assert np.abs(q).max(axis=1).min() == 127
    np.testing.assert_array_equal(q, np.clip(np.rint(w / s), -128, 127))
    assert np.all(np.abs(q * s - w) <= s / 2 * (1 + 1e-6))

    llm = LLM(str(out), dtype="float32", block_size=16, num_blocks=64)
    prompts = _prompts(1024)[:3]
    ref_model = emulated_hf(bf16_model, str(out))
    ref_logits, ref_tokens = reference(ref_model, prompts)
    assert_logits_agree(_prefill_logits(llm, prompts), ref_logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_agrees(ref_model, prompts, [o.outputs[0].token_ids for o in outs], ref_tokens)


def test_an_fp16_model_keeps_fp16(tmp_path):
    src = make_tiny_model(str(tmp_path / "fp16"), num_layers=1, dtype="float16")
    out = quantize_model(src, str(tmp_path / "w8a8"))
    dtypes = _st_dtypes(Path(out))
    assert dtypes[LINEAR] == "torch.int8" and dtypes[LINEAR + "_scale"] == "torch.float16"
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == "torch.float16"


def test_a_pytorch_bin_bf16_model_keeps_bf16(bf16_model, tmp_path):
    """A bf16 ``pytorch_model.bin`` (Baichuan2's published format) is read as bf16 too."""
    src = tmp_path / "bin"
    shutil.copytree(bf16_model, src, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {k: t for f in Path(bf16_model).glob("*.safetensors") for k, t in _shard(f).items()}
    torch.save(tensors, src / "pytorch_model.bin")
    out = Path(quantize_model(str(src), str(tmp_path / "w8a8")))
    got = _shard(out / "model.safetensors")
    assert got[LINEAR].dtype == torch.int8 and got[LINEAR + "_scale"].dtype == torch.bfloat16
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensors[name])
