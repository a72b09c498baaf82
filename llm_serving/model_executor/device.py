"""Which device MindSpore runs on, set once per process."""
from __future__ import annotations

import mindspore as ms

_device: str | None = None


def init_device(device: str = "auto", device_id: int = 0) -> str:
    """Select the MindSpore device. ``auto`` picks Ascend when MindSpore was built for it."""
    global _device
    if _device is not None:
        return _device
    if device == "auto":
        # The target MindSpore was built for: "Ascend" on an NPU build, "CPU" otherwise.
        device = ms.get_context("device_target")
    device = {"cpu": "CPU", "ascend": "Ascend", "npu": "Ascend"}.get(device.lower(), device)
    if device not in ("CPU", "Ascend"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'ascend', got {device!r}")
    try:
        ms.set_device(device, device_id) if device == "Ascend" else ms.set_device(device)
    except RuntimeError:
        # Something in this process already ran MindSpore: fine if it is the same device.
        if ms.get_context("device_target") != device:
            raise
    if device == "CPU":
        # Async dispatch threads fight the compute threads on small CPUs: ~10x slower.
        # Kernels that read tensors' memory directly also rely on it.
        ms.runtime.launch_blocking()
    _device = device
    return device


def current_device() -> str:
    return init_device()
