#!/usr/bin/env python
"""Structured outputs: what a grammar costs per decode step, with every request constrained.

For each batch size B, B requests decode on the 97 M bench model (vocab 8000, in-process
runner) twice: unconstrained, then each under a JSON schema (a list of 48 integers, so that
every row stays constrained for the whole run). Printed per decode step (medians of the
decode phase):
- the step's wall time, plain and constrained;
- grammar (master): advancing each row's matcher over its new token and filling its bitmask
  row (``Constraints.apply``);
- mask (sampler): the extra time the sampler spends with bitmasks (unpacking and applying
  them), as the difference of its time per step in the two runs;
- both, as a share of the plain decode step (the issue's target: < 10% at B = 64).

Not included: under async scheduling (the server) a grammar row's mask needs the previous
step's token, so the master's work is not hidden behind the model's (see docs/openai.md).

    python bench/bench_structured.py [--batches 1,16,64] [--tokens 48]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time


def _cpu() -> str:
    name, flags = platform.processor(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(have) or 'no avx2'})"


class Timer:
    """Accumulates the time spent in one method, per engine step."""

    def __init__(self, cls, name: str):
        self.cls, self.name, self.orig = cls, name, getattr(cls, name)
        self.total = 0.0
        timer = self

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return timer.orig(*a, **kw)
            finally:
                timer.total += time.perf_counter() - t
        setattr(cls, name, wrapped)

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t

    def restore(self) -> None:
        setattr(self.cls, self.name, self.orig)


def run(llm, b: int, tokens: int, constrained: bool):
    from llm_serving import SamplingParams
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": tokens, "maxItems": tokens}
    so = {"json": schema} if constrained else None
    engine = llm.engine
    for i in range(b):
        engine.add_request({"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(32)]},
                           SamplingParams(temperature=1.0, seed=i, max_tokens=4 * tokens,
                                          ignore_eos=not constrained, structured_outputs=so))
    from llm_serving.engine.constraints import Constraints
    from llm_serving.sample.sampler import Sampler
    t_apply, t_sample = Timer(Constraints, "apply"), Timer(Sampler, "__call__")
    steps = []
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t, t_apply.take(), t_sample.take()))
    finally:
        t_apply.restore()
        t_sample.restore()
    # Decode steps with the whole batch: after the prefill, before any request ends.
    decode = steps[2:max(3, len(steps) // 2)]
    return tuple(statistics.median(s[k] for s in decode) * 1e3 for k in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=48, help="integers in each output")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from llm_serving import LLM
    from llm_serving.model_executor.tiny_model import ensure_tiny_model
    model = args.model or ensure_tiny_model(preset="bench")
    batches = [int(x) for x in args.batches.split(",")]
    llm = LLM(model, max_num_seqs=max(batches), distributed_executor_backend="uni")
    run(llm, 2, 4, True)                 # warm up: kernels, llguidance's tokenizer
    print(f"# bench_structured, {datetime.date.today()}, {_cpu()}")
    print("| B | decode step, plain | constrained | grammar (master) | mask (sampler) "
          "| grammar + mask vs plain step |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        plain = run(llm, b, args.tokens, False)
        cons = run(llm, b, args.tokens, True)
        mask = max(cons[2] - plain[2], 0.0)
        share = (cons[1] + mask) / plain[0]
        print(f"| {b} | {plain[0]:.1f} ms | {cons[0]:.1f} ms | {cons[1]:.2f} ms | "
              f"{mask:.2f} ms | {share:.1%} |")


if __name__ == "__main__":
    main()
