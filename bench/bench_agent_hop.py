#!/usr/bin/env python
"""What serving costs on top of the bare model, at the same batch sizes, in one run:
- in-process: engine steps with the model in this process ("uni"), LLM.generate;
- via WorkAgent: the model in a WorkAgent fed through shared memory ("mp"), with the master
  waiting for each step (sync) and with async scheduling (step N+1 handed over while the
  agent computes step N, the server's default);
- served: the real server (start.py) with B concurrent streaming HTTP requests.

Output tokens/s of each, and the loss against in-process (all measured in this run; the
peer's own hop is not runnable here: llm-serving needs Ascend and MindFormers, and vLLM's
served comparison is ``bench_w1_served.py --peer vllm``).

    python bench/bench_agent_hop.py [--batch-sizes 1,16,64] [--tokens 32] [--model DIR]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time
from llm_serving.cpu_info import cpu_description  # noqa: E402
from llm_serving.model_executor.tiny_model import MODEL_HELP, model_path  # noqa: E402


def step_time(llm, batch: int, tokens: int) -> float:
    from llm_serving import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    steps0 = llm.engine.stats.num_steps
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - t0) / (llm.engine.stats.num_steps - steps0)


def served_rate(model: str, batch: int, tokens: int) -> float:
    """Output tokens/s of B concurrent streaming requests through the HTTP server."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import requests
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, str(root / "start.py"), "--model", model,
                             "--port", str(port), "--max-num-seqs", str(batch),
                             "--num-blocks", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if "ready" in line:
                break
        url = f"http://127.0.0.1:{port}/v1/completions"

        def one(i, n):
            body = {"prompt": f"Request {i}: tell me about the number {i}.", "max_tokens": n,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            count = 0
            with requests.post(url, json=body, stream=True) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        count += len(json.loads(line[6:])["choices"][0]["text"]) > 0
            return count
        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(one, range(batch), [4] * batch))           # warm
            t0 = time.perf_counter()
            list(pool.map(one, range(batch), [tokens] * batch))
            dt = time.perf_counter() - t0
        return batch * tokens / dt
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from llm_serving import LLM
    model = model_path(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    res = {}
    for name, backend, overlap in (("uni", "uni", False), ("mp", "mp", False),
                                   ("async", "mp", True)):
        llm = LLM(model, max_num_seqs=max(batches), num_blocks=4096,
                  distributed_executor_backend=backend, async_scheduling=overlap)
        for b in batches:
            res[name, b] = step_time(llm, b, args.tokens)
        llm.engine.shutdown()
        del llm
    print(f"# master -> WorkAgent hop, {datetime.date.today()}, {platform.node()}, "
          f"{cpu_description()}\nmodel: {model}\n")
    for b in batches:
        res["http", b] = served_rate(model, b, args.tokens)
    print("| batch | in-process step | via WorkAgent, sync | hop | via WorkAgent, async "
          "| vs in-process | served (HTTP) | served vs in-process |")
    print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        uni, mp, overlap, http = res["uni", b], res["mp", b], res["async", b], res["http", b]
        bare = b / uni
        print(f"| {b} | {uni * 1e3:.2f} ms ({bare:.0f} tok/s) | {mp * 1e3:.2f} ms | "
              f"{(mp - uni) * 1e3:+.2f} ms | {overlap * 1e3:.2f} ms | {uni / overlap - 1:+.1%} "
              f"| {http:.0f} tok/s | {http / bare - 1:+.1%} |")


if __name__ == "__main__":
    main()
