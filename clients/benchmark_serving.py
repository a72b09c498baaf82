#!/usr/bin/env python
"""Serving benchmark in the style of vLLM's benchmark_serving, against any OpenAI-compatible
server (ours, vLLM, llama.cpp's llama-server ...), so that side-by-side comparisons are one
command each:

    python clients/benchmark_serving.py --base-url http://127.0.0.1:8835 \\
        --dataset-name alpaca --num-prompts 200 --request-rate 4 --ignore-eos

Requests stream from ``/v1/completions`` (or, with ``--endpoint /v1/chat/completions``, from
the chat route, each prompt as one user message, as vLLM's ``openai-chat`` backend sends them)
and arrive as a Poisson process (``--burstiness 1``)
or a gamma process (other values) at ``--request-rate`` (``inf`` = all at once), with at
most ``--max-concurrency`` in flight. It prints vLLM's "Serving Benchmark Result" block and
saves JSON with every request's record (send, first token and end times, token counts, error).

Datasets:
- alpaca: prompt = instruction + ":" + input; output length = the reference output's token
  count (``--max-output`` caps it);
- random: prompts of about ``--random-input-len`` words, ``--random-output-len`` tokens each;
- shared-prefix: one preamble of ``--shared-prefix-words`` words, then a distinct question.

Token counts come from the server's usage (``stream_options.include_usage``). Output lengths
for alpaca come from ``--tokenizer DIR`` or, failing that, the server's ``/tokenize``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "alpaca_5010.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8835")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--dataset-name", choices=("alpaca", "random", "shared-prefix"),
                    default="alpaca")
    ap.add_argument("--dataset-path", default=str(DATA))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--shared-prefix-words", type=int, default=400)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--goodput", nargs="*", default=[],
                    help="SLOs like ttft:500 tpot:100 e2el:10000 (ms)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--result-file", default=None, help="JSON output (default: none)")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar (when a caller such as llm-serving tune shows its own)")
    return ap.parse_args(argv)


def build_dataset(args, rng: random.Random) -> list[tuple[str, Optional[str], int]]:
    """(prompt, reference output or None, max_tokens or -1 to count from the reference)."""
    rows = json.loads(Path(args.dataset_path).read_text())
    if args.dataset_name == "alpaca":
        return [(r["instruction"] + ":" + r["input"] if r.get("input") else r["instruction"],
                 r["output"], -1) for r in rows[:args.num_prompts]]
    words = " ".join(r["output"] for r in rows[:2000]).split()
    if args.dataset_name == "random":
        out = []
        for _ in range(args.num_prompts):
            start = rng.randrange(len(words) - args.random_input_len)
            out.append((" ".join(words[start:start + args.random_input_len]), None,
                        args.random_output_len))
        return out
    preamble = " ".join(words[:args.shared_prefix_words])
    return [(preamble + "\n\nQuestion: " + r["instruction"], None, args.random_output_len)
            for r in rows[:args.num_prompts]]


async def output_lengths(session, args, refs: list[Optional[str]]) -> list[int]:
    if args.tokenizer:
        from llm_serving.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(args.tokenizer)
        return [max(1, min(args.max_output, len(tok.encode(t, add_special_tokens=False))))
                for t in refs]

    async def one(t):
        async with session.post(args.base_url + "/tokenize",
                                json={"prompt": t, "add_special_tokens": False}) as r:
            if r.status != 200:
                raise SystemExit("error: the server has no /tokenize; pass --tokenizer DIR")
            body = await r.json()
            n = body.get("count", len(body.get("tokens", [])))
            return max(1, min(args.max_output, n))
    return list(await asyncio.gather(*(one(t) for t in refs)))


async def send(session, args, model: str, prompt: str, max_tokens: int, t_start: float):
    import aiohttp
    chat = args.endpoint.rstrip("/").endswith("/chat/completions")
    body = {"model": model, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": prompt}],
                "max_completion_tokens": max_tokens} if chat else
               {"prompt": prompt, "max_tokens": max_tokens})}
    if args.ignore_eos:
        body["ignore_eos"] = True
    rec = {"send": time.perf_counter() - t_start, "ttft": None, "itl": [], "latency": None,
           "prompt_tokens": None, "output_tokens": 0, "error": None, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with session.post(args.base_url + args.endpoint, json=body,
                                timeout=aiohttp.ClientTimeout(total=args.timeout)) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
            else:
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec["error"] = str(obj["error"])
                        break
                    now = time.perf_counter()
                    if obj.get("usage"):
                        rec["prompt_tokens"] = obj["usage"]["prompt_tokens"]
                        rec["output_tokens"] = obj["usage"]["completion_tokens"]
                    if any(c.get("text") or (c.get("delta") or {}).get("content")
                           for c in obj.get("choices", [])):
                        chunks += 1
                        if rec["ttft"] is None:
                            rec["ttft"] = now - t0
                        else:
                            rec["itl"].append(now - last)
                        last = now
    except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency"] = time.perf_counter() - t0
    rec["end"] = time.perf_counter() - t_start
    if not rec["output_tokens"]:
        rec["output_tokens"] = chunks            # a server without usage in the stream
    return rec


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    if rate == float("inf"):
        return np.zeros(n)
    theta = 1.0 / (rate * burstiness)
    return rng.gamma(burstiness, theta, n)


async def run(args, time_limit: Optional[float] = None) -> dict:
    """Send the requests and collect their records. ``time_limit``: seconds the requests may
    take from the first send (the set-up before it, counting output lengths, is not timed);
    past it they are cancelled and asyncio.TimeoutError is raised."""
    import aiohttp
    from tqdm import tqdm
    rng = random.Random(args.seed)
    data = build_dataset(args, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model
        if model is None:
            async with session.get(args.base_url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        need = [i for i, (_, _, n) in enumerate(data) if n < 0]
        if need:
            lens = await output_lengths(session, args, [data[i][1] for i in need])
            for i, n in zip(need, lens):
                data[i] = (data[i][0], data[i][1], n)
        gaps = arrival_gaps(len(data), args.request_rate, args.burstiness,
                            np.random.default_rng(args.seed))
        sem = asyncio.Semaphore(args.max_concurrency or len(data))
        bar = tqdm(total=len(data), desc="requests", unit="req", disable=args.no_progress)
        t_start = time.perf_counter()

        async def one(prompt, n):
            async with sem:
                rec = await send(session, args, model, prompt, n, t_start)
            bar.update(1)
            return rec

        async def send_all():
            tasks = []
            for (prompt, _, n), gap in zip(data, gaps):
                if gap > 0:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.ensure_future(one(prompt, n)))
            try:
                return await asyncio.gather(*tasks)
            finally:
                for task in tasks:       # cancelled (time limit): their requests are dropped
                    task.cancel()
        records = await asyncio.wait_for(send_all(), time_limit)
        duration = time.perf_counter() - t_start
        bar.close()
    return {"model": model, "duration": duration, "records": records}


def summarize(args, result: dict) -> dict:
    recs = result["records"]
    ok = [r for r in recs if r["error"] is None]
    dur = result["duration"]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok
            if r["ttft"] is not None and r["output_tokens"] > 1]
    itl = [x for r in ok for x in r["itl"]]
    e2el = [r["latency"] for r in ok]
    n_in = sum(r["prompt_tokens"] or 0 for r in ok)
    n_out = sum(r["output_tokens"] for r in ok)

    def stats(xs):
        return ({"mean": 1000 * float(np.mean(xs)), "median": 1000 * float(np.median(xs)),
                 "p99": 1000 * float(np.percentile(xs, 99))} if xs else
                {"mean": 0.0, "median": 0.0, "p99": 0.0})
    s = {"completed": len(ok), "failed": len(recs) - len(ok), "duration": dur,
         "total_input_tokens": n_in, "total_output_tokens": n_out,
         "request_throughput": len(ok) / dur, "output_throughput": n_out / dur,
         "total_token_throughput": (n_in + n_out) / dur,
         "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl),
         "e2el_ms": stats(e2el)}
    if args.goodput:
        slo = {k: float(v) / 1000 for k, v in (g.split(":") for g in args.goodput)}
        good = 0
        for r in ok:
            t = (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) \
                if r["ttft"] is not None and r["output_tokens"] > 1 else 0.0
            if ((r["ttft"] or 0) <= slo.get("ttft", float("inf")) and
                    t <= slo.get("tpot", float("inf")) and
                    r["latency"] <= slo.get("e2el", float("inf"))):
                good += 1
        s["request_goodput"] = good / dur
    return s


def print_block(s: dict) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}")]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
             ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for title, key, name in (("Time to First Token", "ttft_ms", "TTFT"),
                             ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
                             ("Inter-token Latency", "itl_ms", "ITL"),
                             ("End-to-end Latency", "e2el_ms", "E2EL")):
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{f'{label} {name} (ms):':<40}{s[key][stat]:<10.2f}")
    print("=" * w)


def main(argv=None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    summary = summarize(args, result)
    print_block(summary)
    if args.result_file:
        out = {"config": vars(args), "model": result["model"], "summary": summary,
               "records": result["records"]}
        Path(args.result_file).write_text(json.dumps(out, indent=1, default=str))
    sys.exit(1 if summary["completed"] == 0 else 0)


if __name__ == "__main__":
    main()
