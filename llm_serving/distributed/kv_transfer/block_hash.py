"""Block hashes that are the same in every process and on every machine.

The pool connector keys KV blocks by their prefix: block i's hash covers its tokens and
block i-1's hash (a chain, as the block manager's prefix cache does), plus a salt naming what
the KV depends on (model, block size, dtype, tensor-parallel rank). It is SHA-256 over the
token ids as little-endian int64, never Python's ``hash()``: that one is salted per process
for str/bytes and not guaranteed across versions or platforms, so two instances could
disagree, or collide, on a key. Only full blocks have hashes.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "",
                 num_blocks: int | None = None) -> list[str]:
    """Hex hashes of the first ``num_blocks`` full blocks (default: all full blocks)."""
    tokens = np.asarray(token_ids, dtype="<i8")
    full = len(tokens) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    parent = hashlib.sha256(salt.encode()).digest()
    out = []
    for i in range(n):
        h = hashlib.sha256(parent)
        h.update(tokens[i * block_size:(i + 1) * block_size].tobytes())
        parent = h.digest()
        out.append(h.hexdigest())
    return out
