"""vLLM's KV cache residency metrics (``--kv-cache-metrics``): how long KV blocks live, how long
they sit unused before they are evicted, and the time between reuses of a block.

A fraction of the blocks the block manager hands out (``--kv-cache-metrics-sample``, vLLM's
default 0.01) is followed, each drawn at random as it is handed out. A followed block notes
when it was handed out and when the prefix cache last handed it to a request (its last four
hits). When the block manager takes it for new KV again (an eviction), its lifetime (from being
handed out), its idle time (since its last hit, or since being handed out) and the gaps between
its hits go into three histograms of ``EngineStats``. As in vLLM, a block counts as evicted
only with prefix caching on (without it a free block holds nothing anyone could find).

Blocks not drawn cost a random draw when handed out and a dictionary lookup on a hit; with the
flag off the block manager has no ``KVResidency`` and calls nothing. What is followed is at
most one entry per block, dropped when the block is evicted or the cache is reset.
"""
from __future__ import annotations

import random
import time
from collections import deque

from llm_serving.engine.metrics import EngineStats

# vLLM keeps a block's last four hits: three gaps at most per eviction.
_HITS_KEPT = 4


class _Followed:
    __slots__ = ("born", "hits")

    def __init__(self, now: float):
        self.born = now
        self.hits: deque[float] = deque(maxlen=_HITS_KEPT)


class KVResidency:
    def __init__(self, sample_rate: float, stats: EngineStats, evictions: bool = True):
        """``stats`` has the three histograms (``EngineStats.with_buckets``);
        ``evictions``: prefix caching is on (else nothing is ever recorded, as in vLLM)."""
        self.sample_rate = sample_rate
        self.stats = stats
        self.evictions = evictions
        self.followed: dict[int, _Followed] = {}

    def taken(self, block: int) -> None:
        """The block manager hands ``block`` out for new KV: what it held is evicted."""
        if self.evictions:
            followed = self.followed.pop(block, None)
            if followed is not None:
                self._record(followed)
        if random.random() < self.sample_rate:
            self.followed[block] = _Followed(time.monotonic())

    def hit(self, block: int) -> None:
        """The prefix cache hands ``block`` to a request."""
        followed = self.followed.get(block)
        if followed is not None:
            followed.hits.append(time.monotonic())

    def reset(self) -> None:
        """The KV is gone (prefix cache reset, restarted WorkAgent): follow nothing."""
        self.followed.clear()

    def _record(self, followed: _Followed) -> None:
        now, hits, st = time.monotonic(), list(followed.hits), self.stats
        st.kv_block_lifetime.observe(now - followed.born)
        st.kv_block_idle_before_evict.observe(now - (hits[-1] if hits else followed.born))
        for earlier, later in zip(hits, hits[1:]):
            st.kv_block_reuse_gap.observe(later - earlier)
