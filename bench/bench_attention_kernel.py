"""Benchmark the CPU paged-attention kernels and the MindSpore bridge.

    python bench/bench_attention_kernel.py [--ctx 256] [--block-size 16] [--no-mindspore]
                                           [--heads 12 --kv-heads 12]

Prints
  1. the kernel alone: decode at B=1,16,64,128 (context --ctx) and a prefill of --prefill
     tokens; us per call, GB/s of K/V read and GFLOP/s. "cold" rotates over --layers layers of
     cache like a real step (K/V larger than the L3 cache for B >= 64), "hot" reuses one layer;
  2. the bridge: us per call of one layer's attention (reshape_and_cache + attention) at B=1 and
     B=64 through each path, for a 12-layer step: raw ctypes with precomputed arguments, the
     NumPy API, attention_forward (MindSpore Tensors in/out over ctypes, the default), and
     ops.Custom "aot" in PyNative and inside mindspore.jit.

Times are medians and 10th percentiles (p10). The machine has two cores; anything else running
on it shows up as noise (the load average is printed first); p10 approximates an idle machine.

    python bench/bench_attention_kernel.py --before REV [--cache-dtype bfloat16] [--in-step]
                                           [--batches 1,4,16,64] [--reps 10]
                                           [--build-flags=-mno-avx512f]

instead times the kernel now against the one in git revision REV (its cpu_paged_attention.cpp
built on the side), interleaved call by call: us per layer call (median) of decode at each
--batches size and of a --prefill prefill, and whether both gave the same bits. ``--in-step``
streams --evict-mb of bf16 weights through a GEMV on the same thread pool before each timed
call, as a decode step's weights stream between two attention calls: the K/V come from memory
and the pool's helpers are awake, as in a step ("cold" above is L3-resident below B=64).
``--build-flags`` builds both sides with these extra compiler flags (comma-separated):
``-mno-avx512f`` times the portable path's AVX2 code, which a CPU without AVX-512 (AMD Zen 3)
runs.

``--heads`` and ``--kv-heads`` set the attention's shape in either mode (default: the 97 M
model's 12 heads, MHA); ``--heads 16 --kv-heads 4`` is the bench-gqa model's GQA.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_serving.model_executor.attention import kernels as K  # noqa: E402
from llm_serving.model_executor.attention.cpu import host_zeros  # noqa: E402
from revision import source_at  # noqa: E402 (bench/revision.py)

H, KVH, D = 12, 12, 64
SCALE = 1.0 / np.sqrt(D)


def time_us(fn, min_reps=20, warm_s=0.3, budget_s=1.5):
    """(median, 10th percentile) of per-call wall time in microseconds."""
    t_end = time.perf_counter() + warm_s
    n = 0
    while time.perf_counter() < t_end or n < 3:
        fn()
        n += 1
    ts = []
    t_stop = time.perf_counter() + budget_s
    while len(ts) < min_reps or (time.perf_counter() < t_stop and len(ts) < 2000):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6, float(np.percentile(ts, 10)) * 1e6


def interleaved_us(fns, rounds=8, budget_s=0.15):
    """Time several functions in alternating rounds (fair under background load).
    Returns {name: (median, p10)} in microseconds per call."""
    ts = {name: [] for name in fns}
    for name, fn in fns.items():  # warm up
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t_stop = time.perf_counter() + budget_s
            n = 0
            while n < 3 or time.perf_counter() < t_stop:
                t0 = time.perf_counter()
                fn()
                ts[name].append(time.perf_counter() - t0)
                n += 1
    return {name: (float(np.median(v)) * 1e6, float(np.percentile(v, 10)) * 1e6)
            for name, v in ts.items()}


def case_batch(args, b, ctx, qlen):
    """The Batch of one case: a prefill over one layer of cache; a decode over as many layers
    (2 to --layers) as rotating through them reads --cold-bytes of K/V, so "cold" comes from
    memory."""
    per_layer = b * ctx * KVH * D * 2 * K.CACHE_DTYPES[args.cache_dtype].itemsize
    layers = 1 if qlen > 1 else int(min(args.layers, max(2, -(-args.cold_bytes // per_layer))))
    return Batch(b, ctx, qlen, layers, args.block_size, cache_dtype=args.cache_dtype)


class Batch:
    """A decode (q_len 1) or prefill batch over `layers` layers of paged cache."""

    def __init__(self, batch, ctx, qlen, layers, block_size, seed=0, cache_dtype="float32"):
        rng = np.random.default_rng(seed)
        self.B, self.ctx, self.qlen, self.L = batch, ctx, qlen, layers
        nbps = (ctx + block_size - 1) // block_size
        nb = batch * nbps
        storage = K.CACHE_DTYPES[cache_dtype]

        def cache():
            # as the engine allocates it (host_zeros: committed, on huge pages where the
            # kernel allows), random values (the softmax's running max moves as in a model)
            shape = (nb, block_size, KVH, D)
            c = host_zeros(shape, storage)
            r = rng.standard_normal(shape, dtype=np.float32)
            # bf16 bits: the high half of the float32
            c[...] = ((r.view(np.uint32) >> 16).astype(np.uint16) if cache_dtype == "bfloat16"
                      else r)
            return c
        self.k = [cache() for _ in range(layers)]
        self.v = [cache() for _ in range(layers)]
        self.itemsize = storage.itemsize
        self.bt = rng.permutation(nb).astype(np.int32).reshape(batch, nbps)
        self.T = batch * qlen
        self.qsl = (np.arange(batch + 1) * qlen).astype(np.int32)
        self.sl = np.full(batch, ctx, np.int32)
        pos = np.arange(ctx - qlen, ctx)
        self.sm = (self.bt[:, pos // block_size] * block_size + pos % block_size).reshape(-1).astype(np.int32)
        self.q = rng.standard_normal((self.T, H * D)).astype(np.float32)
        self.kn = rng.standard_normal((self.T, KVH * D)).astype(np.float32)
        self.vn = rng.standard_normal((self.T, KVH * D)).astype(np.float32)
        self.out = np.empty_like(self.q)
        self.i = 0

    def kv_bytes(self):
        return self.B * self.ctx * KVH * D * self.itemsize * 2

    def flops(self):
        # QK^T and PV over the causal context of every query row
        pairs = self.B * (self.qlen * self.ctx - self.qlen * (self.qlen - 1) / 2)
        return 4.0 * H * D * pairs

    def attention(self):
        l = self.i % self.L
        self.i += 1
        K.paged_attention(self.q, self.k[l], self.v[l], self.bt, self.qsl, self.sl, SCALE, self.out)

    def fused(self):
        l = self.i % self.L
        self.i += 1
        K.attention_fused(self.q, self.kn, self.vn, self.k[l], self.v[l], self.sm, self.bt,
                          self.qsl, self.sl, SCALE, self.out)


def kernel_table(args):
    from llm_serving.cpu_info import cpu_description
    print(f"# CPU: {cpu_description()}")
    print(f"\n## Kernel (H={H}, KVH={KVH}, D={D}, block_size={args.block_size}, "
          f"cache {args.cache_dtype}, "
          f"threads={K._lib().lls_get_num_threads()}, avx512={K.has_avx512()})")
    print("cold: rotating over `layers` layers of cache; hot: one layer (L2/L3 resident); "
          "fused: reshape_and_cache + attention, cold")
    print(f"{'case':24s} {'layers':>6s} {'us/call':>9s} {'p10 us':>9s} {'GB/s':>6s} "
          f"{'p10GB/s':>7s} {'GFLOP/s':>7s} {'hot us':>8s} {'hotGB/s':>7s} {'fused us':>9s}")
    cases = [(b, args.ctx, 1) for b in (1, 16, 64, 128)] + [(1, args.prefill, args.prefill)]
    for b, ctx, qlen in cases:
        bt = case_batch(args, b, ctx, qlen)
        cold, cold10 = time_us(bt.attention)
        fused, _ = time_us(bt.fused)
        bt.L = 1
        hot, hot10 = time_us(bt.attention)
        name = f"decode B={b} ctx={ctx}" if qlen == 1 else f"prefill {qlen} tokens"
        gb = bt.kv_bytes() / 1e3
        print(f"{name:24s} {len(bt.k):6d} {cold:9.1f} {cold10:9.1f} {gb / cold:6.1f} {gb / cold10:7.1f} "
              f"{bt.flops() / cold10 / 1e3:7.1f} {hot:8.1f} {gb / hot:7.1f} {fused:9.1f}")
        del bt


def bridge_table(args):
    import mindspore as ms

    ms.runtime.launch_blocking()
    lib = K.load_library()
    L = 12
    print(f"\n## MindSpore bridge: one layer = reshape_and_cache + attention, {L} layers per step, "
          f"ctx={args.ctx}")
    print("us/call = step time / 12 (median, 10th percentile); overhead = minus the raw kernel call")
    print(f"{'path':44s} {'B':>3s} {'us/call':>9s} {'p10 us':>9s} {'overhead':>9s}")
    for b in (1, 64):
        bt = Batch(b, args.ctx, 1, L, args.block_size, seed=1)
        q, k, v = ms.Tensor(bt.q), ms.Tensor(bt.kn), ms.Tensor(bt.vn)
        raw_args = [
            (bt.q.ctypes.data, H * D, bt.kn.ctypes.data, KVH * D, bt.vn.ctypes.data, KVH * D,
             bt.k[l].ctypes.data, bt.v[l].ctypes.data, bt.sm.ctypes.data, bt.T, bt.bt.ctypes.data,
             bt.bt.shape[1], bt.qsl.ctypes.data, bt.sl.ctypes.data, b, bt.T, H, KVH, D,
             args.block_size, bt.k[0].shape[0], float(SCALE), bt.out.ctypes.data, H * D, None)
            for l in range(L)]

        def raw():
            for l in range(L):
                lib.lls_attention_fused(*raw_args[l])

        def numpy_api():
            for l in range(L):
                K.attention_fused(bt.q, bt.kn, bt.vn, bt.k[l], bt.v[l], bt.sm, bt.bt, bt.qsl,
                                  bt.sl, SCALE, bt.out)

        def ctypes_bridge():
            for l in range(L):
                o = K.attention_forward(q, k, v, bt.k[l], bt.v[l], bt.sm, bt.bt, bt.qsl, bt.sl,
                                        SCALE)
            return o

        kp = [ms.Parameter(ms.Tensor(bt.k[l]), name=f"bk{b}_{l}") for l in range(L)]
        vp = [ms.Parameter(ms.Tensor(bt.v[l]), name=f"bv{b}_{l}") for l in range(L)]
        op = K.aot_attention_op()
        sc = ms.Tensor(np.array([SCALE], np.float32))

        def aot_pynative():
            meta = [ms.Tensor(bt.sm), ms.Tensor(bt.bt), ms.Tensor(bt.qsl), ms.Tensor(bt.sl)]
            for l in range(L):
                o = op(q, k, v, kp[l], vp[l], *meta, sc)
            return o

        @ms.jit
        def jit_step(q, k, v, sm, btab, qsl, sl, sc):
            o = q
            for l in range(L):
                o = op(o, k, v, kp[l], vp[l], sm, btab, qsl, sl, sc)
            return o

        def aot_jit():
            meta = [ms.Tensor(bt.sm), ms.Tensor(bt.bt), ms.Tensor(bt.qsl), ms.Tensor(bt.sl)]
            jit_step(q, k, v, *meta, sc).asnumpy()

        paths = {"raw ctypes, precomputed args (kernel)": raw,
                 "NumPy API attention_fused": numpy_api,
                 "attention_forward: Tensor in/out, ctypes": ctypes_bridge,
                 "ops.Custom aot, PyNative": aot_pynative,
                 "ops.Custom aot, 12 layers in one jit": aot_jit}
        r = interleaved_us(paths, rounds=6, budget_s=0.3)
        base = r["raw ctypes, precomputed args (kernel)"][1] / L
        for name, (t, t10) in r.items():
            print(f"{name:44s} {b:3d} {t / L:9.1f} {t10 / L:9.1f} {t10 / L - base:9.1f}")
        bt = kp = vp = None        # free before the next size (closures read them)


def interference_table(args):
    """Attention followed by a MindSpore matmul, as in a model step: the built-in pool against
    an OpenMP build of the same kernel (libgomp's idle threads spin for ~10 ms here)."""
    import mindspore as ms
    from mindspore import ops

    ms.runtime.launch_blocking()
    variants = (("pool (default)", ()), ("OpenMP build", ("-DLLS_USE_OPENMP", "-fopenmp")))
    libs = {name: K.load_library(flags) for name, flags in variants}
    default = K._libs[()]
    w = ms.Tensor(np.full((3 * H * D, H * D), 0.01, np.float32))
    mm = ops.MatMul(transpose_b=True)
    print(f"\n## Attention then a MindSpore matmul [B,{H * D}]x[{H * D},{3 * H * D}] (us, median / p10)")
    print(f"{'threading':16s} {'B':>3s} {'attention':>17s} {'matmul':>17s} {'attn+matmul':>17s}")
    try:
        for b in (1, 16, 64):
            bt = Batch(b, args.ctx, 1, 1, args.block_size, seed=2)
            q, k = ms.Tensor(bt.q), ms.Tensor(bt.kn)
            x = ms.Tensor(bt.q)

            def att():
                return K.attention_forward(q, k, k, bt.k[0], bt.v[0], bt.sm, bt.bt, bt.qsl, bt.sl,
                                           SCALE)

            def mat():
                return mm(x, w)

            def both():
                att()
                mat()

            def using(lib, fn):
                def call():
                    K._libs[()] = lib
                    return fn()
                return call

            fns = {}
            for name, lib in libs.items():
                for fname, fn in (("att", att), ("mat", mat), ("both", both)):
                    fns[(name, fname)] = using(lib, fn)
            r = interleaved_us(fns)
            for name in libs:
                print(f"{name:16s} {b:3d} " + " ".join(
                    f"{r[(name, f)][0]:8.1f} /{r[(name, f)][1]:7.1f}" for f in ("att", "mat", "both")))
            bt = None              # free before the next size (closures read it)
    finally:
        K._libs[()] = default


class WeightStream:
    """A GEMV over ``mb`` MB of bf16 weights on a kernel library's thread pool: what a decode
    step reads between two attention calls (it evicts their K/V from the caches and leaves
    the pool's helpers spinning, as the step's linear layers do)."""

    def __init__(self, mb: int):
        import ctypes
        from llm_serving.model_executor.device import init_device
        from llm_serving.model_executor.layers.custom_op import load_layer_ops
        from llm_serving.model_executor.layers.gemm import pack_weight
        init_device("cpu")
        self.ops = load_layer_ops()
        k = 1536
        n = (mb << 20) // (2 * k)
        bits = np.random.default_rng(1).integers(0x3C00, 0x3F80, (n, k), dtype=np.uint16)  # normal
        self.w = pack_weight(bits)
        self.x, self.y = np.ones((1, k), np.float32), np.empty((1, n), np.float32)
        self.args = (self.x.ctypes.data, k, self.w.ctypes.data, None, 1, n, k, 1,
                     (ctypes.c_int64 * 2)(0, n), (ctypes.c_void_p * 1)(self.y.ctypes.data),
                     (ctypes.c_int64 * 1)(n))

    def __call__(self, lib) -> None:
        import ctypes
        self.ops.lls_layer_ops_set_parallel_for(
            ctypes.cast(lib.lls_parallel_for, ctypes.c_void_p).value)
        if self.ops.lls_linear_bf16(*self.args):
            raise RuntimeError("the weight-stream GEMV rejected its arguments")

    def restore(self) -> None:
        self.ops.lls_layer_ops_set_parallel_for(K.parallel_for_address())


def before_after(args):
    from llm_serving.cpu_info import cpu_description
    from llm_serving.model_executor.cpp_build import load_cpp_library
    flags = tuple(f for f in args.build_flags.split(",") if f)
    with source_at(args.before, "llm_serving/model_executor/attention/kernels/"
                   "cpu_paged_attention.cpp") as path:
        old = load_cpp_library(path, K.ATTENTION_FLAGS + flags)
    K._declare(old)
    libs = {"before": old, "now": K.load_library(flags)}
    for lib in libs.values():
        lib.lls_set_num_threads(args.threads)
    stream = WeightStream(args.evict_mb) if args.in_step else None
    storage = K.CACHE_DTYPES[args.cache_dtype]
    entry = "lls_paged_attention" + K._CACHE_SUFFIX[storage]
    print(f"# attention kernel, {args.before} vs now, {cpu_description()}, cache "
          f"{args.cache_dtype}, ctx {args.ctx}, block size {args.block_size}, "
          + (f"built with {' '.join(flags)} (avx512 path: {bool(libs['now'].lls_has_avx512())}), "
             if flags else "")
          + (f"in step (a {args.evict_mb} MB bf16 GEMV before each call)" if stream else
             "back to back (cache rotated as in 'cold')"))
    print(f"# us per layer call, median of {args.reps} rounds interleaved call by call; load "
          f"average at start: {os.getloadavg()[0]:.2f}")
    print("| case | before us | now us | now / before | same bits |")
    print("|---|---|---|---|---|")
    cases = [(b, args.ctx, 1) for b in map(int, args.batches.split(","))]
    cases.append((1, args.prefill, args.prefill))
    try:
        for b, ctx, qlen in cases:
            bt = case_batch(args, b, ctx, qlen)
            layers = len(bt.k)
            calls = [(bt.q.ctypes.data, H * D, bt.k[i].ctypes.data, bt.v[i].ctypes.data,
                      bt.bt.ctypes.data, bt.bt.shape[1], bt.qsl.ctypes.data, bt.sl.ctypes.data,
                      bt.B, bt.T, H, KVH, D, args.block_size, bt.k[0].shape[0], float(SCALE),
                      bt.out.ctypes.data, H * D, None) for i in range(layers)]
            work = max(1, b * ctx * (8 if qlen > 1 else 1) // 256)   # ~ a decode B=1 call
            per_round = max(3, min(40, 2000 // work))
            ts = {name: [] for name in libs}
            outs = {}
            for rnd in range(args.reps + 1):
                for name, lib in libs.items():
                    fn = getattr(lib, entry)
                    for i in range(per_round):
                        if stream:
                            stream(lib)
                        t = time.perf_counter()
                        if fn(*calls[i % layers]):
                            raise RuntimeError(f"{name} kernel rejected its arguments")
                        if rnd:                      # round 0 warms up
                            ts[name].append(time.perf_counter() - t)
                    outs[name] = bt.out.copy()       # (the last call: layer of the same index)
            before, now = (float(np.median(ts[n])) * 1e6 for n in ("before", "now"))
            name = f"decode B={b}" if qlen == 1 else f"prefill {qlen} tokens"
            print(f"| {name} | {before:.1f} | {now:.1f} | {now / before:.3f} | "
                  f"{np.array_equal(outs['before'], outs['now'])} |", flush=True)
            bt = None
    finally:
        if stream:
            stream.restore()


def main():
    global H, KVH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=256, help="decode context length")
    ap.add_argument("--prefill", type=int, default=512, help="prefill length")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12, help="max layers rotated for 'cold'")
    ap.add_argument("--cold-bytes", type=int, default=1 << 30,
                    help="rotate enough layers to touch this many K/V bytes (capped by --layers)")
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: all cores)")
    ap.add_argument("--heads", type=int, default=H, help="query heads (the 97 M model's: 12)")
    ap.add_argument("--kv-heads", type=int, default=KVH,
                    help="kv heads (12: the 97 M model's MHA; 16 heads on 4: bench-gqa's GQA)")
    ap.add_argument("--no-mindspore", action="store_true", help="skip the bridge table")
    ap.add_argument("--cache-dtype", choices=tuple(K.CACHE_DTYPES), default="float32",
                    help="KV cache storage (the kernel table)")
    ap.add_argument("--before", metavar="REV",
                    help="the kernel now against the one in git revision REV (see above)")
    ap.add_argument("--batches", default="1,4,16,64", help="with --before: decode batch sizes")
    ap.add_argument("--reps", type=int, default=10, help="with --before: rounds")
    ap.add_argument("--in-step", action="store_true",
                    help="with --before: stream weights between calls, as a decode step does")
    ap.add_argument("--evict-mb", type=int, default=64,
                    help="with --in-step: MB of bf16 weights streamed before each call")
    ap.add_argument("--build-flags", default="",
                    help="with --before: extra compiler flags for both builds, comma-separated "
                         "(-mno-avx512f: the portable path)")
    args = ap.parse_args()
    H, KVH = args.heads, args.kv_heads
    if H % KVH:
        ap.error(f"--heads {H} is not a multiple of --kv-heads {KVH}")
    if args.before:
        return before_after(args)
    K.load_library()
    K.set_num_threads(args.threads)
    print(f"load average: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    kernel_table(args)
    if not args.no_mindspore:
        bridge_table(args)
        interference_table(args)


if __name__ == "__main__":
    main()
