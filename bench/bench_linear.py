#!/usr/bin/env python
"""Linear layers, every GEMM candidate of ``layers/gemm.py`` (OpenBLAS sgemm from our pool, our
kernel, both on the packed weights) and MindSpore's MatMul (forceable, not probed; on the
unpacked weights) on the 97 M model's shapes, and what the start-up probe picks on this CPU. Isolated GEMMs only: whole steps (bench_model.py
with LLM_SERVING_GEMM=...) decide, since libraries' threads interfere between calls.

Each timing runs the 12 layers' four projections (qkv, o, gate_up, down; 340 MB of distinct
weights, more than fits in cache) and reports ms per pass, the way a step reads them;
candidates are interleaved, so all see the same machine load.

    python bench/bench_linear.py [--ms 1,4,16,32,64,128,256] [--reps 5]

``--bf16`` instead times the bf16-weight kernels this CPU runs (widen, amx, dot; see gemm.py)
on the same shapes, each on the weight layout it reads, and what the bf16 probe picks.

``--before REV`` instead times our kernel against the one in git revision REV (its
``cpu_layer_ops.cpp`` built on the side, on the weight layout it reads), interleaved: median,
min and max ms per pass over the reps, CPU time, and the largest difference between the two
outputs relative to the outputs' scale. ``--kernel widen|dot|amx`` compares that bf16 kernel
instead of the fp32 one (on bf16 weights; dot and amx where the CPU has them).
"""
from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import numpy as np
from llm_serving.cpu_info import cpu_description  # noqa: E402
from revision import source_at  # noqa: E402 (bench/revision.py)


def model_shapes(layers: int):
    """Start MindSpore on CPU; the 97 M model's hidden and FFN sizes, its four projections as
    (input size, [output sizes]), the generator, and ``layers`` random weights of each."""
    import mindspore as ms
    from llm_serving.model_executor.device import init_device
    init_device("cpu")
    ms.runtime.launch_blocking()
    h, f = 768, 2048
    shapes = [(h, [3 * h]), (h, [h]), (h, [2 * f]), (f, [h])]
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((sum(outs), k), np.float32) * 0.02
               for _ in range(layers) for k, outs in shapes]
    return h, f, shapes, rng, weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--before", metavar="REV",
                    help="our kernel now vs the one in git revision REV")
    ap.add_argument("--kernel", default="fp32", choices=("fp32", "widen", "dot", "amx"),
                    help="with --before: the kernel compared (fp32, or a bf16 one)")
    ap.add_argument("--bf16", action="store_true", help="the bf16-weight kernels instead")
    args = ap.parse_args()
    if args.before:
        return before_after(args)
    if args.bf16:
        return bf16_kernels(args)

    from mindspore import Tensor
    from llm_serving.model_executor.layers import gemm
    from llm_serving.model_executor.layers.linear import Linear
    h, f, shapes, rng, weights = model_shapes(args.layers)

    def build():
        layers = []
        for i, w in enumerate(weights):
            k, outs = shapes[i % 4]
            layers.append(Linear(k, outs))
            layers[-1].set_weight(w)
        return layers
    layers = build()                    # packed, for our kernel and OpenBLAS
    os.environ["LLM_SERVING_GEMM"] = "matmul"       # MatMul reads the weights unpacked
    gemm._plan = None
    unpacked = build()
    del os.environ["LLM_SERVING_GEMM"]
    gemm._plan = None
    cands = gemm.available() + ("matmul",)
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
            for layer in (unpacked if c == "matmul" else layers):
                layer.gemm(c, xs[layer.input_size])
        ts = {c: [] for c in cands}
        for _ in range(args.reps):
            for c in cands:
                t = time.perf_counter()
                for layer in (unpacked if c == "matmul" else layers):
                    y = layer.gemm(c, xs[layer.input_size])
                y.asnumpy()
                ts[c].append(time.perf_counter() - t)
        res = {c: float(np.median(v)) * 1e3 for c, v in ts.items()}
        t = time.perf_counter()
        picks = [plan.choose(layers[i], m) for i in range(4)]
        probe_ms = (time.perf_counter() - t) * 1e3
        print(f"| {m} | " + " | ".join(f"{res[c]:.1f}" for c in cands)
              + f" | {min(res, key=res.get)} | {', '.join(picks)} | {probe_ms:.0f} |", flush=True)


