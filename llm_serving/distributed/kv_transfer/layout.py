"""Where one rank's KV blocks live in memory, as a transport sees them.

The CPU backend (model_executor/attention/cpu.py) holds each layer's cache as a key array and
a value array of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``, so block ``b`` of
one array is the contiguous byte range ``base + b * block_bytes``. A transfer of some blocks is
therefore, per array, one region per run of consecutive blocks: ``block_runs`` finds the runs
that are consecutive on both sides, so a whole prompt usually moves as one region per array.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    base_addrs: tuple          # per array (layer 0 K, layer 0 V, layer 1 K, ...): address
    block_bytes: int           # bytes of one block in one array
    num_blocks: int

    @classmethod
    def from_kv_caches(cls, kv_caches) -> "KVLayout":
        """From a list of per-layer (key, value) arrays, all of one shape and C-contiguous."""
        arrays = [a for kv in kv_caches for a in kv]
        if not arrays:
            raise ValueError("no KV arrays to transfer")
        shape = arrays[0].shape
        for a in arrays:
            if a.shape != shape or not a.flags.c_contiguous:
                raise ValueError("KV arrays must share one shape and be C-contiguous")
        return cls(tuple(int(a.ctypes.data) for a in arrays),
                   int(arrays[0].nbytes // shape[0]), int(shape[0]))

    @property
    def array_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def compatible(self, other: "KVLayout") -> bool:
        return (len(self.base_addrs), self.block_bytes) == (len(other.base_addrs),
                                                            other.block_bytes)

    def to_dict(self) -> dict:
        return {"base_addrs": list(self.base_addrs), "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(tuple(int(a) for a in d["base_addrs"]), int(d["block_bytes"]),
                   int(d["num_blocks"]))


def block_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """int64 [R, 3] of (first src block, first dst block, length): the runs where both block
    lists advance by one, in order."""
    src = np.asarray(src, np.int64)
    dst = np.asarray(dst, np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"block lists differ: {src.shape} vs {dst.shape}")
    if not len(src):
        return np.zeros((0, 3), np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def regions(local: KVLayout, remote: KVLayout, local_blocks, remote_blocks):
    """(local addresses, remote addresses, lengths) of every array's runs: the argument
    lists of a batched Mooncake transfer."""
    if not local.compatible(remote):
        raise ValueError(f"KV layouts differ: {len(local.base_addrs)} arrays of "
                         f"{local.block_bytes} B blocks here, {len(remote.base_addrs)} of "
                         f"{remote.block_bytes} B there")
    runs = block_runs(remote_blocks, local_blocks)        # (remote, local, n)
    if len(runs) and (runs[:, 1].min() < 0 or (runs[:, 1] + runs[:, 2]).max() > local.num_blocks
                      or runs[:, 0].min() < 0
                      or (runs[:, 0] + runs[:, 2]).max() > remote.num_blocks):
        raise ValueError("block id out of range")
    bb = local.block_bytes
    lbase = np.asarray(local.base_addrs, np.int64)[:, None]
    rbase = np.asarray(remote.base_addrs, np.int64)[:, None]
    laddr = (lbase + runs[:, 1][None, :] * bb).ravel()
    raddr = (rbase + runs[:, 0][None, :] * bb).ravel()
    lens = np.broadcast_to(runs[:, 2][None, :] * bb, (len(lbase), len(runs))).ravel()
    return laddr.tolist(), raddr.tolist(), lens.tolist()
