#!/usr/bin/env python
"""Multi-stream at TP=2 on this machine: step times of the 97 M bench model with and without
micro-batch overlap, and how much all-reduce time the overlap hides, in one run.

    python bench/bench_multistream.py [--batches 16,64,128] [--context 128] [--steps 6]
                                      [--rounds 3] [--prefill 4x512] [--cases ...]

Steps run synchronously (no async scheduling), so a step's time is its whole forward pass.
Cases (all two WorkAgents pinned to cores 0 and 1, loaded at once, measured in turns so a
busy spell on a shared machine hits every case alike):
- ``mccl``: MindSpore's collectives, multi-stream off (the previous default);
- ``shm``: the shared-memory all-reduce, multi-stream off;
- ``shm+seq``: multi-stream's micro-batch schedule, communication blocking (the reference);
- ``shm+ovl``: multi-stream overlapped (a communication thread).
Multi-stream cases split every step with two requests or more (thresholds at their minimum),
so the table shows what splitting costs or gains at each size.

Hidden: 1 - (time the compute thread waited for all-reduces) / (time the all-reduces took),
from the agents' per-phase timers (``LLM_SERVING_COMM_TIMERS``), rank 0, over the decode
steps. A blocking all-reduce hides nothing; the embedding's all-reduce always blocks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402

ALWAYS = dict(min_total_tokens=2, min_prefill_tokens=0, max_imbalance=1.0)
CASES = {
    "mccl": dict(cpu_allreduce="mccl"),
    "shm": dict(cpu_allreduce="shm"),
    "shm+seq": dict(cpu_allreduce="shm", enable_multi_stream=True,
                    multi_stream=dict(ALWAYS, overlap="sequential")),
    "shm+ovl": dict(cpu_allreduce="shm", enable_multi_stream=True,
                    multi_stream=dict(ALWAYS, overlap="overlapped")),
}


class Case:
    def __init__(self, name: str, model: str, max_b: int, max_len: int, budget: int,
                 num_blocks: int):
        from llm_serving import LLM
        self.name = name
        self.timer_dir = tempfile.mkdtemp(prefix=f"ms-{name.replace('+', '-')}-")
        os.environ["LLM_SERVING_COMM_TIMERS"] = self.timer_dir     # read by the agents
        try:
            self.llm = LLM(model, max_num_seqs=max_b, block_size=16, max_model_len=max_len,
                           num_blocks=num_blocks,
                           max_num_batched_tokens=budget, tensor_parallel_size=2,
                           cpu_affinity="0|1", async_scheduling=False, **CASES[name])
        finally:
            del os.environ["LLM_SERVING_COMM_TIMERS"]
        self.times: dict = {}
        self.hidden: dict = {}

    def timers(self) -> dict:
        path = os.path.join(self.timer_dir, "rank0.json")
        if not os.path.exists(path):            # no step has run yet
            return {"comm_s": 0.0, "wait_s": 0.0, "steps": 0}
        with open(path) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", default="4x512", help="prompts x tokens in one step")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="step-time cases (empty: skip the step table)")
    ap.add_argument("--served", type=int, default=200, metavar="N",
                    help="also serve W1's first N prompts all at once through start.py at "
                         "TP=2 (shm all-reduce, agents on cores 0 and 1), multi-stream off "
                         "and on with its default thresholds (0: skip)")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the servers this started are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from llm_serving import SamplingParams
    model = model_path(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    n_pre, pre_len = (int(x) for x in args.prefill.split("x"))
    ctx = args.context
    max_len = max(ctx, pre_len) + args.rounds * (args.steps + 5) + 64
    budget = max(n_pre * pre_len, max(batches))
    if not args.cases:
        served_w1(model, args.served)
        return
    # the pool the cases need (committed at start, per case and rank: four cases sized for
    # max_len each ran a 24 GiB machine out of memory): the decode batch at its context, and
    # the prefill's prompts at their length
    decode_len = ctx + args.rounds * (args.steps + 5) + 64
    num_blocks = max(batches) * (decode_len // 16 + 1) + n_pre * (max_len // 16 + 1) + 16
    cases = [Case(c, model, max(max(batches), n_pre), max_len, budget, num_blocks)
             for c in args.cases.split(",")]
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10**6)

    def add(eng, n, length):
        vocab = eng.model_config.vocab_size
        return [eng.add_request({"prompt_token_ids": rng.integers(3, vocab, length).tolist()},
                                greedy) for _ in range(n)]

    def measure(c, kind, steps):
        before = c.timers()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            c.llm.engine.step()
            times.append(time.perf_counter() - t)
        after = c.timers()
        comm = after["comm_s"] - before["comm_s"]
        wait = after["wait_s"] - before["wait_s"]
        c.times.setdefault(kind, []).append(float(np.median(times)))
        c.hidden.setdefault(kind, []).append((comm, wait))

    for _ in range(args.rounds):                   # prefill: n_pre prompts in one step
        for c in cases:
            eng = c.llm.engine
            rids = add(eng, n_pre, pre_len)
            measure(c, "prefill", 1)
            for r in rids:
                eng.abort_request(r)
            while eng.has_unfinished_requests():
                eng.step()
    for b in batches:
        live = {}
        for c in cases:
            eng = c.llm.engine
            live[c.name] = rids = add(eng, b, ctx)
            while any(s.num_computed_tokens < len(s.prompt_token_ids)
                      for r in rids for s in eng.requests[r].seqs):
                eng.step()
            for _ in range(2):
                eng.step()
        for _ in range(args.rounds):
            for c in cases:
                measure(c, b, args.steps)
        for c in cases:
            for r in live[c.name]:
                c.llm.engine.abort_request(r)
            while c.llm.engine.has_unfinished_requests():
                c.llm.engine.step()
    splits = {c.name: c.llm.engine.get_stats().multistream_steps for c in cases}
    for c in cases:
        c.llm.engine.shutdown()

    base = cases[0]
    print(f"# multi-stream at TP=2, {datetime.date.today()}, {cpu_description()}, "
          f"{os.cpu_count()} cores; agents pinned to cores 0 and 1")
    print(f"model: {model}; decode at context ~{ctx}; prefill: {n_pre}x{pre_len} tokens in "
          f"one step; median over {args.rounds} rounds in turns (decode: median of "
          f"{args.steps} steps per round)")
    print(f"ratio: time of '{base.name}' / time of the case (> 1 = faster); hidden: share "
          "of all-reduce time not waited for (rank 0)\n")
    print("| step | " + " | ".join(f"{c.name} ms | ratio | comm ms/step | hidden"
                                    for c in cases) + " |")
    print("|---|" + "---|---|---|---|" * len(cases))
    for kind in ["prefill"] + batches:
        row = ["prefill" if kind == "prefill" else f"decode B={kind}"]
        ref = float(np.median(base.times[kind]))
        steps = 1 if kind == "prefill" else args.steps
        for c in cases:
            dt = float(np.median(c.times[kind]))
            comm = sum(x for x, _ in c.hidden[kind])
            wait = sum(y for _, y in c.hidden[kind])
            hidden = 1 - wait / comm if comm > 0 else 0.0
            per_step = comm / (steps * len(c.hidden[kind])) * 1e3
            row += [f"{dt * 1e3:.1f}", f"{ref / dt:.2f}", f"{per_step:.1f}", f"{hidden:.0%}"]
        print("| " + " | ".join(row) + " |")
    print(f"\nsteps by split outcome: {splits}")
    if args.served:
        served_w1(model, args.served)


def served_w1(model: str, num_prompts: int) -> None:
    """W1 through the real server at TP=2, multi-stream off, on with its defaults, and on
    with decode steps kept whole (min_total_tokens 512), one server at a time."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_w1_served import ours, w1_client
    base = ["--tensor-parallel-size", "2", "--cpu-affinity", "0|1", "--cpu-allreduce", "shm"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("off", base), ("on", base + ["--enable-multi-stream"]),
                            ("on, min_total_tokens 512",
                             base + ["--enable-multi-stream", "--multi-stream",
                                     '{"min_total_tokens": 512}'])):
            with ours(model, extra, os.path.join(tmp, f"{name}.log")) as srv:
                rows[name] = w1_client(srv.url, model, "inf",
                                       Path(tmp) / f"w1-{name}.json", num_prompts)
                with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
                    rows[name]["split"] = sum(
                        float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                        if line.startswith("llm_serving:multistream_steps_total")
                        and 'outcome="split"' in line)
    print(f"\n# served W1 ({num_prompts} prompts, all at once), TP=2 shm, "
          f"load (1-min) at the end {os.getloadavg()[0]:.1f}\n")
    print("| multi-stream | output tok/s | ratio | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
          "split steps | failed |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['toks']:.1f} | {r['toks'] / rows['off']['toks']:.2f} | "
              f"{r['ttft']:.0f} / {r['ttft99']:.0f} | {r['tpot']:.1f} / {r['tpot99']:.1f} | "
              f"{r['split']:.0f} | {r['failed']} |")


if __name__ == "__main__":
    main()
