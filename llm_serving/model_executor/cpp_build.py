"""Builds the CPU backend's C++ kernels with the system compiler and loads them with ctypes.

A library is compiled once per (source, flags, compiler and its version, CPU) into the kernel
cache (``$LLM_SERVING_HOME/kernels`` or ``~/.cache/llm_serving/kernels``) and reused
afterwards. Builds are atomic, so concurrent processes (one per WorkAgent) never load a
half-written file. ``LLM_SERVING_CXX`` picks the compiler (default ``g++``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from llm_serving.errors import LLMServingError
from llm_serving.home import home_dir

# Flags every kernel library gets; a caller adds its own (e.g. -fopenmp, -D...).
BASE_FLAGS = ("-O3", "-std=c++17", "-march=native", "-fPIC", "-shared", "-fno-math-errno")


class KernelBuildError(LLMServingError, RuntimeError):
    """A C++ kernel library could not be compiled or loaded."""


def kernel_cache_dir() -> Path:
    return home_dir() / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("LLM_SERVING_CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise KernelBuildError(
            f"The CPU kernels need a C++ compiler, but '{cxx}' was not found on PATH. "
            "Install g++ (Debian/Ubuntu: apt-get install g++) or set LLM_SERVING_CXX to a "
            "g++-compatible compiler.")
    return path


@lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"Could not run the C++ compiler '{cxx}': {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else ""


@lru_cache(maxsize=None)
def _cpu_signature() -> str:
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith("flags"):
                    flags = line.split(":", 1)[1].strip()
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def build_library(source: Path, flags: Sequence[str] = (), force: bool = False) -> Path:
    """Compile ``source`` with BASE_FLAGS + ``flags`` if needed; return the library's path."""
    source = Path(source)
    cxx = _compiler()
    flags = list(BASE_FLAGS) + list(flags)
    h = hashlib.sha256()
    for part in (source.read_bytes(), cxx.encode(), _compiler_version(cxx).encode(),
                 " ".join(flags).encode(), _cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    out_dir = kernel_cache_dir()
    target = out_dir / f"{source.stem}_{h.hexdigest()[:20]}.so"
    if target.exists() and not force:
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(
            f"Cannot write to the kernel cache directory {out_dir} (set LLM_SERVING_HOME to a "
            f"writable directory): {e}") from e
    cmd = [cxx, *flags, str(source), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise KernelBuildError(f"Compiling {source.name} failed:\n  " + " ".join(cmd)
                                   + "\n" + proc.stderr[-4000:])
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)   # atomic: concurrent builders each install a complete file
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"Compiling {source.name} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_libs: dict = {}
_lock = threading.Lock()


def load_cpp_library(source, flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Build (if needed) and load ``source``; one loaded library per (source, flags)."""
    key = (str(source), tuple(flags))
    with _lock:
        lib = _libs.get(key)
        if lib is None:
            path = build_library(Path(source), flags)
            try:
                lib = _libs[key] = ctypes.CDLL(str(path))
            except OSError as e:
                raise KernelBuildError(f"Could not load the kernel library {path}: {e}") from e
    return lib
