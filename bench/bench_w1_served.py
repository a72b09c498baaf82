#!/usr/bin/env python
"""W1 served, the clients issue's workload, in one command: the real server (start.py, model
in a WorkAgent) driven by clients/benchmark_serving.py over the OpenAI API.

W1 = the first 200 prompts of alpaca_5010.json (instruction + ":" + input), each asking for
its reference output's token count capped at 256, greedy, ignore_eos. Cases:
- tuned (max_num_seqs 128): all at once, and Poisson arrivals at 4 req/s;
- decode batch 1 (max_num_seqs 1, llm-serving's untuned shape): all at once.

The "offline" case is the same workload through the bare engine in this process
(LLM.generate, max_num_seqs 128): the served rows' loss against it is the serving overhead
(HTTP, streaming, the master-agent hop), measured in the same run.

The table compares with the references measured on this machine kind with the same 97 M model
(../shared/NOTES.md): vLLM's CPU backend 261 output tok/s all at once and TTFT p50/p99
330/704 ms at 4 req/s; llama.cpp's llama-server 166 tok/s. Those servers cannot run in the
same process tree here, so their figures come from the notes, not from this run.

    python bench/bench_w1_served.py [--model DIR] [--cases offline,tuned,rate4,batch1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_TOKS, VLLM_TTFT = 261.0, (330.0, 704.0)
LLAMA_CPP_TOKS = 166.0
CASES = {   # name: (max_num_seqs, request rate)
    "offline": (128, "inf"),
    "tuned": (128, "inf"),
    "rate4": (128, "4"),
    "batch1": (1, "inf"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_num_seqs: int):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--model", model,
                             "--port", str(port), "--max-num-seqs", str(max_num_seqs)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "ready" in line:
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"the server did not start (exit code {proc.wait()})")


def run_case(model: str, max_num_seqs: int, rate: str, out: Path) -> dict:
    proc, url = start_server(model, max_num_seqs)
    try:
        subprocess.run([sys.executable, str(ROOT / "clients" / "benchmark_serving.py"),
                        "--base-url", url, "--dataset-name", "alpaca", "--num-prompts", "200",
                        "--max-output", "256", "--ignore-eos", "--request-rate", rate,
                        "--seed", "0", "--result-file", str(out)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    result = json.loads(out.read_text())
    for rec in result["records"]:
        if rec["error"] is not None:
            print(f"failed request: {rec['error']}", file=sys.stderr)
    return result["summary"]


def run_offline(model: str, max_num_seqs: int) -> dict:
    """W1 through LLM.generate in this process: output tok/s of the bare engine."""
    import time
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_engine import w1
    from llm_serving import LLM, SamplingParams
    llm = LLM(model, max_num_seqs=max_num_seqs, kv_cache_space=4.0)
    prompts, lens = w1(llm.get_tokenizer(), 200, 256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.shutdown()
    return {"output_throughput": n_out / dt, "duration": dt, "failed": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the 97M bench model)")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    from llm_serving.model_executor.tiny_model import ensure_tiny_model
    model = args.model or ensure_tiny_model(preset="bench")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            seqs, rate = CASES[name]
            res[name] = (run_offline(model, seqs) if name == "offline"
                         else run_case(model, seqs, rate, Path(tmp) / f"{name}.json"))
    print(f"# W1 served, {datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores\n"
          f"model: {model}\n")
    print("| case | max_num_seqs | arrivals | duration | output tok/s | vs offline | "
          "vs vLLM (261) | vs llama.cpp (166) | TTFT p50 / p99 | TPOT p50 | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = res.get("offline", {}).get("output_throughput")
    for name, s in res.items():
        seqs, rate = CASES[name]
        toks = s["output_throughput"]
        vs_base = f"{toks / base - 1:+.1%}" if base and name == "tuned" else ""
        lat = (f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} ms | "
               f"{s['tpot_ms']['median']:.1f} ms" if "ttft_ms" in s else "in process | ")
        print(f"| {name} | {seqs} | {'all at once' if rate == 'inf' else rate + ' req/s'} | "
              f"{s['duration']:.1f} s | {toks:.1f} | {vs_base} | {toks / VLLM_TOKS:.2f}x | "
              f"{toks / LLAMA_CPP_TOKS:.2f}x | {lat} | {s['failed']} |")
    if "rate4" in res:
        s = res["rate4"]
        print(f"\nAt 4 req/s, TTFT p50/p99 vs vLLM's {VLLM_TTFT[0]:.0f}/{VLLM_TTFT[1]:.0f} ms: "
              f"{s['ttft_ms']['median'] / VLLM_TTFT[0]:.2f}x / "
              f"{s['ttft_ms']['p99'] / VLLM_TTFT[1]:.2f}x "
              "(lower is better)")


if __name__ == "__main__":
    main()
