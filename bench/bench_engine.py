#!/usr/bin/env python
"""Offline engine throughput on W1, and the prefix-caching speedup, on the 97 M model.

W1: the first 200 prompts of alpaca_5010.json, prompt = instruction + ":" + input, output
length = the reference output's token count capped at 256, ignore_eos, greedy. Each
max_num_seqs runs the whole set through ``LLM.generate``; the table gives throughput and the
ratio to max_num_seqs=1 measured in the same run.

Shared prefix: prompts made of one long shared preamble plus a short question, run with
prefix caching off and on; the table gives the time, prefill tokens computed and the
speedup.

    python bench/bench_engine.py [--num-prompts 200] [--batch-sizes 1,16,64,128]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "clients" / "data" / "alpaca_5010.json"


def w1(tokenizer, num_prompts: int, max_output: int):
    rows = json.loads(DATA.read_text())[:num_prompts]
    prompts = [r["instruction"] + ":" + r["input"] for r in rows]
    lens = [max(1, min(max_output, len(tokenizer.encode(r["output"], add_special_tokens=False))))
            for r in rows]
    return prompts, lens


def run(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    stats = llm.engine.get_stats()
    return outs, dt, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,16,64,128")
    ap.add_argument("--kv-cache-space", type=float, default=4.0, help="GiB")
    ap.add_argument("--prefix-prompts", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=400,
                    help="words in the shared preamble of the prefix-caching case")
    args = ap.parse_args()

    from llm_serving import LLM, SamplingParams
    model = model_path(args.model)

    from llm_serving.cpu_info import cpu_description
    print(f"# llm_serving engine benchmark, {datetime.date.today()}, {platform.node()}, "
          f"{cpu_description()}")
    print(f"model: {model}")
    rows = []
    base_tps = None
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        llm = LLM(model, max_num_seqs=b, kv_cache_space=args.kv_cache_space)
        prompts, lens = w1(llm.get_tokenizer(), args.num_prompts, args.max_output)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        outs, dt, stats = run(llm, prompts, params)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        tps = n_out / dt
        base_tps = base_tps or tps
        rows.append((f"max_num_seqs={b}", f"{dt:.1f} s", f"{len(outs) / dt:.2f}",
                     f"{tps:.1f}", f"{(n_in + n_out) / dt:.1f}", f"{tps / base_tps:.2f}x",
                     str(stats.num_preemptions)))
        print(f"  done max_num_seqs={b}: {dt:.1f} s", flush=True)
        del llm
    print(f"\nW1: {args.num_prompts} alpaca prompts, {sum(lens)} output tokens "
          f"(reference lengths capped at {args.max_output}), greedy, ignore_eos\n")
    head = ("case", "time", "req/s", "output tok/s", "total tok/s", "vs max_num_seqs=1",
            "preemptions")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")

    # Shared prefix: one long preamble, then a short distinct question each.
    rows_data = json.loads(DATA.read_text())
    preamble = " ".join(" ".join(r["output"] for r in rows_data[1000:1100]).split()
                        [:args.prefix_words])
    prompts = [preamble + "\n\nQuestion: " + r["instruction"]
               for r in rows_data[:args.prefix_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    res = {}
    for caching in (False, True):
        llm = LLM(model, max_num_seqs=64, kv_cache_space=args.kv_cache_space,
                  enable_prefix_caching=caching)
        llm.generate(prompts[:1], params)            # the first request fills the cache
        outs, dt, stats = run(llm, prompts[1:], params)
        res[caching] = (dt, stats, [o.outputs[0].token_ids for o in outs])
        del llm
    assert res[True][2] == res[False][2], "prefix caching changed the outputs"
    off, on = res[False], res[True]
    print(f"\nShared prefix: {len(prompts) - 1} prompts after a warm-up one, each a "
          f"{args.prefix_words}-word shared preamble plus a question, 16 output tokens\n")
    print("| prefix caching | time | prefill tokens computed | hit rate | speedup |")
    print("|---|---|---|---|---|")
    print(f"| off | {off[0]:.2f} s | {off[1].num_prefill_tokens} | - | 1.00x |")
    print(f"| on | {on[0]:.2f} s | {on[1].num_prefill_tokens} | "
          f"{on[1].prefix_cache_hit_rate:.0%} | {off[0] / on[0]:.2f}x |")


if __name__ == "__main__":
    main()
