#!/usr/bin/env python
"""Model benchmark on the 97 M random Llama (hidden 768, 12 layers, 12 heads, FFN 2048,
vocab 8000, fp32): decode step time (median over --steps steps) at several batch sizes and
prefill throughput (median of 3), against the memory-bandwidth floor measured in the same run
(weight bytes / read bandwidth with every core reading).

    python bench/bench_model.py [--batches 1,16,64,128] [--context 256] [--steps 20]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np
from llm_serving.cpu_info import cpu_description  # noqa: E402


def read_bandwidth(n_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of a streaming read of a 1 GiB buffer with all cores (OpenMP, C++)."""
    import ctypes
    from pathlib import Path
    from llm_serving.model_executor.cpp_build import load_cpp_library
    # -fopenmp: without it the pragma is ignored and this measures one core (about half).
    lib = load_cpp_library(str(Path(__file__).with_name("read_bandwidth.cpp")), ("-fopenmp",))
    lib.sum_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.sum_f32.restype = ctypes.c_double
    a = np.ones(n_bytes // 4, np.float32)
    lib.sum_f32(a.ctypes.data, a.size)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        lib.sum_f32(a.ctypes.data, a.size)
        best = max(best, n_bytes / (time.perf_counter() - t))
    return best


def _busy_seconds(pids=()) -> tuple[float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds used by this process and by the
    processes ``pids``) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v) - v[3] - v[4]                      # minus idle and iowait
    own = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            own += (int(fields[11]) + int(fields[12])) / tick    # utime, stime
        except OSError:
            pass
    return busy / tick, own


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model dir (default: generate the 97M model)")
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    args = ap.parse_args()

    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    model = args.model
    if model is None:
        home = os.environ.get("LLM_SERVING_HOME", os.path.expanduser("~/.cache/llm_serving"))
        model = os.path.join(home, "models", "bench-97m")
        if not os.path.exists(os.path.join(model, "config.json")):
            make_tiny_model(model, **PRESETS["bench"])

    bw = read_bandwidth()
    from llm_serving import LLM, SamplingParams
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    max_b = max(batches)
    n_prompts = max(1, args.prefill_tokens // ctx)
    seqs = max(max_b, n_prompts)    # else a partial run (--batches 1) prefills one prompt a step
    llm = LLM(model, max_num_seqs=seqs, block_size=16,
              num_blocks=seqs * ((ctx + args.steps + 20) // 16 + 2),
              max_num_batched_tokens=max(args.prefill_tokens, max_b))
    eng = llm.engine
    mc = eng.model_config
    weight_bytes = 4 * sum(int(np.prod(p.shape)) for _, p in eng.runner.model.parameters_and_names())
    if not mc.tie_word_embeddings:     # decode gathers embedding rows; it does not read them all
        weight_bytes -= 4 * mc.vocab_size * mc.hidden_size
    floor_ms = weight_bytes / bw * 1e3
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10**6)

    rows = []
    # Prefill throughput: several prompts of the context length in one ragged step.
    pre = []
    with OtherLoad() as load:
        for rep in range(3):
            rids = [eng.add_request(
                {"prompt_token_ids": rng.integers(3, mc.vocab_size, ctx).tolist()}, greedy)
                for _ in range(n_prompts)]
            t = time.perf_counter()
            eng.step()
            pre.append(time.perf_counter() - t)
            for r in rids:
                eng.abort_request(r)
    dt = float(np.median(pre))
    rows.append(("prefill", f"{n_prompts}x{ctx} tokens", f"{dt * 1e3:.1f} ms",
                 f"{n_prompts * ctx / dt:.0f} tok/s", "", f"{load.cores:.2f}"))

    for b in batches:
        rids = [eng.add_request({"prompt_token_ids": rng.integers(3, mc.vocab_size, ctx).tolist()},
                                greedy) for _ in range(b)]
        while any(s.num_computed_tokens < len(s.prompt_token_ids)
                  for r in rids for s in eng.requests[r].seqs):
            eng.step()
        for _ in range(3):
            eng.step()
        times = []
        with OtherLoad() as load:
            for _ in range(args.steps):
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
        step_ms = float(np.median(times)) * 1e3   # median: robust to a busy neighbour
        for r in rids:
            eng.abort_request(r)
        rows.append((f"decode B={b}", f"ctx~{ctx}", f"{step_ms:.1f} ms/step",
                     f"{b / step_ms * 1e3:.0f} tok/s",
                     f"{step_ms / floor_ms:.2f}x floor" if b == 1 else "", f"{load.cores:.2f}"))

    print(f"# llm_serving model benchmark, {datetime.date.today()}, {platform.node()}, "
          f"{cpu_description()}")
    print(f"model: {model} ({weight_bytes / 1e6:.0f} MB of weights read per decode step)")
    print(f"read bandwidth, all cores: {bw / 1e9:.1f} GB/s -> batch-1 floor {floor_ms:.1f} ms/step")
    print("other load: cores kept busy by other processes during the case (0 = quiet machine)")
    print()
    print(f"| {'case':<14} | {'shape':<16} | {'time':<14} | {'throughput':<12} | {'vs floor':<11} "
          f"| other load |")
    print(f"|{'-' * 16}|{'-' * 18}|{'-' * 16}|{'-' * 14}|{'-' * 13}|{'-' * 12}|")
    for r in rows:
        print(f"| {r[0]:<14} | {r[1]:<16} | {r[2]:<14} | {r[3]:<12} | {r[4]:<11} | {r[5]:<10} |")

if __name__ == "__main__":
    main()
