"""A file of this checkout as it was in a git revision: the "before" side of the kernel
benchmarks' ``--before REV`` comparisons (bench_linear.py, bench_attention_kernel.py)."""
from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def source_at(rev: str, rel: str):
    """``rel`` (a path in the repository) at ``rev``, in a temporary directory removed on exit
    (build and load it inside: the kernel cache keeps the library), under a name of its own.
    An unknown revision or path exits with git's message."""
    proc = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"--before {rev}: git cannot show {rel}: {proc.stderr.strip()}")
    rel_path = Path(rel)
    with tempfile.TemporaryDirectory(prefix="lls_before_") as d:
        path = Path(d) / f"{rel_path.stem}_before{rel_path.suffix}"
        path.write_text(proc.stdout)
        yield path
