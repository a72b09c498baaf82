#!/usr/bin/env python
"""Model benchmark on the 97 M random Llama (hidden 768, 12 layers, 12 heads, FFN 2048,
vocab 8000, fp32; ``--model bench-gqa`` for the 287 M one with GQA, or a directory): decode
step time (median over --steps steps, each timed right after an untimed one, as steady
decoding runs them) at several batch sizes and prefill throughput (median of 3), against the
memory-bandwidth floor measured in the same run (weight bytes / read bandwidth with every core
reading; each decode case's own bandwidth, measured between its steps, since it drifts on a
shared VM).

    python bench/bench_model.py [--batches 1,16,64,128] [--context 256] [--steps 20]
                                [--arms fp32,bf16] [--model bench|bench-gqa|DIR]

``--arms`` compares configurations in one run, interleaved step by step (each case alternates
the arms, so both see the same machine load): fp32; bf16 (``--dtype bfloat16 --kv-cache-dtype
bfloat16``, each shape's bf16 kernel picked by the probe: see layers/gemm.py); bf16-weights;
bf16-kv; fp16-kv (``--kv-cache-dtype float16``); fp8-kv and fp8e5m2-kv (``--kv-cache-dtype
fp8`` or ``fp8_e5m2``); fp32-eager (``--enforce-eager``: no decode
step replayed from a capture, model_executor/cpu_graph.py); bf16-widen, bf16-amx and bf16-dot
(bf16 with that kernel forced, ``LLM_SERVING_GEMM_BF16``: weights widened to fp32 with fp32
activations, or activations rounded to bf16 on AMX tiles or in AVX512-BF16 dot products; the
last two where the CPU has them); w8a8 (the model's W8A8 int8 checkpoint, made once by
``python -m llm_serving.quantize`` into ``$LLM_SERVING_HOME/models/<name>-w8a8``: int8 linear
layers on the int8 kernel, the rest fp32); w8a8-fp8kv (that checkpoint with ``--kv-cache-dtype
fp8``). Each arm's floor counts the bytes its weights
really take.
An arm may end in ``@N`` for KV blocks of N tokens instead of 16 (``fp32,fp32@128``: vLLM-CPU's
default block size against ours), and before that in ``~`` and layers whose KV cache stays
fp32 (``fp8-kv~first+last``, ``fp8-kv~0+5``: ``--kv-cache-dtype-skip-layers``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path
from unittest import mock

import numpy as np
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import (MODEL_HELP, QUANTIZED_ARMS,  # noqa: E402
                                                   model_path, w8a8_copy)


class ReadBandwidth:
    """Streaming reads of a buffer larger than any L3 with all cores (OpenMP, C++): the memory
    bandwidth the batch-1 and KV floors divide by. It drifts on these shared VMs (33 to 60 GB/s
    within one session on AMD Zen 4), so each decode case takes its own, one pass after each
    round of its steps (the median), instead of one figure for the whole run."""

    def __init__(self, n_bytes: int = 512 << 20):
        import ctypes
        from llm_serving.model_executor.cpp_build import load_cpp_library
        # -fopenmp: without it the pragma is ignored and this measures one core (about half).
        self.lib = load_cpp_library(str(Path(__file__).with_name("read_bandwidth.cpp")),
                                    ("-fopenmp",))
        self.lib.sum_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self.lib.sum_f32.restype = ctypes.c_double
        self.a = np.ones(n_bytes // 4, np.float32)
        self()

    def __call__(self) -> float:
        """Bytes/s of one pass."""
        t = time.perf_counter()
        self.lib.sum_f32(self.a.ctypes.data, self.a.size)
        return self.a.nbytes / (time.perf_counter() - t)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far; 0 if it is gone (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


def _busy_seconds(pids=()) -> tuple[float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds used by this process and by the
    processes ``pids``) so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v) - v[3] - v[4]                      # minus idle and iowait
    own = sum(os.times()[:2]) + sum(process_cpu_seconds(pid) for pid in pids)
    return busy / os.sysconf("SC_CLK_TCK"), own


class OtherLoad:
    """Average number of cores other processes kept busy while the block ran (Linux). The
    benchmark's own processes are this one and ``pids`` (e.g. its WorkAgents)."""

    def __init__(self, pids=()):
        self.pids = list(pids)

    def __enter__(self):
        self.t = time.perf_counter()
        self.b = _busy_seconds(self.pids)
        return self

    def __exit__(self, *exc):
        busy, own = _busy_seconds(self.pids)
        self.cores = max(0.0, (busy - self.b[0]) - (own - self.b[1])) / (
            time.perf_counter() - self.t)


