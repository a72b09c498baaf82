"""Which CPU this is, in one line: what every benchmark, the tuned config's header and the
GEMM notes name (the machines differ: Intel with AVX-512 and AMX, AMD with AVX-512, AMD with
AVX2 only)."""
from __future__ import annotations

import os

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, set, str]:
    """(``lscpu``'s model name, the feature flags, "family F model M" or "")."""
    model, flags, ids = "unknown CPU", set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key in ("cpu family", "model") and key not in ids:
                    ids[key] = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    family = (f"family {ids['cpu family']} model {ids['model']}"
              if len(ids) == 2 else "")
    return model, flags, family


def cpu_flags() -> set:
    """The CPU's feature flags, as ``lscpu`` lists them (empty if /proc/cpuinfo is unreadable)."""
    return _cpuinfo()[1]


def cpu_description() -> str:
    """``lscpu``'s model name with its family and model numbers (what tells AMD's Zen 4, family
    25 model 17, from Zen 5, family 26, which ``lscpu`` names alike), the core count and which
    of avx2/avx512f/avx512_bf16/amx are present."""
    model, flags, family = _cpuinfo()
    have = [fl for fl in FLAGS if fl in flags]
    return (f"{model}{f' ({family})' if family else ''}, {os.cpu_count()} cores, flags: "
            f"{' '.join(have) or 'none of avx2/avx512/amx'}")