def bf16_kernels(args) -> None:
    from mindspore import Tensor
    from llm_serving.model_executor.layers import gemm
    from llm_serving.model_executor.layers.linear import Linear
    h, f, shapes, rng, weights = model_shapes(args.layers)
    cands = gemm.bf16_kernels()
    layers = {}
    for c in cands:
        os.environ["LLM_SERVING_GEMM_BF16"] = c
        gemm._plan = None
        layers[c] = []
        for i, w in enumerate(weights):
            k, outs = shapes[i % 4]
            layer = Linear(k, outs)
            layer.use_bf16_weight()
            layer.set_weight(w)
            layers[c].append(layer)
    del os.environ["LLM_SERVING_GEMM_BF16"]
    plan = gemm.GemmPlan(None)          # a fresh probe, not the cache
    for layer in layers[cands[0]]:
        plan.register(layer)
    t = time.perf_counter()
    picks = [plan.choose_bf16(layers[cands[0]][i]) for i in range(4)]
    probe_ms = (time.perf_counter() - t) * 1e3
    print(f"# bf16-weight kernels, {datetime.date.today()}, {cpu_description()}")
    dot, fma = instruction_rates()
    if dot:
        print(f"# one core, registers only: VDPBF16PS {dot:.0f} GFLOP/s, FMA {fma:.0f} GFLOP/s "
              f"(dot can beat widen at many rows only where the first is well above the "
              f"second)")
    print(f"# {args.layers} layers x (qkv, o, gate_up, down), ms per pass (median of "
          f"{args.reps}); probe picks (qkv, o, gate_up, down): {', '.join(picks)} "
          f"in {probe_ms:.0f} ms")
    print("| M | " + " | ".join(f"{c} ms" for c in cands) + " | fastest |")
    print("|---|" + "---|" * (len(cands) + 1))
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: Tensor(rng.standard_normal((m, k), np.float32)) for k in (h, f)}
        for c in cands:                      # warm-up
            for layer in layers[c]:
                layer.gemm("kernel", xs[layer.input_size])
        ts = {c: [] for c in cands}
        for _ in range(args.reps):
            for c in cands:
                t = time.perf_counter()
                for layer in layers[c]:
                    y = layer.gemm("kernel", xs[layer.input_size])
                y.asnumpy()
                ts[c].append(time.perf_counter() - t)
        res = {c: float(np.median(v)) * 1e3 for c, v in ts.items()}
        print(f"| {m} | " + " | ".join(f"{res[c]:.1f}" for c in cands)
              + f" | {min(res, key=res.get)} |", flush=True)


def instruction_rates() -> tuple[float, float]:
    """GFLOP/s of one core issuing zmm VDPBF16PS, and zmm FMAs (bf16_dot_rate.cpp); zeros
    where the CPU has no AVX512-BF16."""
    import ctypes
    from llm_serving.model_executor.cpp_build import load_cpp_library
    lib = load_cpp_library(str(Path(__file__).with_name("bf16_dot_rate.cpp")), ("-O2",))
    for fn in (lib.dpbf16_gflops, lib.fma_gflops):
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64]
    n = 200_000_000
    return max(lib.dpbf16_gflops(n) for _ in range(2)), max(lib.fma_gflops(n) for _ in range(2))


