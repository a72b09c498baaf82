"""The engine's side of KV transfer (PD disaggregation): requests whose KV comes from, or
goes to, another instance, around the scheduler-side connector (distributed/kv_transfer).

Consumer. A waiting request with ``do_remote_prefill`` parameters asks the connector how
many of its prompt tokens the producer holds. The scheduler allocates blocks for them and
the request waits in ``WAITING_FOR_REMOTE_KVS``: out of the waiting queue and the batch, so it
holds no batch slot and blocks nobody. The step's connector metadata tells the workers to
read; when every rank reports the read done, the tokens count as computed and the request
queues again to compute the rest of its prompt (at least the last token) and decode. A read
that fails or times out follows ``kv_failure_policy``: ``recompute`` (the request computes its
prefill here; logged and counted) or ``fail`` (a clear error). Blocks a failed or abandoned
read may still write into stay allocated until the workers say the read ended.

Producer. A request with ``do_remote_decode`` that finishes keeps its transferable blocks
allocated (deferred release) and returns the connector's ``kv_transfer_params``; the blocks
are freed when every rank reports the transfer sent (the reader is done, or it expired after
``kv_transfer_timeout``), on abort and client disconnect as well. A consumer that will not
read an offer (its own prefix cache holds the tokens, the offer does not fit, the request
scores its prompt or ends first) tells the producer, which frees the blocks at once.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import defaultdict
from typing import Optional

from llm_serving.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorOutput,
                                                      KVTransferError)
from llm_serving.distributed.kv_transfer.config import KVTransferConfig
from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)
BACKSTOP_GRACE_S = 10.0      # beyond kv_transfer_timeout / the offer's ttl (the workers' own)


class RemoteKV:
    def __init__(self, connector: KVConnectorBase, config: KVTransferConfig,
                 block_manager: BlockManager, tp_size: int):
        self.connector = connector
        self.config = config
        self.bm = block_manager
        self.stats = block_manager.stats
        self.tp_size = tp_size
        self.loading: dict[str, Sequence] = {}          # load key -> request waiting for it
        self.held_loads: dict[str, list[int]] = {}      # load key -> blocks of an ended request
        self.held_sends: dict[str, list[int]] = {}      # transfer id -> blocks offered
        self._counts: dict[str, int] = defaultdict(int)     # ranks that reported a key
        # Backstops, should the workers never report a transfer (they time out themselves):
        # when a load is given up, and when an offer's blocks are freed anyway.
        self._load_deadline: dict[str, float] = {}
        self._send_deadline: dict[str, float] = {}
        self._next_check = 0.0

    # ---- state ----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Transfers are in flight: the engine keeps polling its workers."""
        return bool(self.loading or self.held_loads or self.held_sends
                    or self.connector.has_pending_meta())

    @property
    def num_blocks_held(self) -> int:
        return sum(map(len, self.held_sends.values())) + sum(map(len, self.held_loads.values()))

    # ---- consumer: admission --------------------------------------------------------------
    def wants_load(self, seq: Sequence) -> bool:
        """A request that scores its prompt (prompt logprobs) computes every prompt row."""
        return (not seq.kv_remote_done and seq.index == 0 and seq.prompt_logprobs is None
                and self.connector.wants_remote_lookup(seq))

    def num_external_tokens(self, seq: Sequence, num_computed: int) -> Optional[int]:
        """Prompt tokens to load (0: none, and the request computes them itself; None: not
        known yet, ask again at a later step)."""
        try:
            n, is_async = self.connector.get_num_new_matched_tokens(seq, num_computed)
            if n is None:
                return None
        except (ValueError, KeyError, TypeError, KVTransferError) as e:
            self._count("failed")
            self.stats.kv_transfer_recomputes += 1
            seq.kv_remote_done = True
            self.connector.request_not_loaded(seq)
            logger.warning("request %s: its KV cannot be loaded (%s); computing its prefill",
                           seq.request_id, e)
            return 0
        if n <= 0 or not is_async:
            seq.kv_remote_done = True
        if n <= 0:              # its own prefix cache holds what the producer offers
            self.connector.request_not_loaded(seq)
        return n if is_async else 0

    def decline(self, params: dict) -> None:
        """An offer (a request's ``kv_transfer_params``) that no request here will read: the
        request was refused before it was queued. The producer is told with the next step;
        a malformed offer (the reason it was refused, maybe) is dropped: the workers could not
        use it."""
        try:
            self.connector.check_offer(params)
        except ValueError:
            return
        self.connector.decline_offer(params)

    def start_load(self, seq: Sequence, num_external: int) -> None:
        """The scheduler allocated the blocks: wait for them to arrive."""
        self.connector.update_state_after_alloc(seq, seq.block_table, num_external)
        key = self.connector.load_key(seq)
        seq.kv_load_key, seq.kv_external_tokens = key, num_external
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.loading[key] = seq
        self._load_deadline[key] = (time.time() + float(self.config.kv_transfer_timeout)
                                    + BACKSTOP_GRACE_S)

    # ---- producer and abort: a sequence ends ----------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> bool:
        """Called as the scheduler ends a sequence, before its blocks are freed; True when
        this took the blocks over (freed later)."""
        if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            key = seq.kv_load_key
            del self.loading[key]
            if self.connector.request_load_done(seq):      # never handed to the workers
                self.connector.request_not_loaded(seq)
                self.bm.free(seq)
            else:                    # the read may still write: keep them until it ends
                self.held_loads[key] = self.bm.detach(seq)
            return True
        if seq.index != 0:
            return False
        if not seq.kv_remote_done and self.connector.wants_remote_lookup(seq):
            self.connector.request_not_loaded(seq)      # it ended before, or scored its prompt
        if status not in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
            self.connector.forget(seq)          # aborted: nothing to offer
            return False
        try:
            delay, params = self.connector.request_finished(seq, list(seq.block_table))
        except Exception as e:   # noqa: BLE001 - the offer failed (bound): no transfer
            logger.warning("request %s: no KV offered (%s)", seq.request_id, e)
            delay, params = False, None
        seq.kv_transfer_params_out = params
        if not delay:
            return False
        blocks = self.bm.detach(seq)
        k = len(params["remote_block_ids"])
        self.bm.release_blocks(blocks[k:])        # only the offered blocks are held
        self.held_sends[params["transfer_id"]] = blocks[:k]
        # A reader stops reading at the offer's end (ttl); past it (and a grace) the blocks
        # are free.
        self._send_deadline[params["transfer_id"]] = (time.time() + float(params["ttl"])
                                                      + BACKSTOP_GRACE_S)
        self.stats.kv_transfers_offered += 1
        return True

    # ---- after a step: what the workers reported ------------------------------------------
    def update(self, outputs: list[KVConnectorOutput],
               waiting: list, rank_key) -> list[tuple[Sequence, str]]:
        """Apply the workers' reports: free the blocks of finished sends, requeue requests
        whose KV arrived (into ``waiting``, sorted by ``rank_key``), handle failures. Returns
        the requests to fail (policy ``fail``) with the reason."""
        merged = KVConnectorOutput()
        for o in outputs:
            merged.failed.update(o.failed)
            merged.bytes += o.bytes
            merged.sent += self._complete(o.sent)
            merged.recved += self._complete(o.recved)
        now = time.time()
        if now >= self._next_check and (self._load_deadline or self._send_deadline):
            self._next_check = now + 0.5
            self._backstop(now, merged)      # after the reports: a late report still counts
        if not merged:
            return []
        self.connector.update_connector_output(merged)
        self.stats.kv_transfer_bytes += merged.bytes
        for tid in merged.sent:
            blocks = self.held_sends.pop(tid, None)
            if blocks is not None:
                self.bm.release_blocks(blocks)
        to_fail = []
        for key, reason in merged.failed.items():
            seq = self.loading.pop(key, None)
            if seq is None:
                continue
            self._count("timeout" if "timed out" in reason else "failed")
            self.connector.request_load_done(seq)
            self.held_loads[key] = self.bm.detach(seq)        # freed once the read ended
            seq.kv_remote_done, seq.kv_external_tokens = True, 0
            seq.status = SequenceStatus.WAITING
            if self.config.kv_failure_policy == "recompute":
                self.stats.kv_transfer_recomputes += 1
                logger.warning("request %s: KV transfer failed (%s); computing its prefill "
                               "here", seq.request_id, reason)
                bisect.insort(waiting, seq, key=rank_key)
            else:
                to_fail.append((seq, f"KV transfer failed: {reason}"))
        for key in merged.recved:
            blocks = self.held_loads.pop(key, None)
            if blocks is not None:
                self.bm.release_blocks(blocks)
                continue
            seq = self.loading.pop(key, None)
            if seq is None:
                continue
            self._count("done")
            self.connector.request_load_done(seq)
            seq.kv_remote_done = True
            seq.num_computed_tokens += seq.kv_external_tokens
            self.stats.kv_remote_prefill_tokens += seq.kv_external_tokens
            self.bm.register_computed(seq)
            seq.status = SequenceStatus.WAITING
            bisect.insort(waiting, seq, key=rank_key)
        return to_fail

    def _backstop(self, now: float, merged: KVConnectorOutput) -> None:
        """Transfers the workers never reported, past their deadline: a load fails (its
        blocks stay held until reported), an offer's blocks are freed."""
        for key, t in list(self._load_deadline.items()):
            if key not in self.loading or key in merged.failed or key in merged.recved:
                del self._load_deadline[key]
            elif now >= t:
                del self._load_deadline[key]
                logger.error("KV load %s: no report from the workers in time", key)
                merged.failed[key] = "KV transfer timed out (no report from the workers)"
        for tid, t in list(self._send_deadline.items()):
            if tid not in self.held_sends or tid in merged.sent:
                del self._send_deadline[tid]
            elif now >= t:
                del self._send_deadline[tid]
                logger.error("KV offer %s: no report from the workers; freeing its blocks", tid)
                self.bm.release_blocks(self.held_sends.pop(tid))

    def _complete(self, keys) -> list[str]:
        """The keys every rank has now reported."""
        done = []
        for k in keys:
            self._counts[k] += 1
            if self._counts[k] >= self.tp_size:
                del self._counts[k]
                done.append(k)
        return done

    def _count(self, outcome: str) -> None:
        by = self.stats.kv_transfers
        by[outcome] = by.get(outcome, 0) + 1

    def drop_all(self) -> None:
        """The workers are gone (restart): release every held block, forget every load."""
        for blocks in list(self.held_sends.values()) + list(self.held_loads.values()):
            self.bm.release_blocks(blocks)
        self.held_sends.clear()
        self.held_loads.clear()
        self._load_deadline.clear()
        self._send_deadline.clear()
        self._counts.clear()

    def metadata_array(self, batch):
        """This step's connector metadata (``batch``: the scheduler's plan), as bytes."""
        return self.connector.build_connector_meta(batch).to_array()


def build_remote_kv(config, block_manager: BlockManager, worker_info: list
                    ) -> Optional[RemoteKV]:
    """The engine's RemoteKV for an EngineConfig (None without kv_transfer)."""
    kv = config.kv_transfer
    if kv is None:
        return None
    from llm_serving.distributed.kv_transfer.base import KVConnectorRole
    from llm_serving.distributed.kv_transfer.factory import create_connector, kv_model_tag
    tp = config.parallel.tensor_parallel_size
    conn = create_connector(kv, KVConnectorRole.SCHEDULER, config.cache.block_size, 0, tp,
                            kv_model_tag(config))
    conn.set_worker_info(worker_info)
    return RemoteKV(conn, kv, block_manager, tp)
