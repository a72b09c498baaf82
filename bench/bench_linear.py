#!/usr/bin/env python
"""Linear layers, every GEMM candidate of ``layers/gemm.py`` (OpenBLAS sgemm from our pool, our
kernel, both on the packed weights) and MindSpore's MatMul (forceable, not probed; on the
unpacked weights) on the 97 M model's shapes, and what the start-up probe picks on this CPU. Isolated GEMMs only: whole steps (bench_model.py
with LLM_SERVING_GEMM=...) decide, since libraries' threads interfere between calls.

Each timing runs the 12 layers' four projections (qkv, o, gate_up, down; 340 MB of distinct
weights, more than fits in cache) and reports ms per pass, the way a step reads them;
candidates are interleaved, so all see the same machine load.

    python bench/bench_linear.py [--ms 1,4,16,32,64,128,256] [--reps 5]

oneDNN's ``dnnl_sgemm`` (row-major, on the unpacked weights) runs beside them when its library
loads: by default the one MindSpore's wheel ships (``mindspore/lib/libdnnl.so.3``, built for a
thread pool it is not given here, so sequential: the columns are split between one thread per
core), or ``--onednn-lib PATH`` (e.g. the ``onednn-cpu-gomp`` wheel's ``<venv>/lib/libdnnl.so.3``,
OpenMP-threaded: one call; run with ``OMP_WAIT_POLICY=passive``, or its threads spin into the
other candidates' time). It is no candidate of the probe; the header says whether its rows
are bitwise alike across row counts and positions (``gemm.rows_alike``, the probe's check), the
condition for becoming one.

``--bf16`` instead times the bf16-weight kernels this CPU runs (widen, amx, dot; see gemm.py)
on the same shapes, each on the weight layout it reads, and what the bf16 probe picks.

``--int8`` instead times the W8A8 int8 layers (``Linear.use_int8_weight``: the weights
quantized per output channel, activations per token) beside our fp32 kernel on the same shapes,
interleaved, and oneDNN's ``dnnl_gemm_u8s8s32`` (MindSpore's ``libdnnl``, one call per core on
a block of columns, like ``dnnl_sgemm`` above) on the already-quantized activations: its
integer product alone, without the quantization and epilogue ours includes. It prints ms per
pass (median [min] of the reps), the int8 weight's read rate (GB/s), the multiply-adds
(GOP/s, 2 per weight per row) and the floor: the int8 weight bytes over the machine's read
bandwidth (bench_model's probe, measured after each row of the table). ``--int8-builds
"native;-mno-avx512f;-mno-avx512f -mno-avxvnni"`` then times ``lls_linear_int8`` alone (a
ctypes loop, no Python layer between the calls) in each build variant of the kernel library
(each its flags; what a CPU without AVX-512 or without VNNI compiles), interleaved.

``--before REV`` instead times our kernel against the one in git revision REV (its
``cpu_layer_ops.cpp`` built on the side, on the weight layout it reads), interleaved: median,
min and max ms per pass over the reps, CPU time, and the largest difference between the two
outputs relative to the outputs' scale. ``--kernel widen|dot|amx`` compares that bf16 kernel
instead of the fp32 one (on bf16 weights; dot and amx where the CPU has them).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import time
from concurrent.futures import ThreadPoolExecutor
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
    ap.add_argument("--int8", action="store_true",
                    help="the W8A8 int8 layers beside the fp32 kernel (and oneDNN's int8 GEMM)")
    ap.add_argument("--int8-builds", metavar="FLAGS;FLAGS",
                    help="with --int8: also the int8 kernel alone in these build variants")
    ap.add_argument("--onednn-lib", metavar="PATH",
                    help="the libdnnl to time (default: MindSpore's own; 'none' to skip)")
    args = ap.parse_args()
    if args.before:
        return before_after(args)
    if args.bf16:
        return bf16_kernels(args)
    if args.int8:
        return int8_layers(args)

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
    dnnl = OneDnnSgemm.load(args.onednn_lib)
    if dnnl:
        cands += ("onednn",)
    plan = gemm.GemmPlan(None)          # a fresh probe, not the cache
    print(f"# GEMM candidates, {datetime.date.today()}, {cpu_description()}")
    print(f"# {args.layers} layers x (qkv, o, gate_up, down), ms per pass; probe: what the "
          f"start-up probe picks per shape")
    if dnnl:
        alike = [dnnl.batch_invariant(*weights[i].shape) for i in range(4)]
        print(f"# onednn: {dnnl}; rows bitwise alike across row counts (qkv, o, gate_up, "
              f"down): {', '.join('yes' if a else 'no' for a in alike)}")
    print("| M | " + " | ".join(f"{c} ms" for c in cands) + " | fastest | probe picks "
          "(qkv, o, gate_up, down) | probe ms |")
    print("|---|" + "---|" * (len(cands) + 3))
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: Tensor(rng.standard_normal((m, k), np.float32)) for k in (h, f)}
        xn = {k: x.asnumpy() for k, x in xs.items()}
        ys = [np.empty((m, w.shape[0]), np.float32) for w in weights]

        def run(c):
            if c == "onednn":
                for w, y in zip(weights, ys):
                    dnnl(xn[w.shape[1]], w, y)
                return
            for layer in (unpacked if c == "matmul" else layers):
                y = layer.gemm(c, xs[layer.input_size])
            y.asnumpy()
        for c in cands:                      # warm-up
            run(c)
        ts = {c: [] for c in cands}
        for _ in range(args.reps):
            for c in cands:
                t = time.perf_counter()
                run(c)
                ts[c].append(time.perf_counter() - t)
        res = {c: float(np.median(v)) * 1e3 for c, v in ts.items()}
        t = time.perf_counter()
        picks = [plan.choose(layers[i], m) for i in range(4)]
        probe_ms = (time.perf_counter() - t) * 1e3
        print(f"| {m} | " + " | ".join(f"{res[c]:.1f}" for c in cands)
              + f" | {min(res, key=res.get)} | {', '.join(picks)} | {probe_ms:.0f} |", flush=True)


class OneDnnSgemm:
    """y = x @ W.T through oneDNN's ``dnnl_sgemm`` (row-major; W [N, K] unpacked). A build
    with the OpenMP runtime threads itself; any other (MindSpore's is built for a thread pool,
    which the C call cannot be given, so it runs sequentially) gets the columns split into
    one block per core, each called from its own thread (ctypes releases the GIL)."""

    _OMP = 2                            # dnnl_version_t.cpu_runtime: DNNL_RUNTIME_OMP

    class _Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                    ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                    ("gpu_runtime", ctypes.c_uint)]

    @classmethod
    def load(cls, path: str | None):
        """From ``path`` (exits naming it when it is no oneDNN library), or MindSpore's bundled
        library (None when it is absent or unusable); None with 'none'."""
        if path == "none":
            return None
        given = path is not None
        if not given:
            import mindspore
            path = str(Path(mindspore.__file__).parent / "lib" / "libdnnl.so.3")
        try:
            return cls(path)
        except (OSError, AttributeError) as e:      # not loadable, or no dnnl_sgemm in it
            if given:
                raise SystemExit(f"--onednn-lib {path}: not a oneDNN library ({e})") from None
            print(f"# onednn: not timed: MindSpore's {path} did not load ({e})")
            return None

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        lib.dnnl_version.restype = ctypes.POINTER(self._Version)
        v = lib.dnnl_version().contents
        self.omp = v.cpu_runtime == self._OMP
        # An OpenMP build's threads spin after each call, on the cores the next candidate
        # needs, unless OMP_WAIT_POLICY=passive when libgomp loads (with MindSpore, before
        # this library).
        spin = self.omp and os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive"
        note = "; OMP_WAIT_POLICY is not passive: its threads spin into the others' time"
        self.name = (f"oneDNN {v.major}.{v.minor}.{v.patch} ({path}; "
                     f"{'OpenMP' if self.omp else 'one call per core'}{note if spin else ''})")
        self.fn = lib.dnnl_sgemm
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        self.fn.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, f32, ptr, i64, ptr,
                            i64, f32, ptr, i64]
        self.fn.restype = ctypes.c_int
        self.parts = 1 if self.omp else len(os.sched_getaffinity(0))
        self.pool = ThreadPoolExecutor(self.parts) if self.parts > 1 else None

    def __str__(self) -> str:
        return self.name

    def _block(self, x, w, y, n0, n1) -> None:
        (m, k), n = x.shape, w.shape[0]
        if self.fn(b"N", b"T", m, n1 - n0, k, 1.0, x.ctypes.data, k, w[n0:].ctypes.data, k,
                   0.0, y.ctypes.data + 4 * n0, n):
            raise RuntimeError(f"dnnl_sgemm failed on [{m}, {k}] x [{n}, {k}]")

    def __call__(self, x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
        n = w.shape[0]
        if not self.pool:
            return self._block(x, w, y, 0, n)
        cuts = [n * i // self.parts // 16 * 16 for i in range(self.parts)] + [n]
        for f in [self.pool.submit(self._block, x, w, y, a, b)
                  for a, b in zip(cuts[:-1], cuts[1:])]:
            f.result()

    def batch_invariant(self, n: int, k: int) -> bool:
        """``gemm.batch_invariant``'s check on this library: every row of a call on some rows
        bitwise equal to the same row of one call on all of them."""
        from llm_serving.model_executor.layers.gemm import rows_alike
        rng = np.random.default_rng(1)
        w = rng.standard_normal((n, k), dtype=np.float32)

        def run(rows):
            y = np.empty((len(rows), n), np.float32)
            self(np.ascontiguousarray(rows), w, y)
            return y
        return rows_alike(run, k, rng)


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


class OneDnnInt8(OneDnnSgemm):
    """Exact int32 x_u8 @ W_s8.T through oneDNN's ``dnnl_gemm_u8s8s32`` (row-major, W [N, K]
    unpacked), threaded as ``OneDnnSgemm``. The library packs W on every call."""

    def __init__(self, path: str):
        super().__init__(path)
        lib = ctypes.CDLL(path)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.fn = lib.dnnl_gemm_u8s8s32
        self.fn.argtypes = [ctypes.c_char, ctypes.c_char, ctypes.c_char, i64, i64, i64,
                            ctypes.c_float, ptr, i64, ctypes.c_uint8, ptr, i64, ctypes.c_int8,
                            ctypes.c_float, ptr, i64, ptr]
        self.fn.restype = ctypes.c_int
        self.co = (ctypes.c_int32 * 1)(0)
        self.name = self.name.replace("oneDNN", "oneDNN dnnl_gemm_u8s8s32", 1)

    def _block(self, x, w, y, n0, n1) -> None:
        (m, k), n = x.shape, w.shape[0]
        if self.fn(b"N", b"T", b"F", m, n1 - n0, k, 1.0, x.ctypes.data, k, 0,
                   w[n0:].ctypes.data, k, 0, 0.0, y.ctypes.data + 4 * n0, n, self.co):
            raise RuntimeError(f"dnnl_gemm_u8s8s32 failed on [{m}, {k}] x [{n}, {k}]")


def int8_layers(args) -> None:
    from mindspore import Tensor
    from bench_model import ReadBandwidth
    from llm_serving.model_executor.layers.custom_op import cpu_layer_ops
    from llm_serving.model_executor.layers.linear import Linear
    h, f, shapes, rng, weights = model_shapes(args.layers)
    fp32, int8, qs = [], [], []
    for i, w in enumerate(weights):
        k, outs = shapes[i % 4]
        fp32.append(Linear(k, outs))
        fp32[-1].set_weight(w)
        scale = (np.abs(w).max(1) / 127).astype(np.float32)
        qs.append(np.clip(np.rint(w / scale[:, None]), -128, 127).astype(np.int8))
        int8.append(Linear(k, outs))
        int8[-1].use_int8_weight()
        int8[-1].set_int8_weight(qs[-1], scale)
    try:
        import mindspore
        dnnl = None if args.onednn_lib == "none" else OneDnnInt8(
            args.onednn_lib or str(Path(mindspore.__file__).parent / "lib" / "libdnnl.so.3"))
    except (OSError, AttributeError) as e:
        print(f"# onednn int8: not timed ({e})")
        dnnl = None
    bw = ReadBandwidth()
    nbytes = sum(q.nbytes for q in qs)
    print(f"# W8A8 int8 layers vs the fp32 kernel, {datetime.date.today()}, {cpu_description()}")
    print(f"# int8 kernel: {cpu_layer_ops().lls_int8_dot_kind().decode()}; "
          f"{args.layers} layers x (qkv, o, gate_up, down): {nbytes / 1e6:.0f} MB int8, "
          f"{4 * nbytes / 1e6:.0f} MB fp32; ms per pass, median [min] of {args.reps}")
    if dnnl:
        print(f"# onednn: {dnnl} (integer product only)")
    print("| M | fp32 ms | int8 ms | fp32 / int8 | onednn int8 ms | int8 GB/s | int8 GOP/s | "
          "floor ms (int8 bytes / read bw) | read GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: Tensor(rng.standard_normal((m, k), np.float32)) for k in (h, f)}
        xu = {k: rng.integers(0, 256, (m, k), dtype=np.uint8) for k in (h, f)}
        ys = [np.empty((m, q.shape[0]), np.int32) for q in qs]
        # each arm: one pass over the 48 projections (the layers' last output read back)
        arms = {"fp32": lambda: [l.gemm("kernel", xs[l.input_size]) for l in fp32][-1].asnumpy(),
                "int8": lambda: [l.gemm("kernel", xs[l.input_size]) for l in int8][-1].asnumpy()}
        if dnnl:
            arms["onednn"] = lambda: [dnnl(xu[q.shape[1]], q, y) for q, y in zip(qs, ys)]
        cands = tuple(arms)
        ts = {c: [] for c in cands}
        for rep in range(args.reps + 1):     # the first round warms up
            for c, run in arms.items():
                t = time.perf_counter()
                run()
                if rep:
                    ts[c].append((time.perf_counter() - t) * 1e3)
        med = {c: float(np.median(v)) for c, v in ts.items()}
        cell = {c: f"{med[c]:.2f} [{min(ts[c]):.2f}]" for c in cands}
        rate = bw()
        print(f"| {m} | {cell['fp32']} | {cell['int8']} | {med['fp32'] / med['int8']:.2f}x | "
              f"{cell.get('onednn', '-')} | {nbytes / med['int8'] / 1e6:.1f} | "
              f"{2 * m * nbytes / med['int8'] / 1e6:.0f} | {nbytes / rate * 1e3:.2f} | "
              f"{rate / 1e9:.1f} |", flush=True)
    if args.int8_builds:
        int8_builds(args, int8, rng, bw, nbytes)


def int8_builds(args, layers, rng, bw, nbytes) -> None:
    """``lls_linear_int8`` alone on ``layers``' packed weights, in each build variant."""
    from llm_serving.model_executor.layers.custom_op import load_layer_ops
    builds = [b.strip() for b in args.int8_builds.split(";")]
    libs = [load_layer_ops(() if b == "native" else tuple(b.split())) for b in builds]
    kinds = [lib.lls_int8_dot_kind().decode() for lib in libs]
    print(f"# lls_linear_int8 alone, ms per pass (median [min] of {args.reps}), by build: "
          + "; ".join(f"{b}: {k}" for b, k in zip(builds, kinds)))
    print("| M | " + " | ".join(f"{k} ms | {k} GB/s, GOP/s" for k in kinds)
          + " | floor ms |")
    print("|---|" + "---|---|" * len(kinds) + "---|")
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: rng.standard_normal((m, k), np.float32) for k in {l.input_size for l in layers}}
        ys = [np.empty((m, l.gemm_shape[0]), np.float32) for l in layers]
        calls = [(xs[l.input_size].ctypes.data, l.input_size, l.weight.data_ptr(),
                  *l.int8_scales.args, None, m, l.gemm_shape[0], l.input_size, 1,
                  (ctypes.c_int64 * 2)(0, l.gemm_shape[0]),
                  (ctypes.c_void_p * 1)(y.ctypes.data), (ctypes.c_int64 * 1)(l.gemm_shape[0]))
                 for l, y in zip(layers, ys)]
        ts = [[] for _ in libs]
        for rep in range(args.reps + 1):
            for lib, t in zip(libs, ts):
                t0 = time.perf_counter()
                for c in calls:
                    if lib.lls_linear_int8(*c):
                        raise RuntimeError("lls_linear_int8 rejected its arguments")
                if rep:
                    t.append((time.perf_counter() - t0) * 1e3)
        cells = []
        for t in ts:
            med = float(np.median(t))
            cells.append(f"{med:.2f} [{min(t):.2f}] | {nbytes / med / 1e6:.1f}, "
                         f"{2 * m * nbytes / med / 1e6:.0f}")
        print(f"| {m} | " + " | ".join(cells) + f" | {nbytes / bw() * 1e3:.2f} |", flush=True)


def instruction_rates() -> tuple[float, float]:
    """GFLOP/s of one core issuing zmm VDPBF16PS, and zmm FMAs (bf16_dot_rate.cpp); zeros
    where the CPU has no AVX512-BF16."""
    from llm_serving.model_executor.cpp_build import load_cpp_library
    lib = load_cpp_library(str(Path(__file__).with_name("bf16_dot_rate.cpp")), ("-O2",))
    for fn in (lib.dpbf16_gflops, lib.fma_gflops):
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64]
    n = 200_000_000
    return max(lib.dpbf16_gflops(n) for _ in range(2)), max(lib.fma_gflops(n) for _ in range(2))


def before_after(args) -> None:
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
