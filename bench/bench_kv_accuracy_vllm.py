#!/usr/bin/env python
"""A narrow KV cache's accuracy side by side with vLLM-CPU's: each engine against its own fp32,
on the same model and prompts, by what both engines give (greedy tokens, top-k logprobs).

    python bench/bench_kv_accuracy_vllm.py [--arms fp8_e4m3,fp8_e5m2] [--num-prompts 100]
                                           [--max-tokens 64] [--model bench|DIR]

The first ``--num-prompts`` alpaca_521 prompts (instruction + ":" + input) are generated
greedily (ignore_eos) with ``logprobs=5`` by our offline LLM and by vLLM's, once with the
KV cache at fp32 (``auto``) and once per arm. Printed per engine and arm, against that engine's
fp32 run:
- identical outputs, and the mean share of each output before its first different token;
- |logprob difference| of fp32's greedy token at the first output position (the prompt's
  prefill, the same input in every run): mean and max over prompts;
- the same at every position whose context still equals fp32's (up to and including the first
  different token): mean, 99th percentile, max;
and whether the two engines' fp32 runs agree (the common ground the comparison stands on).

With an FP8 arm it also stores the same random values (every magnitude, in range) through
each engine's own cache write (vLLM's ``cpu_attn_reshape_and_cache``, ours
``reshape_and_cache``) and counts the bytes that differ from torch's casts (round to nearest
even) and from each other.

vLLM runs from its own virtual environment (``bash bench/setup_vllm_peer.sh``; ``--vllm-venv``
or $VLLM_VENV), as a child process running this file with ``--worker``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "clients" / "data" / "alpaca_521.json"
TOP_K = 5
FP8 = {"fp8": ("float8_e4m3fn", 448.0), "fp8_e4m3": ("float8_e4m3fn", 448.0),
       "fp8_e5m2": ("float8_e5m2", 57344.0)}


def generate(engine: str, model: str, kv_dtypes, num_prompts: int, max_tokens: int) -> dict:
    """kv dtype -> per prompt {"ids": greedy token ids, "lp": per position {token: logprob}}."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        extra = {}
    else:
        from llm_serving import LLM, SamplingParams
        extra = {"kv_cache_space": 2.0}
    rows = json.loads(DATA.read_text())[:num_prompts]
    prompts = [r["instruction"] + ":" + r["input"] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=TOP_K)
    runs = {}
    for kv in kv_dtypes:
        t = time.perf_counter()
        llm = LLM(model, dtype="float32", kv_cache_dtype=kv, max_model_len=1024, seed=0, **extra)
        outs = llm.generate(prompts, params)
        runs[kv] = [{"ids": list(o.outputs[0].token_ids),
                     "lp": [{str(tok): float(lp.logprob) for tok, lp in pos.items()}
                            for pos in o.outputs[0].logprobs]} for o in outs]
        if engine != "vllm":
            llm.engine.shutdown()
        del llm
        gc.collect()                                 # vLLM: its engine core process ends
        print(f"#   {engine} {kv}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return runs


def random_values(rows: int = 4096, dim: int = 64) -> np.ndarray:
    """Values of every magnitude from FP8's subnormals to E4M3's largest, both signs."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((rows, dim)) * np.exp(rng.uniform(-14, 6, (rows, dim)))
    return np.clip(x, -448, 448).astype(np.float32)


def vllm_cache_bytes(kind: str, x: np.ndarray) -> np.ndarray:
    """x stored by vLLM-CPU's own cache write (k_scale = v_scale = 1, its default): the value
    cache's bytes, row-major per token in its layout."""
    import torch
    import vllm._custom_ops as ops
    rows, dim = x.shape
    block = 32
    kc = torch.zeros(rows // block, 1, block, dim, dtype=torch.uint8)
    vc = kc.clone()
    t = torch.from_numpy(x).view(rows, 1, dim)
    ops.cpu_attn_reshape_and_cache(t, t, kc, vc, torch.arange(rows, dtype=torch.int64), "vec",
                                   1.0, 1.0, kind)
    return vc.reshape(rows, dim).numpy()


def ours_cache_bytes(kind: str, x: np.ndarray) -> np.ndarray:
    from llm_serving.model_executor.attention import kernels as K
    rows, dim = x.shape
    k = np.zeros((rows, 1, 1, dim), K.CACHE_DTYPES[kind])
    v = k.copy()
    K.reshape_and_cache(x, x, k, v, np.arange(rows, dtype=np.int32))
    return v.reshape(rows, dim).view(np.uint8)


def versus_fp32(ref: list, arm: list) -> dict:
    ident, share, first, same_ctx = 0, [], [], []
    for r, a in zip(ref, arm):
        n = len(r["ids"])
        same = next((i for i, (x, y) in enumerate(zip(r["ids"], a["ids"])) if x != y), n)
        ident += same == n
        share.append(same / max(n, 1))
        for pos in range(min(same + 1, n)):              # the context equals fp32's up to here
            tok = str(r["ids"][pos])
            if tok in a["lp"][pos]:                      # else beyond the arm's top-k
                d = abs(a["lp"][pos][tok] - r["lp"][pos][tok])
                same_ctx.append(d)
                if pos == 0:
                    first.append(d)
    first, same_ctx = np.array(first), np.array(same_ctx)
    return {"identical": f"{ident}/{len(ref)}", "share": 100 * float(np.mean(share)),
            "first_mean": first.mean(), "first_max": first.max(), "mean": same_ctx.mean(),
            "p99": np.percentile(same_ctx, 99), "max": same_ctx.max(), "n": len(same_ctx)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="fp8_e4m3,fp8_e5m2",
                    help="comma-separated KV cache dtypes both engines take")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="bench", help="a built-in preset or a model directory")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venv-vllm"))
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)   # vLLM's side
    args = ap.parse_args()
    kvs = ["auto"] + [a.strip() for a in args.arms.split(",") if a.strip() != "auto"]
    if args.worker:
        out = {"runs": generate("vllm", args.model, kvs, args.num_prompts, args.max_tokens),
               "bytes": {kv: vllm_cache_bytes(kv, random_values()).tolist()
                         for kv in kvs if kv in FP8}}
        Path(args.worker).write_text(json.dumps(out))
        return

    sys.path.insert(0, str(ROOT))
    from llm_serving.cpu_info import cpu_description
    from llm_serving.model_executor.device import init_device
    from llm_serving.model_executor.tiny_model import model_path
    init_device("cpu")
    model = str(model_path(args.model))
    print(f"# KV cache accuracy side by side with vLLM-CPU, {time.strftime('%Y-%m-%d')}, "
          f"CPU: {cpu_description()}")
    print(f"# {args.num_prompts} alpaca_521 prompts, greedy, {args.max_tokens} tokens, "
          f"logprobs={TOP_K}; each engine against its own fp32 (KV auto)\n")
    ours = generate("ours", model, kvs, args.num_prompts, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="kvacc_") as tmp:
        out = Path(tmp) / "vllm.json"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.pop("PYTHONPATH", None)
        subprocess.run([str(Path(args.vllm_venv) / "bin" / "python"), __file__, "--worker",
                        str(out), "--model", model, "--arms", args.arms, "--num-prompts",
                        str(args.num_prompts), "--max-tokens", str(args.max_tokens)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        peer = json.loads(out.read_text())
    print("| engine | KV cache | identical outputs | tokens before first difference "
          "| prefill: mean abs logprob diff | prefill: max | same context: mean | p99 | max "
          "| positions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kv in kvs[1:]:
        for name, runs in (("ours", ours), ("vLLM-CPU", peer["runs"])):
            r = versus_fp32(runs["auto"], runs[kv])
            print(f"| {name} | {kv} | {r['identical']} | {r['share']:.1f}% "
                  f"| {r['first_mean']:.3f} | {r['first_max']:.3f} | {r['mean']:.3f} "
                  f"| {r['p99']:.3f} | {r['max']:.3f} | {r['n']} |")
    agree = sum(a["ids"] == b["ids"] for a, b in zip(ours["auto"], peer["runs"]["auto"]))
    print(f"\nfp32 (KV auto): ours and vLLM's greedy outputs identical for {agree}/"
          f"{args.num_prompts} prompts")
    if peer["bytes"]:
        import ml_dtypes
        import torch
        x = random_values()
        print(f"\nFP8 cache writes of {x.size} random values (every magnitude, in range):")
    for kv, theirs in peer["bytes"].items():
        name, _ = FP8[kv]
        rne = torch.from_numpy(x).to(getattr(torch, name)).view(torch.uint8).numpy()
        mine, theirs = ours_cache_bytes(kv, x), np.array(theirs, np.uint8)
        differ = theirs != rne
        stored = np.abs(theirs.view(getattr(ml_dtypes, name)).astype(np.float32))
        toward_zero = bool((stored[differ] <= np.abs(x[differ])).all())
        print(f"- {kv}: bytes differing from torch's cast (nearest even): ours "
              f"{int((mine != rne).sum())}, vLLM-CPU's {int(differ.sum())} (all toward "
              f"zero: {toward_zero}); ours vs vLLM-CPU's: {int((mine != theirs).sum())}")


if __name__ == "__main__":
    main()
