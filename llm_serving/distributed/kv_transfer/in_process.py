"""InProcessConnector: two engines in one process hand KV blocks over directly (tests).

The producer's worker registers its KV arrays in a process-wide registry under its engine
id; a consumer's worker copies the offered blocks out of them with numpy. It follows the same
protocol as the Mooncake connector (offer with an expiry, read, tell the producer it is done,
deferred release on both sides, per-transfer timeout), so the engine paths are the same.

``kv_connector_extra_config.load_delay`` (seconds) makes every read take that long before it
lands: a read whose delay passes ``kv_transfer_timeout`` times out (the fault tests).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.distributed.kv_transfer.base import KVConnectorRole
from llm_serving.distributed.kv_transfer.block_transfer import BlockTransferScheduler

# engine id -> the producer's worker side (its KV arrays and held transfers).
_PRODUCERS: dict[str, "InProcessConnector"] = {}


@dataclass
class _Read:
    params: dict
    remote: list
    local: list
    lands_at: float
    deadline: float


class InProcessConnector(BlockTransferScheduler):
    def __init__(self, config, role, block_size, rank=0, tp_size=1, engine_id=None):
        super().__init__(config, role, block_size, rank, tp_size)
        self._init_scheduler_side()
        if engine_id is not None:
            self.engine_id = engine_id
        self.load_delay = float(config.extra("load_delay", 0.0))
        self.kv_caches: Optional[list] = None
        self._held: dict[str, float] = {}        # transfer id -> expires_at (producer)
        self._read_done: set = set()             # transfer ids a reader finished
        self._released = collections.deque(maxlen=4096)   # transfer ids freed (recent)
        self._reads: dict[str, _Read] = {}       # key -> read in flight (consumer)
        self._sent: set = set()
        self._recved: set = set()

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches
        if self.role is KVConnectorRole.WORKER and self.config.is_producer:
            _PRODUCERS[self.engine_id] = self

    def handshake_info(self) -> dict:
        return {"engine_id": self.engine_id}

    def start_load_kv(self, forward_context=None) -> None:
        md = self._metadata
        if md is None:
            return
        now = time.time()
        for tid, save in md.saves.items():
            self._held[tid] = float(save["expires_at"])
        for tid, p in md.declines.items():          # as if read: freed at the next poll
            producer = _PRODUCERS.get(p.get("remote_engine_id"))
            if producer is not None:
                producer._read_done.add(tid)
        for key, load in md.loads.items():
            deadline = min(now + load["timeout"], float(load["params"].get("expires_at", 0)))
            self._reads[key] = _Read(load["params"], load["remote_block_ids"],
                                     load["local_block_ids"], now + self.load_delay, deadline)

    def _poll_reads(self, now: float) -> None:
        for key, r in list(self._reads.items()):
            producer = _PRODUCERS.get(r.params.get("remote_engine_id"))
            tid = r.params.get("transfer_id")
            if producer is None or tid in producer._released:
                self._fail(key, "the producer does not hold this transfer (gone, expired or "
                                "already read)")
            elif now >= r.deadline:
                self._fail(key, f"KV transfer {tid} timed out")
            elif _dtypes(producer.kv_caches) != _dtypes(self.kv_caches):
                self._fail(key, f"the producer's KV cache holds {_dtypes(producer.kv_caches)}"
                                f", this one {_dtypes(self.kv_caches)} (kv_cache_dtype and "
                                "kv_cache_dtype_skip_layers must match)")
            elif now >= r.lands_at and tid in producer._held:   # (its offer may come later)
                src, dst = np.asarray(r.remote), np.asarray(r.local)
                for (pk, pv), (ck, cv) in zip(producer.kv_caches, self.kv_caches):
                    ck[dst] = pk[src]
                    cv[dst] = pv[src]
                    self._bytes += 2 * pk[src].nbytes
                producer._read_done.add(tid)
                self._recved.add(key)
                del self._reads[key]

    def _fail(self, key: str, reason: str) -> None:
        self._failed[key] = reason
        self._recved.add(key)             # nothing writes into its blocks any more
        del self._reads[key]

    def _poll_sent(self, now: float) -> None:
        for tid, expires_at in list(self._held.items()):
            if tid in self._read_done or now >= expires_at:
                del self._held[tid]
                self._read_done.discard(tid)
                self._released.append(tid)
                self._sent.add(tid)

    def get_finished(self, finished_req_ids: set) -> tuple[set, set]:
        now = time.time()
        self._poll_reads(now)
        self._poll_sent(now)
        sent, recved = self._sent, self._recved
        self._sent, self._recved = set(), set()
        return sent, recved


    def has_work(self) -> bool:
        return bool(self._reads or self._held)

    def shutdown(self) -> None:
        if _PRODUCERS.get(self.engine_id) is self:
            del _PRODUCERS[self.engine_id]


def _dtypes(kv_caches) -> str:
    """The layers' KV storage dtypes, as one string: layer by layer when they differ."""
    names = [str(k.dtype) for k, _ in kv_caches]
    return names[0] if len(set(names)) == 1 else "[" + ", ".join(names) + "]"
