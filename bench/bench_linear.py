#!/usr/bin/env python
"""Linear layers, every GEMM candidate of ``layers/gemm.py`` (OpenBLAS sgemm from our pool, our
small-M kernel) and MindSpore's MatMul (forceable, not probed) on the 97 M model's shapes, and
what the start-up probe picks on this CPU. Isolated GEMMs only: whole steps (bench_model.py
with LLM_SERVING_GEMM=...) decide, since libraries' threads interfere between calls.

Each timing runs the 12 layers' four projections (qkv, o, gate_up, down; 340 MB of distinct
weights, more than fits in cache) and reports ms per pass, the way a step reads them;
candidates are interleaved, so all see the same machine load.

    python bench/bench_linear.py [--ms 1,4,16,32,64,128,256] [--reps 5]

``--before`` instead times our kernel against its previous many-rows path (no packing, no K
blocking; built in with -DLLS_LINEAR_REFERENCE), interleaved, and checks the outputs are
bit-identical: median, min and max ms per pass over the reps.
"""
from __future__ import annotations

import argparse
import datetime
import time

import numpy as np
from llm_serving.cpu_info import cpu_description  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--before", action="store_true",
                    help="our kernel now vs its previous many-rows path, bit-identity checked")
    args = ap.parse_args()
    if args.before:
        return before_after(args)

    import mindspore as ms
    from mindspore import Tensor
    from llm_serving.model_executor.device import init_device
    init_device("cpu")
    ms.runtime.launch_blocking()
    from llm_serving.model_executor.layers import gemm
    from llm_serving.model_executor.layers.linear import Linear

    h, f = 768, 2048
    shapes = [(h, [3 * h]), (h, [h]), (h, [2 * f]), (f, [h])]
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(args.layers):
        for k, outs in shapes:
            layer = Linear(k, outs)
            layer.weight.set_data(Tensor(rng.standard_normal((sum(outs), k), np.float32) * 0.02))
            layers.append(layer)
    cands = gemm.available() + ("kernel_packed", "matmul")
    plan = gemm.GemmPlan(None)          # a fresh probe, not the cache
    print(f"# GEMM candidates, {datetime.date.today()}, {cpu_description()}")
    print(f"# {args.layers} layers x (qkv, o, gate_up, down), ms per pass; probe: what the "
          f"start-up probe picks per shape")
    print("| M | " + " | ".join(f"{c} ms" for c in cands) + " | fastest | probe picks "
          "(qkv, o, gate_up, down) | probe ms |")
    print("|---|" + "---|" * (len(cands) + 3))
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: Tensor(rng.standard_normal((m, k), np.float32)) for k in (h, f)}
        for c in cands:                      # warm-up
            for layer in layers:
                layer.gemm(c, xs[layer.input_size])
        ts = {c: [] for c in cands}
        for _ in range(args.reps):
            for c in cands:
                t = time.perf_counter()
                for layer in layers:
                    y = layer.gemm(c, xs[layer.input_size])
                y.asnumpy()
                ts[c].append(time.perf_counter() - t)
        res = {c: float(np.median(v)) * 1e3 for c, v in ts.items()}
        t = time.perf_counter()
        picks = [plan.choose(layers[i], m) for i in range(4)]
        probe_ms = (time.perf_counter() - t) * 1e3
        print(f"| {m} | " + " | ".join(f"{res[c]:.1f}" for c in cands)
              + f" | {min(res, key=res.get)} | {', '.join(picks)} | {probe_ms:.0f} |", flush=True)


def before_after(args) -> None:
    import ctypes
    from llm_serving.model_executor.device import init_device
    from llm_serving.model_executor.layers.custom_op import load_layer_ops
    init_device("cpu")
    lib = load_layer_ops(("-DLLS_LINEAR_REFERENCE",))
    ref = lib.lls_linear_reference_f32
    ref.restype = ctypes.c_int
    ref.argtypes = lib.lls_linear_f32.argtypes
    fns = {"before": ref, "now": lib.lls_linear_f32}
    h, f = 768, 2048
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((n, k), np.float32) * 0.02
          for _ in range(args.layers) for n, k in ((3 * h, h), (h, h), (2 * f, h), (h, f))]
    print(f"# our kernel, previous many-rows path vs now, {datetime.date.today()}, "
          f"{cpu_description()}")
    print(f"# {args.layers} layers x (qkv, o, gate_up, down), ms per pass, {args.reps} reps "
          f"interleaved: median [min-max]; load average at start: "
          f"{open('/proc/loadavg').read().split()[0]}")
    print("# CPU ms: CPU time of this process's threads (both pool threads, their spinning "
          "included), less sensitive than wall time to other processes' load")
    print("| M | before ms | now ms | now / before | before CPU ms | now CPU ms | CPU now / "
          "before | bit-identical |")
    print("|---|---|---|---|---|---|---|---|")
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: rng.standard_normal((m, k), np.float32) for k in (h, f)}
        outs = {name: [np.empty((m, w.shape[0]), np.float32) for w in ws] for name in fns}
        calls = {}
        for name in fns:
            calls[name] = []
            for w, y in zip(ws, outs[name]):
                n, k = w.shape
                calls[name].append((xs[k].ctypes.data, k, w.ctypes.data, None, m, n, k, 1,
                                    (ctypes.c_int64 * 2)(0, n),
                                    (ctypes.c_void_p * 1)(y.ctypes.data), (ctypes.c_int64 * 1)(n)))
        ts = {name: [] for name in fns}
        cpu = {name: [] for name in fns}
        for rep in range(args.reps + 1):
            for name, fn in fns.items():
                t, c0 = time.perf_counter(), time.process_time()
                for c in calls[name]:
                    fn(*c)
                if rep:
                    ts[name].append((time.perf_counter() - t) * 1e3)
                    cpu[name].append((time.process_time() - c0) * 1e3)
        same = all(np.array_equal(a, b) for a, b in zip(outs["before"], outs["now"]))
        b, n = (np.median(ts[k]) for k in ("before", "now"))
        cb, cn = (np.median(cpu[k]) for k in ("before", "now"))
        print(f"| {m} | {b:.1f} [{min(ts['before']):.1f}-{max(ts['before']):.1f}] | "
              f"{n:.1f} [{min(ts['now']):.1f}-{max(ts['now']):.1f}] | {n / b:.2f} | "
              f"{cb:.0f} | {cn:.0f} | {cn / cb:.2f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
