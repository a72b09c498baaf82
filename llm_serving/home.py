"""Where llm_serving keeps what it writes for itself: generated models, compiled kernels and
the GEMM choices, under ``$LLM_SERVING_HOME`` if the variable is set, else
``~/.cache/llm_serving``."""
from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    home = os.environ.get("LLM_SERVING_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "llm_serving"
