#!/usr/bin/env python
"""Plots from either load tester's JSON: a request timeline (send, first token and end of each
request) and latency CDFs (TTFT and end to end), as PNG files.

    python clients/plot_results.py RESULT.json [--out DIR]

RESULT.json is benchmark_serving's ``--result-file`` or performance_serving's
``result_{X}_x.timeline.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_records(path: Path) -> list[dict]:
    """Records with send (s from start), ttft (s) and latency (s), successes only."""
    data = json.loads(path.read_text())
    records = data["records"] if isinstance(data, dict) else data
    out = []
    for r in records:
        if r.get("error"):
            continue
        ttft = r.get("ttft", r.get("first_token_time"))
        latency = r.get("latency", r.get("res_time"))
        if r.get("send") is None or ttft is None or latency is None:
            raise SystemExit(f"error: {path} has no send times (performance_serving: use its "
                             "result_*.timeline.json)")
        out.append({"send": r["send"], "ttft": ttft, "latency": latency})
    if not out:
        raise SystemExit(f"error: {path} holds no successful request")
    return out


def plot(records: list[dict], out_dir: Path, title: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = sorted(records, key=lambda r: r["send"])
    fig, ax = plt.subplots(figsize=(10, max(3, min(12, len(recs) * 0.05 + 2))))
    for i, r in enumerate(recs):
        first, end = r["send"] + r["ttft"], r["send"] + r["latency"]
        ax.plot([r["send"], first], [i, i], color="tab:orange", lw=1.5)
        ax.plot([first, end], [i, i], color="tab:blue", lw=1.5)
    ax.set_xlabel("seconds from start")
    ax.set_ylabel("request (by send time)")
    ax.set_title(f"{title}: waiting for the first token (orange), generating (blue)")
    timeline = out_dir / "timeline.png"
    fig.tight_layout()
    fig.savefig(timeline, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("ttft", "time to first token"), ("latency", "end to end")):
        xs = np.sort([1000 * r[key] for r in recs])
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title}: latency CDF ({len(recs)} requests)")
    ax.grid(alpha=0.3)
    ax.legend()
    cdf = out_dir / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(cdf, dpi=120)
    plt.close(fig)
    return [timeline, cdf]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default: beside the JSON")
    args = ap.parse_args(argv)
    out = args.out or args.result.with_suffix("")
    for p in plot(load_records(args.result), out, args.result.stem):
        print(p)


if __name__ == "__main__":
    main()
