#!/usr/bin/env python
"""Tensor parallelism on this machine: the 97 M bench model in 1 WorkAgent against 2 agents
(tensor_parallel_size=2, mccl collectives), pinned one core each and unpinned, in one run.
Decode step time at several batch sizes (context ~--context tokens) and one prefill step,
and each case's ratio to the first case.

    python bench/bench_tp.py [--batches 1,16,64] [--context 256] [--steps 10] [--rounds 5]
                             [--cases 1,1@0,2@0|1,2] [--model DIR]

A case is "<agents>[@<cpu_affinity>]": "1" one unpinned agent, "1@0" one agent on core 0,
"2@0|1" two agents on cores 0 and 1, "2" two unpinned agents. All cases are loaded at once
and measured in turns (--rounds rounds of --steps steps each, median step of each round,
median over rounds), so that a busy spell on a shared machine hits every case alike.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

import numpy as np

from bench_model import OtherLoad
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402


class Case:
    def __init__(self, spec: str, model: str, max_b: int, max_len: int, prefill: int):
        from llm_serving import LLM
        n, _, aff = spec.partition("@")
        self.spec, self.tp, self.affinity = spec, int(n), aff or None
        agents = f"{n} agent{'s' if self.tp > 1 else ''}"
        self.label = (f"{agents}, cores {aff.replace('|', ' / ')}" if aff
                      else f"{agents}, unpinned")
        t0 = time.perf_counter()
        self.llm = LLM(model, max_num_seqs=max_b, block_size=16, max_model_len=max_len,
                       num_blocks=max_b * (max_len // 16 + 1) + 16,
                       max_num_batched_tokens=max(prefill, max_b),
                       tensor_parallel_size=self.tp, cpu_affinity=self.affinity,
                       distributed_executor_backend="mp")
        self.start_s = time.perf_counter() - t0
        runner = self.llm.engine.runner
        self.pids = [p.pid for p in runner.procs] + (
            [runner.scheduler_proc.pid] if runner.scheduler_proc is not None else [])
        self.times: dict = {}      # step kind -> [median of each round]
        self.load: dict = {}       # step kind -> [other load of each round]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--cases", default="1,1@0,2@0|1,2")
    args = ap.parse_args()
    from llm_serving import SamplingParams
    model = model_path(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    n_prompts = max(1, args.prefill_tokens // ctx)
    max_len = ctx + args.rounds * (args.steps + 5) + 64
    cases = [Case(s, model, max(max(batches), n_prompts), max_len, args.prefill_tokens)
             for s in args.cases.split(",")]
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10**6)

    def add(eng, n):
        vocab = eng.model_config.vocab_size
        return [eng.add_request({"prompt_token_ids": rng.integers(3, vocab, ctx).tolist()},
                                greedy) for _ in range(n)]

    def record(case, kind, times, load):
        case.times.setdefault(kind, []).append(float(np.median(times)))
        case.load.setdefault(kind, []).append(load.cores)

    for _ in range(args.rounds):                  # prefill: one step of n_prompts prompts
        for c in cases:
            eng = c.llm.engine
            rids = add(eng, n_prompts)
            with OtherLoad(c.pids) as load:
                t = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t
            record(c, "prefill", [dt], load)
            for r in rids:
                eng.abort_request(r)
    for b in batches:
        live = {}
        for c in cases:                           # b sequences decoding in every case
            eng = c.llm.engine
            live[c.spec] = rids = add(eng, b)
            while any(s.num_computed_tokens < len(s.prompt_token_ids)
                      for r in rids for s in eng.requests[r].seqs):
                eng.step()
            for _ in range(3):
                eng.step()
        for _ in range(args.rounds):
            for c in cases:
                eng, times = c.llm.engine, []
                with OtherLoad(c.pids) as load:
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        eng.step()
                        times.append(time.perf_counter() - t)
                record(c, b, times, load)
        for c in cases:
            for r in live[c.spec]:
                c.llm.engine.abort_request(r)
    for c in cases:
        c.llm.engine.shutdown()

    base = cases[0]
    print(f"# tensor parallelism, {datetime.date.today()}, {platform.node()}, "
          f"{cpu_description()}")
    print(f"model: {model}; decode at context ~{ctx}; prefill: {n_prompts}x{ctx} tokens in "
          f"one step; median over {args.rounds} rounds taken in turns across the cases "
          f"(decode: median of {args.steps} steps in each round)")
    print("other load: cores kept busy by other processes during the case (0 = quiet machine)")
    print(f"ratio: time of '{base.label}' / time of the case (> 1 = faster)\n")
    print("| case | start | step | time | tok/s | ratio | other load |")
    print("|---|---|---|---|---|---|---|")
    for c in cases:
        for i, kind in enumerate(["prefill"] + batches):
            dt = float(np.median(c.times[kind]))
            tokens = n_prompts * ctx if kind == "prefill" else kind
            step = "prefill" if kind == "prefill" else f"decode B={kind}"
            ratio = float(np.median(base.times[kind])) / dt
            first = i == 0
            start = f"{c.start_s:.1f} s" if first else ""
            print(f"| {c.label if first else ''} | {start} | {step} | {dt * 1e3:.1f} ms "
                  f"| {tokens / dt:.0f} | {ratio:.2f} | {max(c.load[kind]):.2f} |")


if __name__ == "__main__":
    main()
