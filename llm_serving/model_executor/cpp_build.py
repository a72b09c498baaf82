"""Builds the CPU backend's C++ kernels with the system compiler and loads them with ctypes.

A library is compiled once per (source, flags, compiler, CPU) into the kernel cache
(``$LLM_SERVING_HOME/kernels`` or ``~/.cache/llm_serving/kernels``) and reused afterwards.
Builds are atomic, so concurrent processes (one per WorkAgent) never load a half-written file.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from llm_serving.errors import LLMServingError

CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]


def cache_dir() -> Path:
    home = os.environ.get("LLM_SERVING_HOME")
    root = Path(home) if home else Path.home() / ".cache" / "llm_serving"
    return root / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


@lru_cache(maxsize=None)
def load_cpp_library(source: str) -> ctypes.CDLL:
    """Compile ``source`` (a .cpp path) if needed and return the loaded library."""
    src = Path(source)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise LLMServingError(
            "the CPU attention backend needs a C++ compiler to build its kernels, and none was "
            "found (install g++, e.g. `apt-get install g++`, or set CXX)")
    digest = hashlib.sha256()
    digest.update(src.read_bytes())
    digest.update(" ".join([cxx] + CXXFLAGS).encode())
    digest.update(_cpu_signature().encode())
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{src.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cxx, *CXXFLAGS, str(src), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise LLMServingError(f"building {src.name} failed:\n{' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))
