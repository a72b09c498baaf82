"""MooncakeStoreConnector: KV blocks through a pool, Mooncake's distributed store (vLLM's
name). It doubles as a prefix cache shared by every instance on the store.

Keys. Block i of a prompt is stored under ``<model tag>:<rank>:<hash>``, where the hash
chains the block's tokens to its prefix (block_hash.py: SHA-256, the same in every process)
and the model tag names what the KV depends on (model, dtype, block size, TP split). Only full
blocks are stored, and never the block holding the prompt's last token (its logits are
computed by whoever answers).

Producer role (``kv_producer``, ``kv_both``): every request's full prompt blocks are put in the
step that computes them, after the forward (``wait_for_save``), so they are in the store before
the request's answer leaves. Nothing is held afterwards: a finished ``do_remote_decode`` request
returns ``kv_transfer_params`` naming the pool, and its blocks are freed at once.

Consumer role (``kv_consumer``, ``kv_both``): every waiting request (with or without
``kv_transfer_params``) asks the store how many of its leading blocks it holds, beyond the
local prefix cache; those are loaded (``batch_get_into_multi_buffers`` straight into the KV
arrays) while the request waits in WAITING_FOR_REMOTE_KVS, and it computes only the rest.

The master's address is ``kv_connector_extra_config.master_server_address``. The scheduler
side keeps its own small client (no memory of its own in the pool) to look keys up, on a
thread of its own: the scheduler never waits on the master. A waiting request's lookup is
asked once (``get_num_new_matched_tokens`` answers "not known yet" meanwhile, and the request
waits at the head of the queue while the running ones go on), and its answer is reused for
``LOOKUP_REUSE_S``. A lookup that takes longer than ``LOOKUP_TIMEOUT_S`` fails (the request
is computed here) and the store is not asked again for ``LOOKUP_BACKOFF_S``. When the master
is gone, lookups fail and the request is computed here (counted in /metrics); puts and gets
fail within a few seconds and are counted the same way: nothing hangs. After a failure,
neither side asks the store again until its master accepts a connection (``MasterWatch``,
probed at most every ``LOOKUP_BACKOFF_S``): a producer without its master skips the puts
instead of stalling each prefill step for the client's retries.
"""
from __future__ import annotations

import logging
import os
import time
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Sequence

from llm_serving.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata,
                                                      KVRequest, KVTransferError,
                                                      num_transfer_blocks)
from llm_serving.distributed.kv_transfer.block_hash import block_hashes
from llm_serving.distributed.kv_transfer.mooncake_store import MasterWatch

logger = logging.getLogger(__name__)
LOOKUP_TIMEOUT_S = 2.0      # a lookup not answered by then fails (the request computes)
LOOKUP_BACKOFF_S = 5.0      # ... and the store is not asked again for this long
LOOKUP_REUSE_S = 1.0        # a waiting request's answer is reused this long


@dataclass
class _Lookup:
    future: Future             # -> blocks found, from the first asked
    first: int                 # the first block asked (after the local prefix cache)
    started: float
    answered: Optional[float] = None


