"""The attention backend interface.

A backend owns the KV cache layout and the attention kernels. The model runner builds one
``AttentionMetadata`` per step from host arrays; the backend turns it into whatever its
kernels want (``prepare``), and each ``Attention`` layer calls ``forward`` with its own
layer's cache, found in the forward context by layer index.

A batch is ragged: sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``
and, after this step, holds ``seq_lens[s]`` tokens of context. New prefills, prefill chunks
that continue from cached tokens, and decodes (one row) mix freely, with no padding.

Backends are found by device in ``selector.py``; this module imports none of them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np


@dataclass
class AttentionMetadata:
    slot_mapping: np.ndarray      # int32 [T]: cache slot (block * block_size + offset) per token
    block_tables: np.ndarray      # int32 [S, max_blocks]: physical blocks of each sequence
    query_start_loc: np.ndarray   # int32 [S + 1]: first query row of each sequence
    seq_lens: np.ndarray          # int32 [S]: context length after this step
    block_size: int
    prepared: Any = None          # the backend's own per-step form (device tensors etc.)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


class AttentionBackend(ABC):
    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 kv_cache_dtype: str = "auto", alibi_slopes: Optional[np.ndarray] = None):
        """``alibi_slopes``: None, or float32 [num_heads], this rank's heads' ALiBi slopes
        (``alibi.py``): every score then gets slope * (key position - query position)."""
        self.kv_cache_dtype = kv_cache_dtype
        self.alibi_slopes = alibi_slopes
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          kv_cache_dtype: Optional[str] = None) -> Any:
        """One layer's (key cache, value cache), stored as ``kv_cache_dtype`` (None: the
        backend's; a layer kv_cache_dtype_skip_layers names gets auto's). The kernels read
        each layer's storage from its cache."""

    def allocate_host_cache(self, num_blocks: int, block_size: int,
                            kv_cache_dtype: Optional[str] = None) -> Any:
        """One layer's (key, value) blocks in host memory, the pool swapped-out KV goes to."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    @abstractmethod
    def swap_out(self, kv_cache, host_cache, pairs: np.ndarray) -> None:
        """Copy device blocks to host blocks: pairs is int32 [K, 2] of (device, host)."""

    @abstractmethod
    def swap_in(self, host_cache, kv_cache, pairs: np.ndarray) -> None:
        """Copy host blocks to device blocks: pairs is int32 [K, 2] of (host, device)."""

    @abstractmethod
    def copy_blocks(self, kv_cache, pairs: np.ndarray) -> None:
        """Copy device blocks within one layer's cache: pairs is int32 [K, 2] of (src, dst)."""

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Convert host metadata to the kernels' form once per step (not once per layer)."""
        return metadata

    @abstractmethod
    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata):
        """q: [T, H*D], k/v: [T, KVH*D]. Write k/v into the cache, return [T, H*D]."""
