"""CPU attention backend: the reference. Hand-written paged-attention kernels (kernels/) take
one ragged batch of new prefills, continuing prefill chunks and decodes, with no padding: the
work follows the real token and context counts. The KV cache lives in host memory owned by
this backend, one ``[num_blocks, block_size, KVH, D]`` array per layer for keys and values,
float32, or with ``kv_cache_dtype`` float16 or bfloat16 (bits in uint16) half of it, FP8 a
quarter: the kernels write K/V rounded to nearest even and widen them on read (fp32
arithmetic). Each call's kernel follows its layer's cache dtype, so layers of different
dtypes (kv_cache_dtype_skip_layers) share one backend. The swap
pool uses the same storage, so block moves and KV transfers copy bytes as they are. ALiBi
(Baichuan2-13B) is the kernels' too: given ``alibi_slopes``, each tile of scores gets its
slope * (key position - query position) before the online softmax, in every kind of row, so
chunked prefills, decodes and replayed CPU graphs need nothing else.
"""
from __future__ import annotations

import mmap

import numpy as np

from llm_serving.errors import ConfigError
from llm_serving.model_executor.attention import kernels
from llm_serving.model_executor.attention.backend import AttentionBackend, AttentionMetadata
from llm_serving.model_executor.host_memory import HUGE_PAGE, huge_page_buffer


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, num_heads, num_kv_heads, head_dim, kv_cache_dtype="auto",
                 alibi_slopes=None):
        if alibi_slopes is not None:        # the kernels read it by address at every call
            alibi_slopes = np.ascontiguousarray(alibi_slopes, np.float32)
        super().__init__(num_heads, num_kv_heads, head_dim, kv_cache_dtype, alibi_slopes)
        self.storage = self._storage(kv_cache_dtype)

    @staticmethod
    def _storage(kv_cache_dtype: str) -> np.dtype:
        dtype = "float32" if kv_cache_dtype == "auto" else kv_cache_dtype
        if dtype not in kernels.CACHE_DTYPES:
            raise ValueError(f"the CPU attention kernels store KV as "
                             f"{' or '.join(kernels.CACHE_DTYPES)}, not {kv_cache_dtype}")
        return kernels.CACHE_DTYPES[dtype]

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_cache_dtype=None):
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        storage = self.storage if kv_cache_dtype is None else self._storage(kv_cache_dtype)
        return host_zeros(shape, storage), host_zeros(shape, storage)

    def allocate_host_cache(self, num_blocks: int, block_size: int, kv_cache_dtype=None):
        # The swap pool (swap_space GiB) stays lazily zeroed: its pages are committed only
        # when swapped-out blocks land in them, which may be never.
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        storage = self.storage if kv_cache_dtype is None else self._storage(kv_cache_dtype)
        return np.zeros(shape, storage), np.zeros(shape, storage)

    # The device cache is host memory here, so all three moves are array copies.
    def swap_out(self, kv_cache, host_cache, pairs):
        for dev, host in zip(kv_cache, host_cache):
            host[pairs[:, 1]] = dev[pairs[:, 0]]

    def swap_in(self, host_cache, kv_cache, pairs):
        for host, dev in zip(host_cache, kv_cache):
            dev[pairs[:, 1]] = host[pairs[:, 0]]

    def copy_blocks(self, kv_cache, pairs):
        for cache in kv_cache:
            cache[pairs[:, 1]] = cache[pairs[:, 0]]

    def prepare(self, md: AttentionMetadata) -> AttentionMetadata:
        for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
            arr = getattr(md, name)
            if arr.dtype != np.int32 or not arr.flags.c_contiguous:
                setattr(md, name, np.ascontiguousarray(arr, dtype=np.int32))
        return md

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata):
        k_cache, v_cache = kv_cache
        return kernels.attention_forward(q, k, v, k_cache, v_cache, md.slot_mapping,
                                         md.block_tables, md.query_start_loc, md.seq_lens,
                                         self.scale, self.alibi_slopes)


def host_zeros(shape, dtype) -> np.ndarray:
    """A zeroed cache array, its memory committed now and, where the kernel allows it
    (transparent huge pages in "madvise" mode, the usual default), on 2 MB pages.

    np.zeros would leave every page to be faulted in and zeroed by the first step that writes
    its block (a fresh server's first requests pay for it: page clearing was ~5% of a bf16
    prefill's time, perf, AMD Zen 4), and on 4 KB pages every 16-position block of a layer
    spans a dozen of them, for the attention's scattered block reads to miss the TLB on.
    Committing the whole cache at start-up also fails there, not mid-run, when it does not
    fit in memory: with a ConfigError naming kv_cache_space, before any of it is mapped, when
    the array is larger than the memory the kernel reports available."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return np.zeros(shape, dtype)
    avail = _available_memory()
    if avail is not None and nbytes > avail:
        raise ConfigError("kv_cache_space", f"the KV cache does not fit in memory: one layer's K "
                          f"or V takes {nbytes / 2**30:.2f} GiB, {avail / 2**30:.2f} GiB is "
                          "available; lower kv_cache_space (or num_blocks)")
    flat = huge_page_buffer(nbytes)
    flat[::mmap.PAGESIZE] = 0               # fault every page in (anonymous memory is zero)
    return flat.view(dtype).reshape(shape)


def _available_memory() -> int | None:
    """Bytes of memory the kernel reports available for new allocations (Linux MemAvailable),
    or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
