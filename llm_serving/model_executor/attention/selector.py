"""Which attention backend serves a device: a registry of backends by device name.

Each backend module imports the interface (``backend.py``); only this registry names them, and
it imports the chosen one when asked, so neither the interface nor the CPU path imports the
Ascend backend (which needs MindSpore's Ascend-only ops).
"""
from __future__ import annotations

import importlib

from llm_serving.model_executor.attention.backend import AttentionBackend

# device (as init_device names it) -> "module:class"
BACKENDS = {
    "CPU": "llm_serving.model_executor.attention.cpu:CPUAttentionBackend",
    "Ascend": "llm_serving.model_executor.attention.ascend:AscendAttentionBackend",
}


def get_attention_backend(device: str, num_heads: int, num_kv_heads: int, head_dim: int,
                          kv_cache_dtype: str = "auto", alibi_slopes=None) -> AttentionBackend:
    """The backend for ``device`` ("CPU" or "Ascend"), sized for one rank's heads, storing KV
    as ``kv_cache_dtype`` (resolved by EngineArgs; "auto": the backend's own), adding ALiBi
    biases when given those heads' ``alibi_slopes``."""
    module, _, name = BACKENDS.get(device, BACKENDS["CPU"]).partition(":")
    return getattr(importlib.import_module(module), name)(num_heads, num_kv_heads, head_dim,
                                                          kv_cache_dtype, alibi_slopes)
