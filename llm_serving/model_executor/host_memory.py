"""Host memory on 2 MB pages for what the CPU kernels stream through at every step: the KV
cache (``attention.cpu.host_zeros``) and the packed weights (``WEIGHTS``, a ``WeightArena``).

Transparent huge pages are given, in the kernel's usual "madvise" mode, only to mappings that
ask for them. NumPy asks only for its arrays of 4 MB and up, so most of a small model's
weights sat on 4 KB pages, and a decode step's read of the 97 M benchmark model (195 MB in
bf16) crossed about 24 k 4 KB pages, each a TLB miss and a stop for the hardware
prefetchers. With the weights here, one engine of each kind in one process, steps interleaved
(AMD Zen 4): bf16 B=1 -3 to -7%, fp32 B=1 -3 to -4%, bf16 B=16 -1 to -4%, B=64 -1 to -3%. Where
the kernel has no huge pages, the same memory comes on 4 KB pages and works the same.
"""
from __future__ import annotations

import mmap
import threading

import numpy as np

HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting on a 2 MB boundary, in an anonymous mapping advised for huge
    pages. Nothing is committed until touched; the mapping is unmapped when the last array
    viewing it is gone."""
    mem = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mem.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):       # no THP on this kernel or platform: 4 KB pages
        pass
    raw = np.frombuffer(mem, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE     # whole huge pages from the first byte
    return raw[start:start + nbytes]


class WeightArena:
    """Packed weights, placed one after another in huge-page chunks (``chunk_bytes``, or one
    weight's size when larger), each array aligned to ``align`` bytes. A chunk's memory is
    committed as weights fill it, and freed when every weight carved from it is gone (the
    arena only holds the chunk it is filling). For weights that live as long as their model:
    a temporary array would keep its chunk's other weights' memory alive, not the other way
    round, but it is never reused while that chunk lives."""

    def __init__(self, chunk_bytes: int = 64 << 20, align: int = 64):
        self.chunk_bytes, self.align = chunk_bytes, align
        self._chunk: np.ndarray | None = None
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` in the arena."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = -(-max(nbytes, 1) // self.align) * self.align
        with self._lock:
            if self._chunk is None or self._used + size > len(self._chunk):
                self._chunk = huge_page_buffer(max(self.chunk_bytes,
                                                   -(-size // HUGE_PAGE) * HUGE_PAGE))
                self._used = 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += size
        return out.view(dtype).reshape(shape)


# The packed weights of the models of this process (layers.linear packs into it).
WEIGHTS = WeightArena()
