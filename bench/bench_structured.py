#!/usr/bin/env python
"""Structured outputs: what a grammar costs per decode step, with every request constrained,
under async scheduling (the server's default) and synchronous scheduling.

Two engines on the 97 M bench model (vocab 8000), each with its model in a WorkAgent as the
server runs it: one with async scheduling, one without. For each batch size B, B requests
decode for ``--steps`` steps, unconstrained and then each under a JSON schema (a list of 48
integers, so that every row stays constrained throughout), in turns on the same engines,
``--rounds`` times interleaved. Printed per decode step (medians over all the rounds' steps):
- the step's wall time (the engine's step period), plain and constrained, and the overhead;
- grammar (master): advancing each row's matcher over its new token and filling its bitmask
  row (``Constraints.apply`` and ``deferred_bitmask``). Under async scheduling it runs while
  the step's forward runs (the mask is sent after the forward starts and waited for before
  sampling), so it costs the step only where it is longer than the forward; synchronously it
  adds to the step;
- mask sent after (async): from the end of step N (its result collected) to step N+1's mask
  sent (step N processed, matchers advanced, bitmask filled). Step N+1's forward started when
  step N ended, so while this is shorter than a forward, the agent never waits for a mask.

    python bench/bench_structured.py [--batches 1,16,64] [--steps 12] [--rounds 3]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402


class Timer:
    """Accumulates the time spent in some methods, per engine step."""

    def __init__(self, cls, *names: str):
        self.cls, self.orig = cls, {n: getattr(cls, n) for n in names}
        self.total = 0.0
        for name, orig in self.orig.items():
            setattr(cls, name, self._wrap(orig))

    def _wrap(self, orig):
        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
        return wrapped

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t

    def restore(self) -> None:
        for name, orig in self.orig.items():
            setattr(self.cls, name, orig)


def run(llm, b: int, steps: int, constrained: bool) -> list[tuple[float, float, float]]:
    """(step ms, grammar ms, mask ms) of each decode step of B requests; mask: from the
    previous step's end (collected) to this step's mask sent (0 when sent with the step)."""
    from llm_serving import SamplingParams
    from llm_serving.engine.constraints import Constraints
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": 48, "maxItems": 48}
    so = {"json": schema} if constrained else None
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(32)]},
                              SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                                             ignore_eos=True, structured_outputs=so))
           for i in range(b)]
    timer = Timer(Constraints, "apply", "deferred_bitmask")
    marks = {}                         # when the last step was collected / its mask sent
    runner = engine.runner
    collect, send_mask = runner.collect, runner.send_mask
    runner.collect = lambda: (collect(), marks.__setitem__("done", time.perf_counter()))[0]
    runner.send_mask = lambda m: (send_mask(m), marks.__setitem__("mask", time.perf_counter()))[0]
    times = []
    try:
        for _ in range(steps + 3):       # the prefill, the first decodes, then the measured
            marks.clear()
            t = time.perf_counter()
            engine.step()
            late = marks["mask"] - marks["done"] if "mask" in marks else 0.0
            times.append((time.perf_counter() - t, timer.take(), late))
    finally:
        timer.restore()
        del runner.collect, runner.send_mask
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return [(t * 1e3, g * 1e3, m * 1e3) for t, g, m in times[3:]]


def median(samples, k: int) -> float:
    return statistics.median(s[k] for s in samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=12, help="decode steps measured per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each kind, interleaved")
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    args = ap.parse_args()
    from llm_serving import LLM
    model = model_path(args.model)
    batches = [int(x) for x in args.batches.split(",")]
    engines = {mode: LLM(model, max_num_seqs=max(batches), distributed_executor_backend="mp",
                         async_scheduling=mode == "async") for mode in ("async", "sync")}
    try:
        for llm in engines.values():
            run(llm, 2, 4, True)            # warm up: kernels, llguidance's tokenizer
        print(f"# bench_structured, {datetime.date.today()}, {cpu_description()}, "
              f"load {os.getloadavg()[0]:.1f}")
        print("| B | scheduling | decode step, plain | constrained | overhead "
              "| grammar (master) | grammar vs plain step | mask sent after |")
        print("|---|---|---|---|---|---|---|---|")
        for b in batches:
            got = {(mode, c): [] for mode in engines for c in (False, True)}
            for _ in range(args.rounds):      # interleaved: a shared machine's load drifts
                for mode, llm in engines.items():
                    for c in (False, True):
                        got[mode, c] += run(llm, b, args.steps, c)
            for mode in engines:
                plain, cons = median(got[mode, False], 0), median(got[mode, True], 0)
                grammar, late = median(got[mode, True], 1), median(got[mode, True], 2)
                print(f"| {b} | {mode} | {plain:.1f} ms | {cons:.1f} ms | "
                      f"{cons / plain - 1:+.1%} | {grammar:.2f} ms | {grammar / plain:.1%} | "
                      + (f"{late:.1f} ms |" if mode == "async" else "- |"), flush=True)
    finally:
        for llm in engines.values():
            llm.engine.shutdown()


if __name__ == "__main__":
    main()