def before_after(args) -> None:
    import ctypes
    from llm_serving.model_executor.attention import kernels as attention_kernels
    from llm_serving.model_executor.cpp_build import load_cpp_library
    from llm_serving.model_executor.device import init_device
    from llm_serving.model_executor.layers.custom_op import LAYER_OPS_FLAGS, load_layer_ops
    from llm_serving.model_executor.layers.gemm import (_BF16_ENTRY, TILED_BF16_KERNELS,
                                                        pack_weight, pack_weight_amx)
    init_device("cpu")
    lib = load_layer_ops()
    with source_at(args.before,
                   "llm_serving/model_executor/layers/kernels/cpu_layer_ops.cpp") as old_path:
        src = old_path.read_text()
        old = load_cpp_library(old_path, LAYER_OPS_FLAGS)
    old.lls_layer_ops_set_parallel_for.argtypes = [ctypes.c_void_p]
    old.lls_layer_ops_set_parallel_for(attention_kernels.parallel_for_address())
    entry = "lls_linear_f32" if args.kernel == "fp32" else _BF16_ENTRY[args.kernel]
    getattr(old, entry).restype = ctypes.c_int
    getattr(old, entry).argtypes = lib.lls_linear_f32.argtypes
    # The revision before panels read W [N, K] as it is; ours reads it packed.
    old_packed = "lls_layer_ops_panel_width" in src
    fns = {"before": getattr(old, entry), "now": getattr(lib, entry)}
    h, f = 768, 2048
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((n, k), np.float32) * 0.02
          for _ in range(args.layers) for n, k in ((3 * h, h), (h, h), (2 * f, h), (h, f))]
    if args.kernel == "fp32":
        layouts = {"now": [pack_weight(w) for w in ws],
                   "before": [pack_weight(w) for w in ws] if old_packed else ws}
    else:                   # bf16 bits (truncated: the values do not change the time)
        pack = pack_weight_amx if args.kernel in TILED_BF16_KERNELS else pack_weight
        packed = [pack((w.view(np.uint32) >> 16).astype(np.uint16)) for w in ws]
        layouts = {"now": packed, "before": packed}
    print(f"# our {args.kernel} kernel, {args.before} vs now, {datetime.date.today()}, "
          f"{cpu_description()}")
    print(f"# {args.layers} layers x (qkv, o, gate_up, down), ms per pass, {args.reps} reps "
          f"interleaved: median [min-max]; load average at start: "
          f"{open('/proc/loadavg').read().split()[0]}")
    print("# CPU ms: CPU time of this process's threads (both pool threads, their spinning "
          "included), less sensitive than wall time to other processes' load")
    print("| M | before ms | now ms | now / before | before CPU ms | now CPU ms | CPU now / "
          "before | max diff / max abs |")
    print("|---|---|---|---|---|---|---|---|")
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: rng.standard_normal((m, k), np.float32) for k in (h, f)}
        outs = {name: [np.empty((m, w.shape[0]), np.float32) for w in ws] for name in fns}
        calls = {}
        for name in fns:
            calls[name] = []
            for w, wl, y in zip(ws, layouts[name], outs[name]):
                n, k = w.shape
                calls[name].append((xs[k].ctypes.data, k, wl.ctypes.data, None, m, n, k, 1,
                                    (ctypes.c_int64 * 2)(0, n),
                                    (ctypes.c_void_p * 1)(y.ctypes.data), (ctypes.c_int64 * 1)(n)))
        ts = {name: [] for name in fns}
        cpu = {name: [] for name in fns}
        for rep in range(args.reps + 1):
            for name, fn in fns.items():
                t, c0 = time.perf_counter(), time.process_time()
                for c in calls[name]:
                    if fn(*c):
                        raise RuntimeError(f"{name} kernel rejected its arguments")
                if rep:
                    ts[name].append((time.perf_counter() - t) * 1e3)
                    cpu[name].append((time.process_time() - c0) * 1e3)
        diff = max(float(np.abs(a - b).max() / np.abs(b).max())
                   for a, b in zip(outs["before"], outs["now"]))
        b, n = (np.median(ts[k]) for k in ("before", "now"))
        cb, cn = (np.median(cpu[k]) for k in ("before", "now"))
        print(f"| {m} | {b:.1f} [{min(ts['before']):.1f}-{max(ts['before']):.1f}] | "
              f"{n:.1f} [{min(ts['now']):.1f}-{max(ts['now']):.1f}] | {n / b:.2f} | "
              f"{cb:.0f} | {cn:.0f} | {cn / cb:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
