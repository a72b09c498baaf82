#!/usr/bin/env python
"""Decode speed with and without n-gram speculative decoding, on a repetitive workload.

Workload: prompts that quote a passage twice (alpaca instruction + input + reference output,
then the same again, as a RAG answer quoting its context would), greedy, ignore_eos, a fixed
output length. Each batch size runs the whole set through ``LLM.generate`` without drafts and
with ``speculative_config`` (method ngram); the table gives output tokens per second, the
ratio, the drafts' acceptance and the tokens a sequence gained per step. Outputs are checked
identical.

    python bench/bench_spec_decode.py [--model bench] [--num-prompts 16] [--max-output 128]
        [--batch-sizes 1,16] [--k 4] [--lookup 3,2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "clients" / "data" / "alpaca_5010.json"


def prompts_of(num: int) -> list[str]:
    rows = json.loads(DATA.read_text())[:num]
    out = []
    for r in rows:
        passage = f"{r['instruction']} {r['input']} {r['output']}"[:1200]
        out.append(f"Context: {passage}\nQuote the context: {passage}\nAgain: ")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", default="3,2", help="prompt_lookup_max,prompt_lookup_min")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each, alternated; the table gives the median")
    args = ap.parse_args()

    from llm_serving import LLM, SamplingParams
    from llm_serving.cpu_info import cpu_description
    model = model_path(args.model)
    hi, lo = (int(x) for x in args.lookup.split(","))
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": hi,
            "prompt_lookup_min": lo}
    print(f"# n-gram speculative decoding, {datetime.date.today()}, {platform.node()}, "
          f"{cpu_description()}")
    print(f"model: {model}; {args.num_prompts} prompts, {args.max_output} tokens each, "
          f"greedy; speculative_config {json.dumps(spec)}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_output, ignore_eos=True)
    prompts = prompts_of(args.num_prompts)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        llms = {name: LLM(model, max_num_seqs=b, kv_cache_space=2, **extra)
                for name, extra in (("off", {}), ("ngram", {"speculative_config": spec}))}
        for llm in llms.values():
            llm.generate(prompts[:1], SamplingParams(max_tokens=4))       # warm
        result = {name: ([], [], 0, 0, 0) for name in llms}
        for _ in range(args.rounds):        # alternated: a shared machine's load hits both
            for name, llm in llms.items():
                before = llm.engine.get_stats()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t0
                st = llm.engine.get_stats()
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                ids, rates, drafts, accepted, steps = result[name]
                result[name] = (
                    [o.outputs[0].token_ids for o in outs], rates + [tokens / dt],
                    st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                    st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                    st.num_steps - before.num_steps)
        del llms
        same = result["off"][0] == result["ngram"][0]
        off, on = statistics.median(result["off"][1]), statistics.median(result["ngram"][1])
        _, _, drafts, accepted, steps = result["ngram"]
        rows.append((f"max_num_seqs={b}", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x",
                     f"{accepted}/{drafts}" + (f" ({accepted / drafts:.0%})" if drafts else ""),
                     f"{result['off'][4]} -> {steps}", "yes" if same else "NO"))
    head = ("batch", "tok/s off", "tok/s ngram", "ratio", "accepted/drafted",
            "steps off -> ngram", "same output")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
