"""Which CPU this is, in one line: what every benchmark, the tuned config's header and the
GEMM notes name (the machines differ: Intel with AVX-512 and AMX, AMD with AVX-512, AMD with
AVX2 only)."""
from __future__ import annotations

import os

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, set]:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, flags


def cpu_flags() -> set:
    """The CPU's feature flags, as ``lscpu`` lists them (empty if /proc/cpuinfo is unreadable)."""
    return _cpuinfo()[1]


def cpu_description() -> str:
    """``lscpu``'s model name, the core count and which of avx2/avx512f/avx512_bf16/amx are
    present."""
    model, flags = _cpuinfo()
    have = [fl for fl in FLAGS if fl in flags]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(have) or 'none of avx2/avx512/amx'}"
