"""MooncakeConnector: P2P KV transfer on Mooncake's TransferEngine (vLLM's name).

Every rank of both instances starts a TransferEngine in ``P2PHANDSHAKE`` mode on a port it
picks itself (``mooncake_p2p.py``) and registers its KV arrays; the ranks' addresses and
layouts reach the master in the WorkAgents' READY frames (``handshake_info``). No extra
config is needed on one machine (loopback); across machines set
``kv_connector_extra_config.local_hostname`` to an address the peer can reach.

Producer: a finished ``do_remote_decode`` request keeps its full prompt blocks; its
``kv_transfer_params`` carry, beside vLLM's ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``, ``remote_block_ids`` and ``tp_size``, each rank's address
and layout (``remote_ranks``) and a notification slot and token. Consumer: each rank reads
its peer rank's blocks in one batched asynchronous read (``batch_transfer_async_read``), then
writes the token into the producer's slot; the producer's workers see it and the blocks are
freed (or when the offer expires after ``kv_transfer_timeout``). A consumer that will not read
an offer writes the token at once (``decline``).
"""
from __future__ import annotations

import logging

from llm_serving.distributed.kv_transfer.base import KVConnectorOutput, KVTransferError
from llm_serving.distributed.kv_transfer.block_transfer import BlockTransferScheduler
from llm_serving.sampling_params import is_int

logger = logging.getLogger(__name__)
MAX_TRANSFERS = 4096        # offers held at once (notification slots) and reads in flight


class MooncakeConnector(BlockTransferScheduler):
    def __init__(self, config, role, block_size, rank=0, tp_size=1):
        super().__init__(config, role, block_size, rank, tp_size)
        self._init_scheduler_side()
        self._ranks: list = []
        self._slots = None
        self.transport = None
        self._ended: list = []
        self._read_bytes: dict = {}

    # ---- scheduler side -------------------------------------------------------------------

    def set_worker_info(self, infos: list) -> None:
        from llm_serving.distributed.kv_transfer.mooncake_p2p import SlotPool
        self._ranks = list(infos)
        self._slots = SlotPool(MAX_TRANSFERS)

    def _offer(self, transfer_id: str, block_ids: list) -> dict:
        if len(self._ranks) != self.tp_size:
            raise KVTransferError("the workers' transfer engines are not known")
        offer = self._slots.offer(transfer_id, block_ids, float(self.config.kv_transfer_timeout))
        host, _, port = self._ranks[0]["engine"].rpartition(":")
        offer.update(remote_host=host, remote_port=int(port), remote_ranks=self._ranks)
        return offer

    OFFER_FIELDS = {**BlockTransferScheduler.OFFER_FIELDS,
                    "remote_ranks": ("a list of the producer ranks' descriptions (objects)",
                                     lambda v: isinstance(v, list)
                                     and all(isinstance(r, dict) for r in v)),
                    "slot": ("an integer", is_int), "token": ("an integer", is_int)}

    def _save_keys(self) -> tuple:
        return ("slot", "token")

    def _load_params(self, p: dict) -> dict:
        return {k: p.get(k) for k in ("transfer_id", "remote_ranks", "slot", "token")}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for tid in output.sent:
            self._slots.release(tid)

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        from llm_serving.distributed.kv_transfer.mooncake_p2p import MooncakeP2PTransport
        c = self.config
        self.transport = MooncakeP2PTransport(
            kv_caches, hostname=c.extra("local_hostname", "127.0.0.1"),
            protocol=c.extra("protocol", "tcp"), device_name=c.extra("device_name", ""),
            max_transfers=MAX_TRANSFERS)

    def handshake_info(self) -> dict:
        return self.transport.describe()

    def start_load_kv(self, forward_context=None) -> None:
        md = self._metadata
        if md is None:
            return
        t = self.transport
        for tid, save in md.saves.items():
            try:
                t.expect(tid, int(save["slot"]), int(save["token"]), float(save["expires_at"]))
            except KVTransferError as e:
                logger.warning("cannot hold transfer %s: %s", tid, e)
        for tid, p in md.declines.items():
            try:
                t.decline(tid, (p.get("remote_ranks") or [])[self.rank], p.get("slot"),
                          p.get("token"))
            except (KVTransferError, IndexError) as e:    # freed when the offer expires
                logger.info("cannot decline transfer %s: %s", tid, e)
        for key, load in md.loads.items():
            p = load["params"]
            try:
                ranks = p.get("remote_ranks") or []
                if len(ranks) != self.tp_size:
                    raise KVTransferError(f"the producer has {len(ranks)} ranks, this "
                                          f"instance {self.tp_size}")
                t.start_read(key, {"remote": ranks[self.rank],
                                   "remote_block_ids": load["remote_block_ids"],
                                   "slot": p.get("slot"), "token": p.get("token"),
                                   "expires_at": p.get("expires_at")},
                             load["local_block_ids"], float(load["timeout"]))
                self._read_bytes[key] = (len(load["local_block_ids"]) * t.layout.block_bytes
                                         * len(t.layout.base_addrs))
            except KVTransferError as e:
                self._failed[key] = str(e)
                self._ended.append(key)      # never started: its blocks are free

    def get_finished(self, finished_req_ids: set) -> tuple[set, set]:
        t = self.transport
        recved = set(self._ended)
        self._ended = []
        sent = set()
        if t.num_held:
            done, expired = t.poll_sent()
            sent.update(done, expired)
        if t.num_reading:
            done, failed, released = t.poll_reads()
            for key in done:
                self._bytes += self._read_bytes.pop(key, 0)
            recved.update(done, released)
            for key, why in failed:
                self._failed[key] = why
                if key not in t._reads:          # ended (a timed-out read ends later)
                    recved.add(key)
                    self._read_bytes.pop(key, None)
        return sent, recved