# arm -> (dtype, kv_cache_dtype, enforce_eager, forced bf16 kernel)
ARMS = {"fp32": ("float32", "float32", False, None),
        "bf16": ("bfloat16", "bfloat16", False, None),
        "bf16-weights": ("bfloat16", "float32", False, None),
        "bf16-kv": ("float32", "bfloat16", False, None),
        "fp16-kv": ("float32", "float16", False, None),
        "fp8-kv": ("float32", "fp8_e4m3", False, None),
        "fp8e5m2-kv": ("float32", "fp8_e5m2", False, None),
        "fp32-eager": ("float32", "float32", True, None),
        "w8a8": ("float32", "float32", False, None),
        "w8a8-fp8kv": ("float32", "fp8_e4m3", False, None),
        **{f"bf16-{k}": ("bfloat16", "bfloat16", False, k) for k in ("widen", "amx", "dot")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--arms", default="fp32", help=f"comma-separated: {', '.join(ARMS)}")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",")]
    bad = [a for a in arms if a.split("@")[0].partition("~")[0] not in ARMS
           or "@" in a and not a.split("@")[1].isdigit()]
    if bad:
        ap.error(f"unknown arm {bad[0]!r} (known: {', '.join(ARMS)})")

    from llm_serving.config import kv_bytes_per_block
    from llm_serving.model_executor.cpu_graph import STEADY_STEPS
    from llm_serving.model_executor.tiny_model import arm_skip_layers
    model = model_path(args.model)

    probe_bw = ReadBandwidth()
    bw = float(np.median([probe_bw() for _ in range(5)]))   # the prefill's and the header's
    from llm_serving import LLM, SamplingParams
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    max_b = max(batches)
    n_prompts = max(1, args.prefill_tokens // ctx)
    seqs = max(max_b, n_prompts)    # else a partial run (--batches 1) prefills one prompt a step
    engines = {}
    # a size's decode steps before the timed ones: run, captured, verified, then replayed
    # (above --max-capture-batch, captured once it has run STEADY_STEPS steps in a row)
    warm_steps = 3 + STEADY_STEPS
    # each sequence's KV: its prompt, the warm-up steps, then two steps a round (see below)
    blocks_per_seq = (ctx + warm_steps + 2 * args.steps + 16) // 16 + 2
    for arm in arms:
        name, skip = arm_skip_layers(arm.split("@")[0], model)
        dtype, kv, eager, kernel = ARMS[name]
        bs = int(arm.split("@")[1]) if "@" in arm else 16
        with mock.patch.dict(os.environ, {"LLM_SERVING_GEMM_BF16": kernel} if kernel else {}):
            engines[arm] = LLM(w8a8_copy(model) if name in QUANTIZED_ARMS else model,
                               max_num_seqs=seqs, block_size=bs, dtype=dtype,
                               kv_cache_dtype=kv, kv_cache_dtype_skip_layers=skip,
                               enforce_eager=eager,
                               num_blocks=seqs * (blocks_per_seq * 16 // bs + 1),
                               max_num_batched_tokens=max(args.prefill_tokens, max_b)).engine
    eng = engines[arms[0]]
    mc = eng.model_config
    floor_ms, weight_bytes, kv_bytes_per_token = {}, {}, {}
    for arm, e in engines.items():
        kv_bytes_per_token[arm] = kv_bytes_per_block(mc, 1, 1, e.config.model.kv_layer_dtypes)
        # the bytes the weights take (bf16 linear weights: 2 per element)
        wb = sum(int(np.prod(p.shape)) * p.itemsize
                 for _, p in e.runner.model.parameters_and_names())
        if not mc.tie_word_embeddings:  # decode gathers embedding rows; it does not read them all
            wb -= 4 * mc.vocab_size * mc.hidden_size
        weight_bytes[arm] = wb
        floor_ms[arm] = wb / bw * 1e3

    def step(arm, e):
        e.step()
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10**6)

    rows = []
    # Prefill throughput: several prompts of the context length in one ragged step.
    pre = {arm: [] for arm in arms}
    with OtherLoad() as load:
        for rep in range(3):
            prompts = [rng.integers(3, mc.vocab_size, ctx).tolist() for _ in range(n_prompts)]
            for arm, e in engines.items():
                rids = [e.add_request({"prompt_token_ids": p}, greedy) for p in prompts]
                t = time.perf_counter()
                step(arm, e)
                pre[arm].append(time.perf_counter() - t)
                for r in rids:
                    e.abort_request(r)
    for arm in arms:
        dt = float(np.median(pre[arm]))
        rows.append((arm, "prefill", f"{n_prompts}x{ctx} tokens", f"{dt * 1e3:.1f} ms",
                     f"{n_prompts * ctx / dt:.0f} tok/s", "", "", "", "", f"{load.cores:.2f}",
                     ""))

    for b in batches:
        prompts = [rng.integers(3, mc.vocab_size, ctx).tolist() for _ in range(b)]
        rids = {}
        for arm, e in engines.items():
            rids[arm] = [e.add_request({"prompt_token_ids": p}, greedy) for p in prompts]
            while any(s.num_computed_tokens < len(s.prompt_token_ids)
                      for r in rids[arm] for s in e.requests[r].seqs):
                step(arm, e)
            for _ in range(warm_steps):
                step(arm, e)
        times = {arm: [] for arm in arms}
        gemms = {arm: GemmAlone(e, b) for arm, e in engines.items()}
        gemm_times = {arm: [] for arm in arms}
        bws = []
        with OtherLoad() as load:
            for _ in range(args.steps):
                # Steady decoding runs steps back to back, and a step right after the
                # bandwidth pass below was slower (~1 ms at B=1, docs/benchmarks.md): each
                # arm first runs one step untimed.
                for arm, e in engines.items():
                    step(arm, e)
                for arm, e in engines.items():     # interleaved: the same load for each arm
                    t = time.perf_counter()
                    step(arm, e)
                    times[arm].append(time.perf_counter() - t)
                    gemm_times[arm].append(gemms[arm]())
                bws.append(probe_bw())
        case_bw = float(np.median(bws))
        for arm, e in engines.items():
            step_ms = float(np.median(times[arm])) * 1e3   # median: robust to a busy neighbour
            gemm_ms = float(np.median(gemm_times[arm])) * 1e3
            # attention must read every K and V of the context once: its bandwidth floor, at
            # the timed steps' mean context (after the warm-up steps; two steps a round)
            kv_ms = (b * (ctx + warm_steps + args.steps) * kv_bytes_per_token[arm]
                     / case_bw * 1e3)
            floor = weight_bytes[arm] / case_bw * 1e3
            for r in rids[arm]:
                e.abort_request(r)
            rows.append((arm, f"decode B={b}", f"ctx~{ctx}", f"{step_ms:.1f} ms/step",
                         f"{b / step_ms * 1e3:.0f} tok/s",
                         f"{step_ms / floor:.2f}x {floor:.1f} ms" if b == 1 else "",
                         f"{gemm_ms:.1f} ms ({step_ms / gemm_ms:.2f}x)",
                         f"{kv_ms:.1f} ms", f"{step_ms - gemm_ms - kv_ms:.1f} ms",
                         f"{load.cores:.2f}", f"{case_bw / 1e9:.1f} GB/s"))

    print(f"# llm_serving model benchmark, {datetime.date.today()}, {platform.node()}, "
          f"{cpu_description()}")
    for arm in arms:
        print(f"model: {model}, {arm}: {weight_bytes[arm] / 1e6:.0f} MB of weights read per "
              f"decode step -> batch-1 floor {floor_ms[arm]:.1f} ms/step at the start's "
              "bandwidth")
    print(f"read bandwidth, all cores, at the start: {bw / 1e9:.1f} GB/s; bandwidth: each decode "
          "case's own (median of a pass after each round of its steps), which its floors use")
    print("GEMM alone: the kernel calls of the step's linear layers (every projection and the "
          "LM head) on the same rows, through the GEMM the plan chose for each shape, as a "
          "replayed step calls them, timed right after each step (ratio: step / GEMM alone)")
    print("KV floor: the K and V bytes a decode step's attention reads / the read bandwidth; "
          "rest: step - GEMM alone - KV floor (norms, RoPE, activations, sampling, Python, and "
          "attention above its floor)")
    print("other load: cores kept busy by other processes during the case (0 = quiet machine)")
    print()
    print(f"| {'arm':<12} | {'case':<14} | {'shape':<16} | {'time':<14} | {'throughput':<12} "
          f"| {'vs floor':<15} | {'GEMM alone':<18} | {'KV floor':<9} | {'rest':<9} "
          f"| other load | bandwidth  |")
    print(f"|{'-' * 14}|{'-' * 16}|{'-' * 18}|{'-' * 16}|{'-' * 14}|{'-' * 17}|{'-' * 20}"
          f"|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 12}|")
    rows.sort(key=lambda r: (r[1] != "prefill", int(r[1].split("=")[1]) if "=" in r[1] else 0))
    for r in rows:
        print(f"| {r[0]:<12} | {r[1]:<14} | {r[2]:<16} | {r[3]:<14} | {r[4]:<12} | {r[5]:<15} "
              f"| {r[6]:<18} | {r[7]:<9} | {r[8]:<9} | {r[9]:<10} | {r[10]:<10} |")
    if len(arms) > 1:
        base = arms[0]
        print(f"\ntime ratio to {base} (below 1: faster):")
        by = {(r[0], r[1]): float(r[3].split()[0]) for r in rows}
        for case in dict.fromkeys(r[1] for r in rows):
            print(f"  {case:<14} " + "  ".join(
                f"{arm} {by[(arm, case)] / by[(base, case)]:.2f}x" for arm in arms[1:]))

class GemmAlone:
    """Times what a decode step of ``b`` sequences spends in GEMMs alone: every linear layer
    of the model (the projections and the LM head, one row per sequence) on ``b`` rows of
    random input, through the implementation the GEMM plan chose for that shape (bf16 layers:
    their bf16 kernel), as the step calls it: the kernel calls are recorded once and then
    called as a replayed step calls them (cpu_graph), without the Python of the layers around
    them (~40 us a layer, which was a quarter of "GEMM alone" at B=1). Where a GEMM cannot be
    recorded (MindSpore's MatMul), the layers are called. Returns seconds per call."""

    def __init__(self, engine, b: int):
        from mindspore import Tensor
        from llm_serving.model_executor import cpu_graph
        from llm_serving.model_executor.layers.linear import VocabEmbedding
        model = engine.runner.model
        # the input embedding is gathered, not multiplied: of the vocabulary tables only the
        # LM head (which is the embedding when tied) runs a GEMM
        self.layers = [c for _, c in model.cells_and_names() if hasattr(c, "gemm_shape")
                       and (not isinstance(c, VocabEmbedding) or c is model.lm_head)]
        rng = np.random.default_rng(2)
        self.x = {k: Tensor(rng.standard_normal((b, k), dtype=np.float32))
                  for k in {layer.gemm_shape[1] for layer in self.layers}}
        self.impl = [("kernel" if getattr(layer, "bf16", False) or getattr(layer, "int8", False)
                      else layer._plan.choose(layer, b)) for layer in self.layers]
        self._layers()  # the plan's probe for b rows, if not yet done, is not recorded
        with cpu_graph._capturing() as self.recorded:  # holds the calls' output buffers too
            self._layers()
        if self.recorded.unsupported:
            self.recorded = None
        else:       # as a replay calls them
            self.calls = cpu_graph.Program(self.recorded.ops)

    def _layers(self):
        for layer, impl in zip(self.layers, self.impl):
            y = layer.gemm(impl, self.x[layer.gemm_shape[1]])
        (y[0] if isinstance(y, tuple) else y).asnumpy()

    def __call__(self) -> float:
        t = time.perf_counter()
        if self.recorded is None:
            self._layers()
        else:
            self.calls()
        return time.perf_counter() - t


if __name__ == "__main__":
    main()
