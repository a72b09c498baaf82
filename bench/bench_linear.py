#!/usr/bin/env python
"""Linear layers at decode sizes: the C++ kernel (lls_linear_f32) against MindSpore's
MatMul(transpose_b=True), on the 97M model's shapes, to find the crossover M.

Each timing runs the 12 layers' four projections (qkv, o, gate_up, down; 340 MB of distinct
weights, more than fits in cache) and reports ms per pass, the way a decode step reads them.

    python bench/bench_linear.py [--ms 1,2,4,8,16,32,64] [--reps 5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16,24,32,48,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()

    import mindspore as ms
    from mindspore import Tensor, ops
    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    from llm_serving.model_executor.layers.linear import cpu_linear

    h, f = 768, 2048
    shapes = [(3 * h, h), (h, h), (2 * f, h), (h, f)]
    rng = np.random.default_rng(0)
    weights = [[Tensor(rng.standard_normal((n, k), np.float32) * 0.02) for n, k in shapes]
               for _ in range(args.layers)]
    mm = ops.MatMul(transpose_b=True)
    print("| M | MindSpore MatMul ms | C++ kernel ms | speedup |")
    print("|---|---|---|---|")
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: Tensor(rng.standard_normal((m, k), np.float32)) for k in (h, f)}
        fns = {"cpp": lambda x, w: cpu_linear(x, w), "ms": lambda x, w: mm(x, w)}
        for fn in fns.values():             # warm-up
            for layer in weights:
                for w in layer:
                    fn(xs[w.shape[1]], w)
        ts = {name: [] for name in fns}
        for _ in range(args.reps):          # interleaved, so both see the same machine load
            for name, fn in fns.items():
                t = time.perf_counter()
                for layer in weights:
                    for w in layer:
                        fn(xs[w.shape[1]], w).data_ptr()
                ts[name].append(time.perf_counter() - t)
        res = {name: np.median(v) * 1e3 for name, v in ts.items()}
        print(f"| {m} | {res['ms']:.2f} | {res['cpp']:.2f} | {res['ms'] / res['cpp']:.2f}x |")


if __name__ == "__main__":
    main()
