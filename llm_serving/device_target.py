"""What ``--device auto`` means on this machine, decided without importing MindSpore.

MindSpore picks its device when it is imported: "Ascend" when its Ascend plugin loads, which
needs CANN's runtime and driver libraries on the library path (CANN's set_env.sh puts them
there), else "CPU". The serving master never runs the model (its WorkAgents do), so it
decides the same way from the files instead of paying MindSpore's import (seconds, and
hundreds of MiB) for one word; the agents are then told the device it decided. A process that
has already imported MindSpore (the in-process engine) asks it.
"""
from __future__ import annotations

import os
import sys
from importlib.util import find_spec
from pathlib import Path

# Libraries MindSpore's Ascend plugin links against and cannot load without: CANN's runtime
# and the NPU driver's.
CANN_LIBRARIES = ("libascendcl.so", "libascend_hal.so")
_SYSTEM_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib")


def auto_device_target() -> str:
    """"Ascend" or "CPU": the device MindSpore would select here."""
    ms = sys.modules.get("mindspore")
    if ms is not None:
        return ms.get_context("device_target")
    if has_ascend_plugin() and all(on_library_path(name) for name in CANN_LIBRARIES):
        return "Ascend"
    return "CPU"


def has_ascend_plugin() -> bool:
    """Whether the installed MindSpore was built with its Ascend plugin."""
    spec = find_spec("mindspore")
    if spec is None or spec.origin is None:
        return False
    return any((Path(spec.origin).parent / "lib" / "plugin").glob("libmindspore_ascend.so*"))


def on_library_path(name: str) -> bool:
    """Whether the dynamic loader would find library ``name``: in $LD_LIBRARY_PATH, in the
    loader's cache (ldconfig), or in a system directory."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    if any(os.path.exists(os.path.join(d, name)) for d in dirs + list(_SYSTEM_DIRS)):
        return True
    try:
        return name.encode() in Path("/etc/ld.so.cache").read_bytes()
    except OSError:
        return False
