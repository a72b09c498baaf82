#!/usr/bin/env python
"""Accuracy cost of lower precision: bf16 weights, a bf16 or fp16 KV cache, and bf16 both,
against fp32, with the logits harness (``--dump-logits``) on the bundled 521 alpaca prompts.

    python bench/bench_accuracy.py [--models tiny,bench] [--num-prompts 521] [--max-tokens 32]

Every arm generates greedily (ignore_eos) from the same prompts and dumps the logits at output
positions 0, every, 2*every, ...; each dump pairs with fp32's by file name
(``clients/compare_logits.py``'s pairing). Printed per model and arm:
- prefill logits (position 0, the same input in every arm): max |diff|, the mean over prompts
  of each prompt's max |diff|, and how many prompts stay within the contest's 5e-3;
- later positions, only where the arm's tokens so far equal fp32's (the same context): max
  |diff| and how many within 5e-3;
- greedy agreement: prompts whose whole output equals fp32's, and the mean share of each
  output that matches fp32's before the first different token.

The ``w8a8`` arm serves the model's W8A8 int8 checkpoint (``python -m llm_serving.quantize``:
int8 weights per output channel, activations per token), made once under the home directory.
An arm followed by ``~`` and layers (``fp8 KV~first+last``, ``fp8 KV~0+5``) keeps those
layers' KV cache at fp32 (``kv_cache_dtype_skip_layers``).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "clients" / "data" / "alpaca_521.json"
# arm -> (dtype, kv_cache_dtype, forced bf16 kernel). "bf16 weights" and "bf16 both" run the
# bf16 kernels the probe picks on this CPU (layers/gemm.py); the arms naming a kernel force it
# (LLM_SERVING_GEMM_BF16): widen keeps the linear layers' inputs fp32, amx and dot round them
# to bf16 (where the CPU has them).
ARMS = {"fp32": ("float32", "float32", None), "bf16 weights": ("bfloat16", "float32", None),
        "bf16 KV": ("float32", "bfloat16", None), "bf16 both": ("bfloat16", "bfloat16", None),
        "fp16 KV": ("float32", "float16", None), "fp8 KV": ("float32", "fp8_e4m3", None),
        "fp8_e5m2 KV": ("float32", "fp8_e5m2", None), "w8a8": ("float32", "float32", None),
        **{f"bf16 weights ({k})": ("bfloat16", "float32", k) for k in ("widen", "amx", "dot")},
        **{f"bf16 both ({k})": ("bfloat16", "bfloat16", k) for k in ("widen", "amx", "dot")}}
ATOL = 5e-3


def run_arm(model: str, prompts, dtype: str, kv: str, out: Path, max_tokens: int, every: int,
            max_num_seqs: int, kernel: str | None = None, skip: list | None = None):
    """Generate with one arm's dtypes, dumping logits to ``out``: (per prompt: dump key and
    output tokens), seconds."""
    import os

    from llm_serving import LLM, SamplingParams
    from llm_serving.engine.logits_dump import dump_key
    from unittest import mock
    with mock.patch.dict(os.environ, {"LLM_SERVING_GEMM_BF16": kernel} if kernel else {}):
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_dtype_skip_layers=skip,
                  dump_logits=str(out),
                  dump_logits_every=every, max_num_seqs=max_num_seqs, kv_cache_space=2.0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    llm.engine.shutdown()
    return [(dump_key(o.prompt_token_ids, None), list(o.outputs[0].token_ids)) for o in outs], dt


def compare_arm(ref_dir: Path, arm_dir: Path, ref, arm) -> dict:
    """``ref``/``arm``: run_arm's (key, tokens) per prompt, in prompt order."""
    pre, later, agree = [], [], []
    for (key, a), (key_b, b) in zip(ref, arm):
        assert key == key_b, "the arms saw different prompts"
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agree.append(same / max(len(a), 1))
        for path in ref_dir.glob(f"{key}_pos*.npy"):
            pos = int(path.stem.rsplit("_pos", 1)[1])
            if pos > same:           # the contexts differ from here on: not comparable
                continue
            d = float(np.abs(np.load(path).astype(np.float64) - np.load(arm_dir / path.name)).max())
            (pre if pos == 0 else later).append(d)
    pre, later = np.array(pre), np.array(later)
    return {"pre_max": pre.max(), "pre_mean": pre.mean(), "pre_ok": int((pre <= ATOL).sum()),
            "pre_n": len(pre), "later_max": later.max() if len(later) else float("nan"),
            "later_ok": int((later <= ATOL).sum()), "later_n": len(later),
            "identical": sum(a == 1.0 for a in agree), "n": len(agree),
            "prefix_share": float(np.mean(agree))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,bench",
                    help="comma-separated: built-in presets (tiny, bench, bench-gqa) or model "
                    "directories")
    ap.add_argument("--num-prompts", type=int, default=521)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--every", type=int, default=8, help="dump every N output positions")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--arms", default=None, help=f"comma-separated, of: {', '.join(ARMS)} "
                    "(default: all those this CPU runs)")
    args = ap.parse_args()

    from llm_serving.cpu_info import cpu_description
    from llm_serving.model_executor.device import init_device
    from llm_serving.model_executor.layers.gemm import bf16_kernels
    from llm_serving.model_executor.tiny_model import (QUANTIZED_ARMS, arm_skip_layers,
                                                       model_path, w8a8_copy)
    init_device("cpu")
    runs = bf16_kernels()
    arms = ([a.strip() for a in args.arms.split(",")] if args.arms else
            [a for a, (_, _, k) in ARMS.items() if k is None or k in runs])
    bad = [a for a in arms if a.partition("~")[0] not in ARMS]
    if bad:
        ap.error(f"unknown arm {bad[0]!r}")
    rows = json.loads(DATA.read_text())[:args.num_prompts]
    prompts = [r["instruction"] + ":" + r["input"] for r in rows]
    print(f"# bf16 accuracy vs fp32, {time.strftime('%Y-%m-%d')}, CPU: {cpu_description()}")
    print(f"# {len(prompts)} alpaca_521 prompts, greedy, {args.max_tokens} tokens, logits "
          f"dumped every {args.every} positions; 'within' = max |diff| <= {ATOL}")
    print(f"# bf16 kernels this CPU runs: {', '.join(runs)}\n")
    print("| model | arm | prefill max abs diff | prefill mean of max abs diff | prefill within 5e-3 "
          "| later (same context) max abs diff | later within 5e-3 | identical outputs "
          "| tokens before first difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        model = model_path(spec)
        work = Path(tempfile.mkdtemp(prefix="bf16acc_"))
        try:
            dirs, toks = {}, {}
            for arm in ["fp32"] + [a for a in arms if a != "fp32"]:
                name, skip = arm_skip_layers(arm, model)
                dtype, kv, kernel = ARMS[name]
                dirs[arm] = work / re.sub(r"\W+", "_", arm)
                arm_model = w8a8_copy(model) if name in QUANTIZED_ARMS else model
                toks[arm], dt = run_arm(arm_model, prompts, dtype, kv, dirs[arm], args.max_tokens,
                                        args.every, args.max_num_seqs, kernel, skip)
                print(f"#   {spec} {arm}: {dt:.1f} s", file=sys.stderr)
            for arm in arms:
                if arm == "fp32":
                    continue
                r = compare_arm(dirs["fp32"], dirs[arm], toks["fp32"], toks[arm])
                print(f"| {spec} | {arm} | {r['pre_max']:.3g} | {r['pre_mean']:.2g} "
                      f"| {r['pre_ok']}/{r['pre_n']} | {r['later_max']:.3g} "
                      f"| {r['later_ok']}/{r['later_n']} | {r['identical']}/{r['n']} "
                      f"| {100 * r['prefix_share']:.1f}% |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
