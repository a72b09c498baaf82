#!/usr/bin/env python
"""The master -> WorkAgent hop: engine step time with the model in-process ("uni") against
the model in a WorkAgent process fed through shared memory ("mp"), same model, same batch,
measured in one run.

    python bench/bench_agent_hop.py [--batch-sizes 1,16,64] [--tokens 32] [--model DIR]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time


def step_time(llm, batch: int, tokens: int) -> float:
    from llm_serving import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    steps0 = llm.engine.stats.num_steps
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - t0) / (llm.engine.stats.num_steps - steps0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the 97M bench model)")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from llm_serving import LLM
    from llm_serving.tiny_model import ensure_tiny_model
    model = args.model or ensure_tiny_model(preset="bench")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    res = {}
    for backend in ("uni", "mp"):
        llm = LLM(model, max_num_seqs=max(batches), num_blocks=4096,
                  distributed_executor_backend=backend)
        for b in batches:
            res[backend, b] = step_time(llm, b, args.tokens)
        llm.engine.shutdown()
        del llm
    print(f"# master -> WorkAgent hop, {datetime.date.today()}, {platform.node()}, "
          f"{os.cpu_count()} cores\nmodel: {model}\n")
    print("| batch | in-process step | via WorkAgent step | hop cost | overhead |")
    print("|---|---|---|---|---|")
    for b in batches:
        uni, mp = res["uni", b], res["mp", b]
        print(f"| {b} | {uni * 1e3:.2f} ms | {mp * 1e3:.2f} ms | {(mp - uni) * 1e3:.2f} ms | "
              f"{mp / uni - 1:+.1%} |")


if __name__ == "__main__":
    main()
