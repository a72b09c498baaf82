"""``python -m llm_serving.quantize --model DIR --out DIR``: a W8A8 int8 checkpoint of a model.

Round-to-nearest, offline, no calibration data: each linear layer's weight becomes int8 with one
scale per output channel (max |w| of the row / 127, symmetric; the scale in the weight's dtype,
as llm-compressor writes it), and its activations are quantized at run time per token
(dynamic); the token embedding, the LM head and the norms keep their weights in the
checkpoint's dtype. The output is a compressed-tensors checkpoint, as llm-compressor's W8A8
scheme writes it (format int-quantized, ``weight_scale`` beside each int8 ``weight``), that
this engine and vLLM (``--quantization compressed-tensors``, or nothing: it is read from
config.json) both load; the other files of the model directory (tokenizer, generation config)
are copied. It is written tensor by tensor into safetensors shards of at most
--max-shard-size (with model.safetensors.index.json when there are several, as Hugging Face's
save_pretrained), so memory holds about one shard, in a directory beside --out that takes its
name at the end: a failure or an interrupt leaves no partial checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import ml_dtypes
import numpy as np

from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import (ModelConfig, find_weight_files, iter_weights,
                                               read_safetensors_header)
from llm_serving.model_executor.quantization import INT8_ARCHITECTURES, QUANT_METHOD

# the linear layers' weights of the decoders (INT8_ARCHITECTURES), by the checkpoint's names: a
# packed q/k/v (InternLM2's attention.wqkv, Baichuan's W_pack, GPTBigCode's c_attn) is one
# layer, as llm-compressor quantizes it
_LINEAR = re.compile(r"^(model\.layers\.\d+\.(self_attn\.([qkvo]_proj|W_pack)"
                     r"|mlp\.(gate|up|down)_proj|attention\.(wqkv|wo)|feed_forward\.w[123])"
                     r"|transformer\.h\.\d+\.(attn\.c_(attn|proj)|mlp\.c_(fc|proj)))\.weight$")
# the LM head, kept in float, by the checkpoint's name
_LM_HEAD = {"InternLM2ForCausalLM": "output"}
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.ckpt", "*.pt", "*.pth", "*.index.json")
# the dtypes a scale takes from its weight; any other weight gets float32 scales
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
DEFAULT_MAX_SHARD_SIZE = "5GB"         # Hugging Face's save_pretrained default
_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*(|B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``size``: an int, or a string as Hugging Face's max_shard_size takes it ("5GB"
    is 5 * 10**9 bytes, "2GiB" 2 * 2**30; a plain number is bytes). A ValueError says what is
    wrong."""
    m = _SIZE.fullmatch(size.strip()) if isinstance(size, str) else None
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()]) if m else size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{size!r} is not a size (a positive number of bytes, or e.g. 5GB, "
                         "500MB, 2GiB)")
    return n


