"""The scheduler side shared by the connectors that move whole blocks from a producer to a
consumer (InProcessConnector, MooncakeConnector): the bookkeeping of the KV connector API
around two transport-specific hooks.

Producer: a request that asked ``do_remote_decode`` and finished keeps its first
``num_transfer_blocks`` blocks; ``_offer`` makes the parameters a reader needs (the
connector's own, plus ``transfer_id``, ``remote_block_ids``, ``ttl`` (seconds the offer
is held, counted by the reader on its own clock), ``prefix_hash``, ``tp_size``), and the step's metadata tells the workers to hold them
("saves"). The workers report the transfer as sent once the reader is done or the offer
expired; the engine then frees the blocks.

Consumer: a request with ``do_remote_prefill`` and the producer's parameters matches
``num_transfer_blocks`` full blocks of its prompt (minus what its own prefix cache has),
gets blocks allocated, and the step's metadata tells the workers to read them ("loads").

A consumer that will not read an offer (its own prefix cache holds the tokens, the offer
does not fit, the request ended first) declines it: the producer frees the blocks at once.

Both sides check that they agree: the same block count and the same prefix hash of the
transferred tokens (block_hash.py, deterministic across processes), else the consumer
computes the prefill itself.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
from typing import Optional, Sequence

from llm_serving.distributed.kv_transfer.base import (MAX_METADATA_BYTES, KVConnectorBase,
                                                      KVConnectorMetadata, KVRequest,
                                                      num_transfer_blocks)
from llm_serving.distributed.kv_transfer.block_hash import block_hashes
from llm_serving.sampling_params import is_int, is_number

logger = logging.getLogger(__name__)
_ids = itertools.count()
TTL_MARGIN_S = 1.0


def prefix_hash(token_ids: Sequence[int], block_size: int, num_blocks: int) -> str:
    """The hash of the first ``num_blocks`` full blocks ("" for none)."""
    hashes = block_hashes(token_ids, block_size, num_blocks=num_blocks)
    return hashes[-1] if hashes else ""


def reader_expiry(request: KVRequest, p: dict) -> float:
    """When the reader must be done, on this host's clock: the producer's ``ttl`` counted
    from the request's arrival here, less a margin for the way from P (its answer, the proxy)
    of up to 1 s. An absolute ``expires_at`` (an older producer) is taken as it is."""
    if "ttl" not in p:
        return float(p.get("expires_at", 0.0))
    ttl = float(p["ttl"])
    arrival = getattr(request, "arrival_time", None) or time.time()
    return arrival + ttl - min(TTL_MARGIN_S, 0.1 * ttl)


def _is_finite(v) -> bool:
    return is_number(v) and math.isfinite(v)


def params_of(request: KVRequest) -> dict:
    return getattr(request, "kv_transfer_params", None) or {}


class BlockTransferScheduler(KVConnectorBase):
    """Scheduler-side half of a block-moving connector; subclasses give ``_offer`` (and
    their worker half)."""

    engine_id: str = ""

    def _init_scheduler_side(self) -> None:
        self.engine_id = self.config.engine_id or f"{os.uname().nodename}-{os.getpid()}"
        self._loads: dict = {}       # key -> load entry, not yet handed to the workers
        self._saves: dict = {}       # transfer id -> save entry, not yet handed over
        self._load_keys: dict = {}   # request id -> key of its load in progress
        self._declines: dict = {}    # transfer id -> an offer this side will not read

    # ---- consumer -------------------------------------------------------------------------

    def remote_blocks(self, request: KVRequest) -> int:
        """Full blocks the producer offers for this request (0: none, or they disagree)."""
        p = params_of(request)
        if not p.get("do_remote_prefill") or "remote_block_ids" not in p:
            return 0
        k = num_transfer_blocks(len(request.prompt_token_ids), self.block_size)
        ids = p.get("remote_block_ids")
        if not isinstance(ids, list) or len(ids) != k:
            raise ValueError(f"the producer offers {len(ids) if isinstance(ids, list) else ids}"
                             f" blocks, this prompt has {k} to transfer")
        if int(p.get("tp_size", 1)) != self.tp_size:
            raise ValueError(f"the producer runs tensor_parallel_size {p.get('tp_size')}, "
                             f"this instance {self.tp_size}")
        if p.get("prefix_hash", "") != prefix_hash(request.prompt_token_ids, self.block_size, k):
            raise ValueError("the producer's prompt differs from this one (prefix hash)")
        return k

    def get_num_new_matched_tokens(self, request: KVRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        k = self.remote_blocks(request)
        n = k * self.block_size - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        p = params_of(request)
        first = len(block_ids) - -(-num_external_tokens // self.block_size)
        n = num_external_tokens // self.block_size
        local = [int(b) for b in block_ids[first:first + n]]
        key = f"{request.request_id}#{next(_ids)}"
        self._load_keys[request.request_id] = key
        self._loads[key] = {"params": dict(self._load_params(p),
                                           expires_at=reader_expiry(request, p)),
                            "remote_block_ids": [int(b) for b in
                                                 p["remote_block_ids"][first:first + n]],
                            "local_block_ids": local,
                            "timeout": float(self.config.kv_transfer_timeout)}

    def _load_params(self, p: dict) -> dict:
        """What the workers need of the producer's parameters (default: all of them)."""
        return p

    def load_key(self, request: KVRequest) -> Optional[str]:
        return self._load_keys.get(request.request_id)

    def request_load_done(self, request: KVRequest) -> bool:
        key = self._load_keys.pop(request.request_id, None)
        return self._loads.pop(key, None) is not None

    def decline_offer(self, p: dict) -> None:
        if p.get("do_remote_prefill") and p.get("remote_block_ids") and p.get("transfer_id"):
            self._declines[str(p["transfer_id"])] = self._load_params(p)

    # Fields of an offer this side reads, and what each must be when present.
    OFFER_FIELDS = {"remote_block_ids": ("a list of block numbers", lambda v: isinstance(v, list)
                                         and all(is_int(b) and b >= 0 for b in v)),
                    "transfer_id": ("a string", lambda v: isinstance(v, str)),
                    "remote_engine_id": ("a string", lambda v: isinstance(v, str)),
                    "prefix_hash": ("a string", lambda v: isinstance(v, str)),
                    "tp_size": ("a positive integer", lambda v: is_int(v) and v > 0),
                    "ttl": ("a number of seconds", lambda v: _is_finite(v) and v >= 0),
                    "expires_at": ("a number", _is_finite)}

    @classmethod
    def check_offer(cls, params: dict) -> None:
        for key, (what, ok) in cls.OFFER_FIELDS.items():
            if key in params and not ok(params[key]):
                raise ValueError(f"kv_transfer_params.{key}: expected {what}, got "
                                 f"{params[key]!r:.80}")

    # ---- producer -------------------------------------------------------------------------

    def request_finished(self, request: KVRequest,
                         block_ids: Sequence[int]) -> tuple[bool, Optional[dict]]:
        if not params_of(request).get("do_remote_decode"):
            return False, None
        k = num_transfer_blocks(len(request.prompt_token_ids), self.block_size)
        tid = f"{self.engine_id}-{request.request_id}-{next(_ids)}"
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": self.engine_id,
                  "remote_request_id": request.request_id, "transfer_id": tid,
                  "tp_size": self.tp_size,
                  "prefix_hash": prefix_hash(request.prompt_token_ids, self.block_size, k)}
        if k == 0 or len(block_ids) < k:          # nothing to move: the consumer computes all
            params.update(remote_block_ids=[], ttl=0.0)
            return False, params
        params.update(self._offer(tid, list(block_ids[:k])))
        params["remote_block_ids"] = [int(b) for b in block_ids[:k]]
        expires_at = params.pop("expires_at")     # this host's clock: for its workers only
        self._saves[tid] = {"expires_at": expires_at,
                            **{key: params[key] for key in self._save_keys() if key in params}}
        # The reader gets the time left, and counts it on its own clock from the request's
        # arrival (reader_expiry): the hosts' clocks need not agree.
        params["ttl"] = round(max(0.0, expires_at - time.time()), 3)
        return True, params

    def _offer(self, transfer_id: str, block_ids: list) -> dict:
        """The transport's parameters for a reader; must include ``expires_at`` (this
        host's clock; the reader gets it as ``ttl``)."""
        return {"expires_at": time.time() + float(self.config.kv_transfer_timeout)}

    def _save_keys(self) -> tuple:
        """Which of the offer's parameters the producer's workers need."""
        return ("remote_block_ids",)

    def transfer_sent(self, transfer_id: str) -> None:
        """The workers freed the transfer (read or expired)."""

    # ---- every step -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output=None) -> KVConnectorMetadata:
        meta, size = KVConnectorMetadata(), 64
        for name, pending in (("saves", self._saves), ("loads", self._loads),
                              ("declines", self._declines)):
            for key in list(pending):
                entry_size = len(json.dumps(pending[key])) + len(key) + 8
                if size + entry_size > MAX_METADATA_BYTES:     # the rest goes next step
                    return meta
                getattr(meta, name)[key] = pending.pop(key)
                size += entry_size
        return meta

    def has_pending_meta(self) -> bool:
        return bool(self._loads or self._saves or self._declines)
