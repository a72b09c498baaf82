#!/usr/bin/env python
"""Start-up time of the server on the built-in tiny model: from `python start.py` to the
"ready" line (model loaded in a WorkAgent and warmed up), and to the first response.

    python bench/bench_startup.py [--runs 3]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]


def one_run() -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if "ready" in line:
                break
        ready = time.perf_counter() - t0
        requests.post(f"http://127.0.0.1:{port}/models/llama2/generate",
                      json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}}).raise_for_status()
        first = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return ready, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs = [one_run() for _ in range(args.runs)]
    from llm_serving.cpu_info import cpu_description
    print(f"# start-up, {datetime.date.today()}, {platform.node()}, {cpu_description()}\n")
    print("| run | to ready line | to first response |\n|---|---|---|")
    for i, (ready, first) in enumerate(runs, 1):
        print(f"| {i} | {ready:.1f} s | {first:.1f} s |")
    print(f"| median | {statistics.median(r for r, _ in runs):.1f} s | "
          f"{statistics.median(f for _, f in runs):.1f} s |")


if __name__ == "__main__":
    main()