class MooncakeStoreConnector(KVConnectorBase):
    def __init__(self, config, role, block_size, rank=0, tp_size=1):
        super().__init__(config, role, block_size, rank, tp_size)
        self.engine_id = config.engine_id or f"{os.uname().nodename}-{os.getpid()}"
        self.client = None               # scheduler side: lookups
        self.transport = None            # worker side: puts and gets
        self._hashes: dict = {}          # request id -> hashes of its transferable blocks
        self._saved: dict = {}           # request id -> blocks put (or present) so far
        self._loads: dict = {}           # key -> load entry, not yet handed over
        self._load_keys: dict = {}       # request id -> key of its load
        self._ended: list = []
        self._lookups: dict[str, _Lookup] = {}      # request id -> its lookup
        self._lookup_queue: Optional[queue.SimpleQueue] = None
        self._store_quiet_until = 0.0
        self._watch = MasterWatch(self._extra("master_server_address"), LOOKUP_BACKOFF_S)

    def _extra(self, key, default=None):
        return self.config.extra(key, default)

    # ---- scheduler side -------------------------------------------------------------------

    def set_worker_info(self, infos: list) -> None:
        from llm_serving.distributed.kv_transfer.mooncake_store import check_master
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise KVTransferError(f"Mooncake's store cannot be loaded ({e}); install it with "
                                  "pip install -e \".[pd]\"") from None
        master = self._extra("master_server_address")
        check_master(master)
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(self._extra("local_hostname", "127.0.0.1"),
                               self._extra("metadata_server", "P2PHANDSHAKE"), 0, 16 << 20,
                               self._extra("protocol", "tcp"), self._extra("device_name", ""),
                               master)
        if rc != 0:
            raise KVTransferError(f"MooncakeDistributedStore.setup with master {master} "
                                  f"failed ({rc})")

    def _key_hashes(self, request: KVRequest) -> list:
        h = self._hashes.get(request.request_id)
        if h is None:
            k = num_transfer_blocks(len(request.prompt_token_ids), self.block_size)
            # a request's cache_salt keys its blocks apart: no tenant loads another's KV
            h = block_hashes(request.prompt_token_ids, self.block_size,
                             getattr(request, "cache_salt", None) or "", num_blocks=k)
            self._hashes[request.request_id] = h
        return h

    def key(self, rank: int, block_hash: str) -> str:
        return f"{self.model_tag}:{rank}:{block_hash}"

    def wants_remote_lookup(self, request: KVRequest) -> bool:
        return self.config.is_consumer

    def get_num_new_matched_tokens(self, request: KVRequest,
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        hashes = self._key_hashes(request)
        first = num_computed_tokens // self.block_size
        if len(hashes) <= first:
            return 0, False
        now = time.monotonic()
        rid = request.request_id
        lk = self._lookups.get(rid)
        if lk is None or lk.first != first or (lk.answered is not None
                                               and now - lk.answered > LOOKUP_REUSE_S):
            if now < self._store_quiet_until:
                raise KVTransferError(f"the Mooncake store did not answer a lookup within "
                                      f"{LOOKUP_TIMEOUT_S:g} s; not asked for "
                                      f"{LOOKUP_BACKOFF_S:g} s")
            lk = self._lookups[rid] = _Lookup(self._submit_lookup(hashes, first), first, now)
        if not lk.future.done():
            if now - lk.started < LOOKUP_TIMEOUT_S:
                return None, False
            self._drop_lookup(rid)
            self._store_quiet_until = now + LOOKUP_BACKOFF_S
            raise KVTransferError(f"the Mooncake store did not answer a lookup within "
                                  f"{LOOKUP_TIMEOUT_S:g} s (master "
                                  f"{self._extra('master_server_address')})")
        if lk.answered is None:
            lk.answered = now
        try:
            found = lk.future.result()
        except KVTransferError:
            del self._lookups[rid]
            raise
        n = (found - first) * self.block_size
        return (n, True) if n > 0 else (0, False)

    def _drop_lookup(self, rid: str) -> None:
        """Forget a request's lookup; if it has not started, it never will."""
        lk = self._lookups.pop(rid, None)
        if lk is not None:
            lk.future.cancel()

    def _submit_lookup(self, hashes: list, first: int) -> Future:
        """Runs ``_lookup`` on the lookup thread (a daemon: a master that hangs holds no
        one, not even the process's exit)."""
        if self._lookup_queue is None:
            self._lookup_queue = queue.SimpleQueue()
            threading.Thread(target=self._lookup_loop, name="kv-lookup", daemon=True).start()
        fut: Future = Future()
        self._lookup_queue.put((fut, hashes, first))
        return fut

    def _lookup_loop(self) -> None:
        while True:
            item = self._lookup_queue.get()
            if item is None:
                return
            fut, hashes, first = item
            if not fut.set_running_or_notify_cancel():
                continue                # its request timed out, ended or was aborted
            try:
                fut.set_result(self._lookup(hashes, first))
            except Exception as e:  # noqa: BLE001 - handed to the scheduler
                fut.set_exception(e)

    def _lookup(self, hashes: list, first: int) -> int:
        """On the lookup thread: how many blocks from ``first`` every rank has stored."""
        found = len(hashes)
        master = self._extra("master_server_address")
        if not self._watch.usable():
            raise KVTransferError(f"the Mooncake master at {master} is unreachable")
        try:
            for rank in range(self.tp_size):    # every rank's part must be there
                keys = [self.key(rank, h) for h in hashes[first:found]]
                found = first + _stored_prefix(self.client, keys)
                if found == first:
                    break
        except KVTransferError as e:
            self._watch.failed()
            raise KVTransferError(f"{e} (master {master})") from None
        except Exception as e:  # noqa: BLE001 - whatever the client raises fails the lookup
            self._watch.failed()
            raise KVTransferError(f"the Mooncake store lookup failed ({e!r})") from None
        self._watch.answered()
        return found

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self._drop_lookup(request.request_id)
        n = num_external_tokens // self.block_size
        first = len(block_ids) - n
        key = f"{request.request_id}#{id(request)}-{first}"
        self._load_keys[request.request_id] = key
        self._loads[key] = {"hashes": self._key_hashes(request)[first:first + n],
                            "local_block_ids": [int(b) for b in block_ids[first:first + n]]}
        self._saved[request.request_id] = first + n    # already in the pool

    def load_key(self, request: KVRequest) -> Optional[str]:
        return self._load_keys.get(request.request_id)

    def request_load_done(self, request: KVRequest) -> bool:
        key = self._load_keys.pop(request.request_id, None)
        return self._loads.pop(key, None) is not None

    def has_pending_meta(self) -> bool:
        return bool(self._loads)

    def build_connector_meta(self, scheduler_output=None) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._loads)
        self._loads = {}
        if self.config.is_producer and scheduler_output is not None:
            bs = self.block_size
            for seq, n in zip(scheduler_output.seqs, scheduler_output.num_tokens):
                if seq.num_computed_tokens >= len(seq.prompt_token_ids) or seq.index:
                    continue            # a decode (or a forked child): no prompt block to put
                hashes = self._key_hashes(seq)
                done = self._saved.get(seq.request_id, 0)
                full = min((seq.num_computed_tokens + n) // bs, len(hashes))
                if full > done:         # prompt blocks this step completes: put them
                    meta.saves[f"{seq.request_id}@{done}"] = {
                        "hashes": hashes[done:full],
                        "block_ids": [int(b) for b in seq.block_table[done:full]]}
                    self._saved[seq.request_id] = full
        return meta

    def request_finished(self, request: KVRequest,
                         block_ids: Sequence[int]) -> tuple[bool, Optional[dict]]:
        self._hashes.pop(request.request_id, None)
        self._saved.pop(request.request_id, None)
        self._drop_lookup(request.request_id)
        p = getattr(request, "kv_transfer_params", None) or {}
        if not p.get("do_remote_decode"):
            return False, None
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": self.engine_id,
                       "remote_request_id": request.request_id, "tp_size": self.tp_size,
                       "kv_pool": self._extra("master_server_address"),
                       "remote_block_ids": []}

    def forget(self, request: KVRequest) -> None:
        self._hashes.pop(request.request_id, None)
        self._saved.pop(request.request_id, None)
        self._drop_lookup(request.request_id)
        self.request_load_done(request)

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        from llm_serving.distributed.kv_transfer.mooncake_store import MooncakeStoreTransport
        self.transport = MooncakeStoreTransport(
            kv_caches, self._extra("master_server_address"),
            local_hostname=self._extra("local_hostname", "127.0.0.1"),
            protocol=self._extra("protocol", "tcp"), device_name=self._extra("device_name", ""),
            metadata_server=self._extra("metadata_server", "P2PHANDSHAKE"),
            global_segment_size=int(self._extra("global_segment_size", 256 << 20)),
            local_buffer_size=int(self._extra("local_buffer_size", 16 << 20)))

    def start_load_kv(self, forward_context=None) -> None:
        md = self._metadata
        if md is None or not md.loads:
            return
        t = self.transport
        per_block = t.layout.block_bytes * len(t.layout.base_addrs)
        for key, load in md.loads.items():
            keys = [self.key(self.rank, h) for h in load["hashes"]]
            if not self._watch.usable():
                ok, why = [], f"the Mooncake master at {self._watch.address} is unreachable"
            else:
                try:
                    ok = t.get_blocks(keys, load["local_block_ids"])
                except KVTransferError as e:
                    ok, why = [], str(e)
                    self._watch.failed()
                else:
                    why = f"{ok.count(False)} of {len(keys)} blocks were not in the store"
            if ok and all(ok):
                self._bytes += per_block * len(keys)
            else:
                self._failed[key] = why
            self._ended.append(key)

    def wait_for_save(self) -> None:
        md = self._metadata
        if md is None or not md.saves:
            return
        was_down = self._watch.down
        if not self._watch.usable():
            return                  # the blocks are not shared; the answers are unchanged
        for name, save in md.saves.items():
            keys = [self.key(self.rank, h) for h in save["hashes"]]
            try:
                stored = self.transport.put_blocks(keys, save["block_ids"])
            except KVTransferError as e:
                stored, why = [], str(e)
            else:
                why = f"{stored.count(False)} of {len(keys)} were not stored"
            if stored and any(stored):
                self._watch.answered()
                if was_down:
                    logger.info("the Mooncake store answers again: KV blocks are put")
                    was_down = False
            else:
                self._watch.failed()
                logger.warning("KV blocks of %s not put in the store (%s); no puts until its "
                               "master at %s answers (checked every %g s)", name, why,
                               self._watch.address, self._watch.backoff)
                return
            if not all(stored):
                logger.warning("%d of %d KV blocks of %s not put in the store",
                               stored.count(False), len(keys), name)

    def get_finished(self, finished_req_ids: set) -> tuple[set, set]:
        ended, self._ended = set(self._ended), []
        return set(), ended

    def shutdown(self) -> None:
        if self._lookup_queue is not None:
            self._lookup_queue.put(None)
        if self.transport is not None:
            self.transport.close()


def _stored_prefix(client, keys: list) -> int:
    """How many of ``keys``, from the first, the store holds."""
    found = client.batch_is_exist(keys)
    if len(found) != len(keys) or any(f < 0 for f in found):
        raise KVTransferError("the Mooncake store cannot answer (its master is gone?)")
    n = 0
    for f in found:
        if f != 1:
            break
        n += 1
    return n