def quantize_per_channel(w: np.ndarray, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 round-to-nearest (half to even) of a [out, in] weight: (q int8 [out, in],
    scale [out, 1] in ``scale_dtype``) with w ~ q * scale, q computed in float32 against the
    scale as stored; a zero row gets that dtype's eps as its scale (as llm-compressor's)."""
    w = np.asarray(w, np.float32)
    peak = np.maximum(w.max(axis=1, keepdims=True), -w.min(axis=1, keepdims=True))
    scale = (peak / np.float32(127)).astype(scale_dtype)
    scale[scale == 0] = ml_dtypes.finfo(scale_dtype).eps
    q = w / scale.astype(np.float32)
    np.clip(np.rint(q, out=q), -128, 127, out=q)
    return q.astype(np.int8), scale


def w8a8_quantization_config(lm_head: str = "lm_head") -> dict:
    """config.json's quantization_config of the checkpoints written here (llm-compressor's
    W8A8 int8: channel-wise weights, dynamic per-token activations, the LM head ignored)."""
    def args(strategy: str, dynamic: bool, observer) -> dict:
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy,
                "dynamic": dynamic, "group_size": None, "observer": observer}
    return {"quant_method": QUANT_METHOD, "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": args("channel", False, "minmax"),
                "input_activations": args("token", True, None)}},
            "ignore": [lm_head]}


class ShardWriter:
    """Safetensors shards of at most ``max_bytes`` each, written as tensors are added (a group
    larger than that gets a shard of its own, as Hugging Face's); ``finish`` names them as
    save_pretrained does and writes model.safetensors.index.json when there are several."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: Dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: List[List[str]] = []
        self.total_bytes = 0

    def add(self, tensors: Dict[str, np.ndarray]) -> None:
        size = sum(t.nbytes for t in tensors.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending.update((k, np.ascontiguousarray(t)) for k, t in tensors.items())
        self.pending_bytes += size
        self.total_bytes += size

    def _part(self, i: int) -> Path:
        return self.out / f"part-{i + 1:05d}.safetensors"

    def _flush(self) -> None:
        from safetensors import SafetensorError
        from safetensors.numpy import save_file
        path = self._part(len(self.shards))
        try:
            save_file(self.pending, str(path), metadata={"format": "pt"})
        except SafetensorError as e:             # (an OSError, e.g. the disk full, inside)
            raise OSError(f"shard {len(self.shards) + 1}: {e}") from e
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else \
            [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            self._part(i).rename(self.out / name)
        if n > 1:
            weight_map = {t: name for name, shard in zip(names, self.shards) for t in shard}
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2) + "\n")


def _check_out(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise ModelLoadError("--out must be another directory than --model")
    if dst.resolve() in src.resolve().parents:
        raise ModelLoadError(f"--out {dst} holds --model {src}: it would be replaced")
    if dst.exists() and not dst.is_dir():
        raise ModelLoadError(f"--out {dst} is a file, not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ModelLoadError(f"--out {dst} is not empty (pass --overwrite to replace it)")


def _tensor_count(src: Path) -> Optional[int]:
    """How many tensors the checkpoint has (for the progress bar), when safetensors says."""
    files = find_weight_files(str(src))
    if any(f.suffix != ".safetensors" for f in files):
        return None
    return sum(len(read_safetensors_header(f)[0]) for f in files)


def _write(src: Path, dst: Path, architecture: str, max_bytes: int, progress: bool) -> None:
    """The checkpoint's files into the (new, empty) directory ``dst``."""
    from tqdm import tqdm
    writer = ShardWriter(dst, max_bytes)
    # the bar on a terminal only (tqdm's disable=None), closed before an error is printed
    with tqdm(desc="quantizing", total=_tensor_count(src) if progress else None,
              unit="tensor", disable=None if progress else True) as bar:
        for name, w in iter_weights(str(src), keep_bf16=True):
            if _LINEAR.match(name):
                scale_dtype = w.dtype if w.dtype in _SCALE_DTYPES else np.float32
                q, scale = quantize_per_channel(w, scale_dtype)
                writer.add({name: q, name + "_scale": scale})
            else:
                writer.add({name: w})
            bar.update()
        writer.finish()
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = w8a8_quantization_config(_LM_HEAD.get(architecture,
                                                                           "lm_head"))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _replace(new: Path, dst: Path) -> None:
    """Rename directory ``new`` to ``dst``, which is replaced (and removed) if it exists."""
    old = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.old") if dst.exists() else None
    if old is not None:
        dst.rename(old)
    try:
        new.rename(dst)
    except BaseException:
        if old is not None:
            old.rename(dst)
        raise
    if old is not None:
        shutil.rmtree(old)


def quantize_model(model: str, out: str, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                   overwrite: bool = False, progress: bool = False) -> str:
    """Write the W8A8 int8 checkpoint of model directory ``model`` to ``out``; returns it.
    ``out`` must not exist or be empty, unless ``overwrite``; it is written whole or not at
    all. Bad input is a ModelLoadError, a failed write an OSError."""
    src, dst = Path(os.path.abspath(Path(model).expanduser())), \
        Path(os.path.abspath(Path(out).expanduser()))
    cfg = ModelConfig.from_pretrained(str(src))
    if cfg.quantization is not None:
        raise ModelLoadError(f"{src} is quantized already (its config.json has a "
                             "quantization_config)")
    if cfg.architecture not in INT8_ARCHITECTURES:
        raise ModelLoadError(f"{cfg.architecture} is not quantized here; W8A8 int8 "
                             f"checkpoints are for {', '.join(INT8_ARCHITECTURES)}")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ModelLoadError(f"max_shard_size: {e}") from None
    _check_out(src, dst, overwrite)
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            _write(src, tmp, cfg.architecture, max_bytes, progress)
            _replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:
        raise OSError(f"cannot write {dst}: {e}") from e
    return str(dst)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Terminated(BaseException):
    """SIGTERM, raised where the tool is, so that quantize_model removes what it wrote."""


def _terminated(signum, frame):
    raise _Terminated


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_serving.quantize",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", required=True, help="the model directory (HF layout)")
    parser.add_argument("--out", required=True, help="where to write the W8A8 checkpoint "
                        "(a new or empty directory)")
    parser.add_argument("--max-shard-size", type=_size_arg, default=DEFAULT_MAX_SHARD_SIZE,
                        help="the largest safetensors file written, in bytes or e.g. 500MB, "
                        "2GiB (default: %(default)s, as Hugging Face's save_pretrained)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it is not empty (once the new one is written)")
    args = parser.parse_args(argv)
    sigterm = signal.signal(signal.SIGTERM, _terminated)
    try:
        out = quantize_model(args.model, args.out, args.max_shard_size, args.overwrite,
                             progress=True)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated) as e:
        print(f"{'terminated' if isinstance(e, _Terminated) else 'interrupted'}: nothing "
              f"written to {args.out}", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    print(f"wrote the W8A8 int8 checkpoint of {args.model} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
