"""``python -m llm_serving.quantize``, as a user runs it: per-channel int8 weights, the
checkpoint's dtype kept for what it does not quantize (scales in the weight's dtype, as
llm-compressor writes them), shards of at most --max-shard-size with Hugging Face's index,
and an --out written whole or not at all (a failure or a refusal leaves nothing behind, an
existing checkpoint is replaced only with --overwrite). Tensors are read back with safetensors'
torch reader, independent of ours."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM
from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.tiny_model import make_tiny_model
from llm_serving.quantize import main, parse_size, quantize_model, quantize_per_channel
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


def test_a_bf16_model_keeps_bf16_and_its_sharded_checkpoint_is_served(bf16_model, tmp_path):
    """What is not quantized stays bf16 bit for bit and the scales are bf16 (as llm-compressor
    writes a bf16 model's); q is the round-to-nearest of w by the bf16 scale as stored. Written
    in shards of at most 20 KB (a larger tensor alone in its own), with the index
    save_pretrained writes; the engine serves it (fp32) as the emulation of its tensors."""
    out = Path(quantize_model(bf16_model, str(tmp_path / "w8a8"), max_shard_size="20KB"))
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

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    n = len(files)
    assert n > 3 and [f.name for f in files] == \
        [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == sorted(got)
    shards = {f.name: _shard(f) for f in files}
    assert index["metadata"]["total_size"] == _nbytes(t for d in shards.values()
                                                      for t in d.values())
    for name, held in shards.items():
        assert sorted(held) == sorted(k for k, v in index["weight_map"].items() if v == name)
        assert _nbytes(held.values()) <= 20_000 or len(held) == 1 or \
            (len(held) == 2 and any(k.endswith("_scale") for k in held))

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
    assert sorted(p.name for p in Path(out).glob("*.safetensors")) == ["model.safetensors"]


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


def test_a_failure_midway_leaves_no_partial_checkpoint(tiny_model_dir, tmp_path, capsys):
    """A tensor that cannot be read (the file cut short) after shards were written: one line
    naming it, exit 2, no --out and nothing beside it; an --out being replaced is kept as it
    was."""
    bad = tmp_path / "models" / "cut"
    shutil.copytree(tiny_model_dir, bad)
    weights = bad / "model.safetensors"
    with open(weights, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    os.truncate(weights, weights.stat().st_size - 1000)
    work = tmp_path / "work"
    work.mkdir()
    capsys.readouterr()
    assert main(["--model", str(bad), "--out", str(work / "w8a8"),
                 "--max-shard-size", "20KB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "file truncated" in err
    assert f"tensor {last!r}" in err
    assert _listing(work) == []
    old = work / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    assert main(["--model", str(bad), "--out", str(old), "--overwrite"]) == 2
    assert _listing(work) == ["old"] and _listing(old) == ["keep.txt"]


def test_a_full_disk_is_one_line_and_leaves_nothing(tiny_model_dir, tmp_path):
    """A write that fails (here files are limited to 100 KB, as a full disk refuses them):
    exit 1, one line saying which file could not be written, nothing left."""
    def limit_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    r = subprocess.run([sys.executable, "-m", "llm_serving.quantize", "--model", tiny_model_dir,
                        "--out", str(tmp_path / "w8a8")], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       preexec_fn=limit_files, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"error: cannot write {tmp_path / 'w8a8'}: shard 1: ")
    assert r.stderr.count("\n") == 1, r.stderr
    assert "File too large" in r.stderr and "Traceback" not in r.stderr
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("sig, code, says", [(signal.SIGINT, 130, "interrupted"),
                                            (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_or_sigterm_midway_leaves_nothing(tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                 sig, code, says):
    """The signal arrives once two shards are written: one line, exit 130 (Ctrl-C) or 143
    (SIGTERM), no --out and nothing beside it; SIGTERM's handler is given back."""
    import llm_serving.quantize as tool
    real = tool.iter_weights

    def signalled(*a, **kw):
        for i, item in enumerate(real(*a, **kw)):
            if i == 12:
                assert len(list(tmp_path.glob(".w8a8.*.partial/part-*"))) >= 2
                os.kill(os.getpid(), sig)
            yield item
    monkeypatch.setattr(tool, "iter_weights", signalled)
    before = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    assert main(["--model", tiny_model_dir, "--out", str(tmp_path / "w8a8"),
                 "--max-shard-size", "10KB"]) == code
    assert capsys.readouterr().err == f"{says}: nothing written to {tmp_path / 'w8a8'}\n"
    assert _listing(tmp_path) == [] and signal.getsignal(signal.SIGTERM) == before


def test_an_existing_out_is_replaced_only_with_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "w8a8"
    out.mkdir()
    assert main(["--model", tiny_model_dir, "--out", str(out)]) == 0     # empty: taken
    (out / "stale.txt").write_text("old")
    capsys.readouterr()
    assert main(["--model", tiny_model_dir, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {out} is not empty (pass --overwrite to replace it)\n"
    assert main(["--model", tiny_model_dir, "--out", str(out), "--overwrite"]) == 0
    assert "stale.txt" not in _listing(out) and "model.safetensors" in _listing(out)
    assert _listing(tmp_path) == ["w8a8"]
    for argv, says in ((["--out", str(out / "config.json"), "--overwrite"], "is a file"),
                       (["--out", str(Path(tiny_model_dir).parent), "--overwrite"],
                        "holds --model"),
                       (["--out", tiny_model_dir, "--overwrite"], "another directory")):
        assert main(["--model", tiny_model_dir, *argv]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", tiny_model_dir, "--out", str(tmp_path / "x"), "--max-shard-size", "5XB"])
    assert e.value.code == 2
    assert "argument --max-shard-size: '5XB' is not a size" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="max_shard_size: 0 is not a size"):
        quantize_model(tiny_model_dir, str(tmp_path / "x"), max_shard_size=0)
    assert _listing(tmp_path) == ["w8a8"]


def test_shard_sizes_read_as_hugging_face_reads_them():
    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "10KB", "1.5MB", "123", 7)] == \
        [5 * 10**9, 5 * 10**8, 2 * 2**30, 10**4, 1_500_000, 123, 7]
    for bad in ("", "GB", "-1GB", "5 XB", 0):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
