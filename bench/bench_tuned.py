#!/usr/bin/env python
"""A tuned config against the untuned one and our defaults, in one run, with both our
clients: ``clients/benchmark_serving.py`` on W1 (the first 200 alpaca prompts, all at once,
greedy, ignore_eos) and ``clients/performance_serving`` on the contest's command line
(``-X <req/s> -P <port> -O <dir> -T <s>``, scaled down from the contest's -X 0.5 -T 3000).
Also llm-serving's untuned shape, decode batch 1 (the seed's experiment), on the contest line.

    python bench/bench_tuned.py --tuned tuned.yaml --untuned configs/llama/llama_7b_kbk_pa_dyn.yaml \\
        --model DIR [--server-args "--max-model-len 2048"] [-X 2 -T 60]

One server at a time (they would share the cores); the table gives each row's ratio to the
untuned config. Nothing is compared against numbers from another run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llm_serving.tune.trial_server import TrialServer, Workload, run_client  # noqa: E402
from llm_serving.cpu_info import cpu_description  # noqa: E402

W1 = ROOT / "clients" / "data" / "alpaca_5010.json"


def contest_client(port: int, x: float, t: float, out: Path, tokenizer: str) -> dict:
    run = subprocess.run([sys.executable, str(ROOT / "clients" / "performance_serving" /
                                              "test_serving_performance.py"),
                          "-X", f"{x:g}", "-P", str(port), "-O", str(out), "-T", f"{t:g}",
                          "--tokenizer", tokenizer], capture_output=True, text=True, cwd=ROOT)
    text = run.stdout
    exec_time = re.search(r"All Tasks Done; Exec Time is ([0-9.]+)", text)
    toks = re.search(r"\(([0-9.]+) tok/s\); failures: (\d+)", text)
    ttft = re.search(r"\| TTFT \| (\S+) / (\S+) / (\S+) \|", text)
    if not exec_time or not toks:
        raise RuntimeError(f"performance_serving failed:\n{text[-2000:]}{run.stderr[-2000:]}")
    return {"exec": float(exec_time.group(1)), "toks": float(toks.group(1)),
            "failed": int(toks.group(2)), "ttft50": ttft.group(1) if ttft else "-",
            "ttft99": ttft.group(3) if ttft else "-"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuned", required=True)
    ap.add_argument("--untuned", default=str(ROOT / "configs/llama/llama_7b_kbk_pa_dyn.yaml"))
    ap.add_argument("--model", required=True, help="model directory (all configs use it)")
    ap.add_argument("--server-args", default="",
                    help="extra start.py flags for the untuned and batch-1 servers (e.g. "
                         "--max-model-len 2048 when the base file's is too long for the model)")
    ap.add_argument("-X", type=float, default=2.0, help="performance_serving requests/s")
    ap.add_argument("-T", type=float, default=60.0, help="performance_serving seconds")
    ap.add_argument("--num-prompts", type=int, default=200, help="W1 prompts")
    ap.add_argument("--cases", default="batch1,untuned,defaults,tuned")
    args = ap.parse_args()
    extra = args.server_args.split()
    cases = {
        "batch1": (args.untuned, ["--model", args.model, *extra, "--max-num-seqs", "1"]),
        "untuned": (args.untuned, ["--model", args.model, *extra]),
        "defaults": (None, ["--model", args.model]),
        "tuned": (args.tuned, []),
    }
    wanted = args.cases.split(",")
    res: dict[str, dict] = {}
    workload = Workload(dataset=str(W1), request_rate=float("inf"), tokenizer=args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in wanted:
            config, flags = cases[name]
            srv = TrialServer(config and Path(config), tmp / f"{name}.log", 600, tuple(flags))
            try:
                row = res.setdefault(name, {})
                if name != "batch1":          # W1 at batch 1 alone would take ~5 minutes
                    s = run_client(srv.url, workload, args.num_prompts)
                    row["w1"] = {"toks": s["output_throughput"], "dur": s["duration"],
                                 "ttft50": s["ttft_ms"]["median"], "ttft99": s["ttft_ms"]["p99"],
                                 "tpot50": s["tpot_ms"]["median"], "failed": s["failed"]}
                row["contest"] = contest_client(srv.port, args.X, args.T, tmp / name, args.model)
            finally:
                srv.stop()
            print(f"[{name}] {res[name]}", file=sys.stderr, flush=True)

    print(f"# tuned vs untuned vs defaults, {datetime.date.today()}\n# CPU: {cpu_description()}"
          f"\n# model: {args.model}; tuned: {args.tuned}; untuned: {args.untuned} "
          f"{args.server_args}; defaults: start.py --model DIR\n# machine load (1-min "
          f"average) at the end: {os.getloadavg()[0]:.1f}\n")
    base = res.get("untuned", {})
    print(f"benchmark_serving, W1 ({args.num_prompts} prompts all at once):\n")
    print("| config | duration s | output tok/s | vs untuned | TTFT p50 / p99 ms | TPOT p50 ms "
          "| failed |\n|---|---|---|---|---|---|---|")
    for name, row in res.items():
        if "w1" in row:
            w = row["w1"]
            ratio = f"{w['toks'] / base['w1']['toks']:.2f}x" if "w1" in base else "-"
            print(f"| {name} | {w['dur']:.1f} | {w['toks']:.1f} | {ratio} | {w['ttft50']:.0f} / "
                  f"{w['ttft99']:.0f} | {w['tpot50']:.1f} | {w['failed']} |")
    n = int(args.X * args.T)
    print(f"\nperformance_serving, the contest line scaled down: -X {args.X:g} -T {args.T:g} "
          f"({n} requests; the contest's was -X 0.5 -T 3000, 1500):\n")
    print("| config | Exec Time s | vs untuned | output tok/s | TTFT p50 / p99 ms | failed |"
          "\n|---|---|---|---|---|---|")
    for name, row in res.items():
        c = row["contest"]
        ratio = f"{c['exec'] / base['contest']['exec']:.2f}x" if "contest" in base else "-"
        print(f"| {name} | {c['exec']:.1f} | {ratio} | {c['toks']:.1f} | {c['ttft50']} / "
              f"{c['ttft99']} | {c['failed']} |")


if __name__ == "__main__":
    main()
