"""``python -m llm_serving.quantize --model DIR --out DIR``: a W8A8 int8 checkpoint of a model.

Round-to-nearest, offline, no calibration data: each linear layer's weight becomes int8 with one
scale per output channel (max |w| of the row / 127, symmetric; the scale in the weight's dtype,
as llm-compressor writes it), and its activations are quantized at run time per token
(dynamic); the token embedding, the LM head and the norms keep their weights in the
checkpoint's dtype. The output is a compressed-tensors checkpoint, as
llm-compressor's W8A8 scheme writes it (format int-quantized, ``weight_scale`` beside each
int8 ``weight``), that this engine and vLLM (``--quantization compressed-tensors``, or nothing:
it is read from config.json) both load; the other files of the model directory (tokenizer,
generation config) are copied.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import ModelConfig, iter_weights
from llm_serving.model_executor.quantization import INT8_ARCHITECTURES, QUANT_METHOD

# the linear layers' weights of the decoders (INT8_ARCHITECTURES), by the checkpoint's names: a
# packed q/k/v (InternLM2's attention.wqkv, Baichuan's W_pack) is one layer, as llm-compressor
# quantizes it
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.([qkvo]_proj|W_pack)"
                     r"|mlp\.(gate|up|down)_proj|attention\.(wqkv|wo)|feed_forward\.w[123])"
                     r"\.weight$")
# the LM head, kept in float, by the checkpoint's name
_LM_HEAD = {"InternLM2ForCausalLM": "output"}
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.ckpt", "*.pt", "*.pth", "*.index.json")
# the dtypes a scale takes from its weight; any other weight gets float32 scales
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


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


def quantize_model(model: str, out: str) -> str:
    """Write the W8A8 int8 checkpoint of model directory ``model`` to ``out``; returns it."""
    from safetensors.numpy import save_file
    src, dst = Path(model).expanduser(), Path(out).expanduser()
    cfg = ModelConfig.from_pretrained(str(src))
    if cfg.quantization is not None:
        raise ModelLoadError(f"{src} is quantized already (its config.json has a "
                             "quantization_config)")
    if cfg.architecture not in INT8_ARCHITECTURES:
        raise ModelLoadError(f"{cfg.architecture} is not quantized here; W8A8 int8 "
                             f"checkpoints are for {', '.join(INT8_ARCHITECTURES)}")
    if dst.resolve() == src.resolve():
        raise ModelLoadError("--out must be another directory than --model")
    tensors = {}
    for name, w in iter_weights(str(src), keep_bf16=True):
        if _LINEAR.match(name):
            scale_dtype = w.dtype if w.dtype in _SCALE_DTYPES else np.float32
            tensors[name], tensors[name + "_scale"] = quantize_per_channel(w, scale_dtype)
        else:
            tensors[name] = np.ascontiguousarray(w)
    dst.mkdir(parents=True, exist_ok=True)
    for stale in [p for pattern in _WEIGHT_FILES for p in dst.glob(pattern)]:
        stale.unlink()
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES):
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = w8a8_quantization_config(
        _LM_HEAD.get(cfg.architecture, "lm_head"))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(dst)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_serving.quantize",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", required=True, help="the model directory (HF layout)")
    parser.add_argument("--out", required=True, help="where to write the W8A8 checkpoint")
    args = parser.parse_args(argv)
    try:
        out = quantize_model(args.model, args.out)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the W8A8 int8 checkpoint of {args.model} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
