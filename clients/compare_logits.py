#!/usr/bin/env python
"""Compare two logits dumps (``--dump-logits DIR`` runs): pair the files by name and report
every file that differs beyond the tolerance or has no partner.

    python clients/compare_logits.py DIR_A DIR_B [--atol 5e-3] [--rtol 0]

Exit status 0 when every file pairs and matches (np.allclose), 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def compare(a: Path, b: Path, atol: float, rtol: float) -> dict:
    names_a = {p.name for p in a.glob("*.npy")}
    names_b = {p.name for p in b.glob("*.npy")}
    mismatches = []
    for name in sorted(names_a & names_b):
        x, y = np.load(a / name), np.load(b / name)
        if x.shape != y.shape:
            mismatches.append((name, f"shape {x.shape} vs {y.shape}"))
        elif not np.allclose(x, y, atol=atol, rtol=rtol):
            diff = np.abs(x.astype(np.float64) - y)
            mismatches.append((name, f"max |diff| {diff.max():.3g} at id {int(diff.argmax())}"))
    return {"paired": len(names_a & names_b), "only_a": sorted(names_a - names_b),
            "only_b": sorted(names_b - names_a), "mismatches": mismatches}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--atol", type=float, default=5e-3)
    ap.add_argument("--rtol", type=float, default=0.0)
    args = ap.parse_args(argv)
    for d in (args.a, args.b):
        if not d.is_dir():
            ap.error(f"{d}: no such directory (a dump_logits directory is expected)")
    r = compare(args.a, args.b, args.atol, args.rtol)
    for name, why in r["mismatches"]:
        print(f"MISMATCH {name}: {why}")
    for side, names in (("A", r["only_a"]), ("B", r["only_b"])):
        for name in names:
            print(f"ONLY IN {side} {name}")
    bad = len(r["mismatches"]) + len(r["only_a"]) + len(r["only_b"])
    print(f"{r['paired']} files paired, {len(r['mismatches'])} mismatched "
          f"(atol={args.atol}, rtol={args.rtol}), {len(r['only_a']) + len(r['only_b'])} "
          "unpaired")
    sys.exit(1 if bad or not r["paired"] else 0)


if __name__ == "__main__":
    main()
