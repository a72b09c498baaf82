#!/usr/bin/env python
"""PD disaggregation served, side by side in one run: W1 with long prompts mixed in, at 4
req/s, through ``llm-serving proxy`` + one prefill and one decode instance (each pinned to
one core) against one colocated instance on both cores. Prints TTFT and TPOT p50/p99 per
setup, and per connector the KV moved: transfers, bytes, mean per-request transfer time and
bandwidth (from the decode instance's /metrics).

Workload: the first ``--num-prompts`` W1 prompts (alpaca_5010.json, instruction + ":" +
input), each asking for its reference output's token count capped at 256, greedy,
``ignore_eos``; every ``--long-every``-th prompt gets a distinct context of about
``--long-tokens`` tokens in front (text from later alpaca answers), so one request in ten
brings a long prefill into the decodes' steps. Poisson arrivals at ``--rate`` req/s, driven
by clients/benchmark_serving.py's request function (streamed /v1/completions).

Transfer time per request is the mean time a request waits in WAITING_FOR_REMOTE_KVS: by
Little's law, the integral of ``kv_loads_in_flight`` (sampled every 50 ms) over the number of
loads done. Bandwidth = KV bytes received / that integral.

    python bench/bench_pd.py [--num-prompts 200] [--connectors MooncakeConnector,MooncakeStoreConnector]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_w1_served import Server, free_port  # noqa: E402
from clients.benchmark_serving import DATA, arrival_gaps, send, summarize  # noqa: E402
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402


def workload(tokenizer_dir: str, n: int, long_every: int, long_tokens: int, max_output: int):
    """[(prompt, max_tokens, is_long)]."""
    from llm_serving.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    rows = json.loads(Path(DATA).read_text())
    filler = " ".join(r["output"] for r in rows[1000:]).split()
    out, pos = [], 0
    for i, r in enumerate(rows[:n]):
        prompt = r["instruction"] + ":" + r["input"] if r.get("input") else r["instruction"]
        max_tokens = max(1, min(max_output, len(tok.encode(r["output"],
                                                           add_special_tokens=False))))
        is_long = long_every > 0 and i % long_every == long_every - 1
        if is_long:                   # a distinct context, so no prefix cache helps
            words = long_tokens       # BPE: at least one token per word
            context = " ".join(filler[pos:pos + words])
            while len(tok.encode(context, add_special_tokens=False)) > long_tokens:
                words = int(words * 0.9)
                context = " ".join(filler[pos:pos + words])
            pos += words
            prompt = f"{context}\n\n{prompt}"
        out.append((prompt, max_tokens, is_long))
    return out


def drive(url: str, work, rate: float, seed: int = 0) -> dict:
    args = SimpleNamespace(base_url=url, endpoint="/v1/completions", ignore_eos=True,
                           timeout=1800.0, goodput=[])

    async def run():
        import aiohttp
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.get(url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            gaps = arrival_gaps(len(work), rate, 1.0, np.random.default_rng(seed))
            t0 = time.perf_counter()
            tasks = []
            for (prompt, n, _), gap in zip(work, gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.ensure_future(send(session, args, model, prompt, n, t0)))
            records = await asyncio.gather(*tasks)
            return {"duration": time.perf_counter() - t0, "records": records}
    result = asyncio.run(run())
    for rec in result["records"]:
        if rec["error"]:
            print(f"failed request: {rec['error']}", file=sys.stderr)
    s = summarize(args, result)
    longs = [r for r, w in zip(result["records"], work) if w[2] and r["ttft"] is not None]
    s["ttft_long_ms"] = 1000 * float(np.median([r["ttft"] for r in longs])) if longs else 0.0
    return s


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class LoadSampler(threading.Thread):
    """Integrates D's kv_loads_in_flight over time (Little's law: / loads = mean wait)."""

    def __init__(self, url: str, period: float = 0.05):
        super().__init__(daemon=True)
        self.url, self.period, self.integral = url, period, 0.0
        self.stop_ = threading.Event()

    def run(self):
        last = time.perf_counter()
        while not self.stop_.is_set():
            try:
                v = value(metrics(self.url), "llm_serving:kv_loads_in_flight")
            except OSError:
                v = 0.0
            now = time.perf_counter()
            self.integral += v * (now - last)
            last = now
            time.sleep(self.period)

    def stop(self) -> float:
        self.stop_.set()
        self.join()
        return self.integral


def instance(name: str, model: str, cores: str, logs: Path, max_model_len: int,
             kv: dict | None = None) -> Server:
    port = free_port()
    cfg = logs / f"{name}.yaml"
    text = (f"serving_config:\n  agent_ports: [{free_port()}]\n  server_port: {port}\n"
            f"llm_serving:\n  model: {model}\n  max_model_len: {max_model_len}\n"
            f"  max_num_seqs: 64\n  cpu_affinity: '{cores}'\n"
            f"  enable_chunked_prefill: true\n  max_num_batched_tokens: 2048\n")
    if kv:
        text += "kv_transfer: " + json.dumps(kv) + "\n"
    cfg.write_text(text)
    return Server(name, [sys.executable, str(ROOT / "start.py"), "--config", str(cfg)], port,
                  log=str(logs / f"{name}.log"), ready_path="/health")


def proxy(prefill: str, decode: str, order: str, logs: Path) -> Server:
    port = free_port()
    return Server("proxy", [sys.executable, "-m", "llm_serving.cli", "proxy", "--port",
                            str(port), "--prefill", prefill, "--decode", decode, "--order",
                            order], port, log=str(logs / "proxy.log"), ready_path="/health")


class Master:
    """A mooncake_master for the pool connector, on a free port."""

    def __init__(self, logs: Path):
        exe = shutil.which("mooncake_master")
        if not exe:
            raise SystemExit("mooncake_master is missing: pip install -e '.[pd]'")
        self.port = free_port()
        self.log = open(logs / "mooncake_master.log", "w")
        self.proc = subprocess.Popen([exe, f"--port={self.port}",
                                      "--enable_http_metadata_server=false"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master did not start")
                time.sleep(0.2)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def kv_config(connector: str, role: str, master: Master | None) -> dict:
    cfg = {"kv_connector": connector, "kv_role": role, "kv_transfer_timeout": 60}
    if connector == "MooncakeStoreConnector":
        cfg["kv_connector_extra_config"] = {"master_server_address": f"127.0.0.1:{master.port}",
                                            "global_segment_size": 512 << 20}
    return cfg


def run_pd(connector: str, model: str, work, args, logs: Path) -> dict:
    logs = logs / connector           # each setup's own P.log, D.log, proxy.log
    logs.mkdir(parents=True, exist_ok=True)
    master = Master(logs) if connector == "MooncakeStoreConnector" else None
    try:
        with instance("P", model, "0", logs, args.max_model_len,
                      kv_config(connector, "kv_producer", master)) as p, \
                instance("D", model, "1", logs, args.max_model_len,
                         kv_config(connector, "kv_consumer", master)) as d, \
                proxy(p.url, d.url, args.order, logs) as x:
            before = metrics(d.url)
            sampler = LoadSampler(d.url)
            sampler.start()
            s = drive(x.url, work, args.rate)
            waited = sampler.stop()
            after, proxied = metrics(d.url), metrics(x.url)
    finally:
        if master is not None:
            master.__exit__()

    def delta(name):
        return value(after, name) - value(before, name)
    loads = delta('llm_serving:kv_transfers_total{outcome="done"}')
    moved = delta("llm_serving:kv_transfer_bytes_total")
    s["kv"] = {"loads": loads, "bytes": moved,
               "failed": delta('llm_serving:kv_transfers_total{outcome="failed"}')
               + delta('llm_serving:kv_transfers_total{outcome="timeout"}'),
               "recomputes": delta("llm_serving:kv_transfer_recomputes_total"),
               "tokens": delta("llm_serving:kv_remote_prefill_tokens_total"),
               "wait_ms": 1000 * waited / loads if loads else 0.0,
               "gbps": moved / waited / 1e9 if waited else 0.0,
               "p_phase_ms": 1000 * value(proxied, "llm_serving_proxy:prefill_seconds_sum")
               / max(1.0, value(proxied, "llm_serving_proxy:prefill_seconds_count"))}
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--long-every", type=int, default=10)
    ap.add_argument("--long-tokens", type=int, default=1750,
                    help="context tokens of a long prompt (+ the output within the bench model's 2048)")
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--order", choices=("p-first", "d-first"), default="p-first")
    ap.add_argument("--connectors", default="MooncakeConnector,MooncakeStoreConnector")
    ap.add_argument("--logs", default=None, help="keep the servers' logs in this directory")
    args = ap.parse_args()
    # SIGTERM (or a background job's interrupt) stops the servers this started, as Ctrl-C does.
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if os.cpu_count() < 2:
        ap.error("needs 2 cores (P and D are pinned to cores 0 and 1)")
    model = model_path(args.model)
    work = workload(model, args.num_prompts, args.long_every, args.long_tokens,
                    args.max_output)
    res = {}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        with instance("colocated", model, "0-1", logs, args.max_model_len) as c:
            res["colocated (1 instance, cores 0-1)"] = drive(c.url, work, args.rate)
        print("[colocated] done", file=sys.stderr, flush=True)
        for conn in args.connectors.split(","):
            res[f"1P1D {conn} (P core 0, D core 1)"] = run_pd(conn, model, work, args, logs)
            print(f"[{conn}] done", file=sys.stderr, flush=True)

    n_long = sum(w[2] for w in work)
    print(f"# PD disaggregation served, {datetime.date.today()}\n# CPU: {cpu_description()}\n"
          f"# model: {model}; W1 prompts: {len(work)} ({n_long} with ~{args.long_tokens}-token "
          f"contexts), {args.rate:g} req/s Poisson, greedy, ignore_eos; order {args.order}; "
          f"load (1-min average) at start {load_start:.1f}, at end {os.getloadavg()[0]:.1f}\n")
    print("| setup | duration | output tok/s | TTFT p50 / p99 ms | TTFT p50 long ms | "
          "TPOT p50 / p99 ms | failed |")
    print("|---|---|---|---|---|---|---|")
    for name, s in res.items():
        print(f"| {name} | {s['duration']:.1f} s | {s['output_throughput']:.1f} | "
              f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | "
              f"{s['ttft_long_ms']:.0f} | {s['tpot_ms']['median']:.1f} / "
              f"{s['tpot_ms']['p99']:.1f} | {s['failed']} |")
    base = next(iter(res.values()))
    print("\n| setup | TPOT p99 vs colocated | TTFT p50 vs colocated | loads done | "
          "failed / recomputed | MB moved | mean transfer ms | GB/s | P phase ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in list(res.items())[1:]:
        kv = s["kv"]
        print(f"| {name} | {s['tpot_ms']['p99'] / base['tpot_ms']['p99']:.2f}x | "
              f"{s['ttft_ms']['median'] / base['ttft_ms']['median']:.2f}x | "
              f"{kv['loads']:.0f} | {kv['failed']:.0f} / {kv['recomputes']:.0f} | "
              f"{kv['bytes'] / 1e6:.1f} | {kv['wait_ms']:.1f} | {kv['gbps']:.2f} | "
              f"{kv['p_phase_ms']:.0f} |")


if __name__ == "__main__":
    main()
