"""A file of this checkout as it was in a git revision: the "before" side of the kernel
benchmarks' ``--before REV`` comparisons (bench_linear.py, bench_attention_kernel.py)."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_at(rev: str, rel: str) -> Path:
    """``rel`` (a path in the repository) at ``rev``, written to a new temporary directory
    under a name of its own (so a build cache keyed by path and content keeps both sides)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], check=True,
                          capture_output=True, text=True).stdout
    rel_path = Path(rel)
    path = Path(tempfile.mkdtemp(prefix="lls_before_")) / f"{rel_path.stem}_before{rel_path.suffix}"
    path.write_text(text)
    return path
