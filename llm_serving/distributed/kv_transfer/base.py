"""The KV connector API: what the engine calls so KV blocks can come from, or go to, another
instance (PD disaggregation).

It is vLLM V1's ``KVConnectorBase_V1`` split, with its method names. One connector class
serves two roles, each instance built for one:

Scheduler side (``KVConnectorRole.SCHEDULER``, in the master process):
  - ``get_num_new_matched_tokens``: how many prompt tokens a remote cache holds beyond what
    is computed here, and whether they arrive asynchronously (then the request waits in
    ``WAITING_FOR_REMOTE_KVS``, holding no batch slot);
  - ``update_state_after_alloc``: the blocks allocated for those tokens;
  - ``build_connector_meta``: this step's loads and saves, sent to the agents with the step;
  - ``update_connector_output``: what the agents reported finished or failed;
  - ``request_finished``: whether the request's blocks must stay allocated until a transfer
    ends (deferred release), and the ``kv_transfer_params`` to return to the caller.

Worker side (``KVConnectorRole.WORKER``, in each WorkAgent, around the forward):
  - ``register_kv_caches``: the rank's KV arrays, once;
  - ``bind_connector_metadata`` / ``clear_connector_metadata``: the step's metadata;
  - ``start_load_kv`` and ``wait_for_layer_load``: start loading, wait for a layer's KV;
  - ``save_kv_layer`` and ``wait_for_save``: save a layer's KV, wait for the saves;
  - ``get_finished``: the requests that finished sending or receiving;
  - ``get_block_ids_with_load_errors``: the blocks that failed to load.

Seed 001's model-runner calls are kept as thin wrappers on the worker side:
``recv_kv_caches_and_hidden_states`` (before the forward: start the loads, wait for every
layer) and ``send_kv_caches_and_hidden_states`` (after it: save every layer, without waiting).

A request is whatever the engine's sequence is, read through a few attributes:
``request_id``, ``prompt_token_ids`` and ``kv_transfer_params`` (a dict or None, vLLM's
``do_remote_decode`` / ``do_remote_prefill`` and the producer's parameters).
"""
from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import numpy as np
from llm_serving.errors import LLMServingError

if TYPE_CHECKING:
    from llm_serving.distributed.kv_transfer.config import KVTransferConfig


class KVTransferError(LLMServingError):
    """A KV transfer could not start, failed, or timed out. The message says which and why."""


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVRequest(Protocol):
    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: Optional[dict]


@dataclass
class KVConnectorMetadata:
    """One step's transfer work, from the scheduler side to every worker. Small and
    JSON-able (it rides in the step input as bytes, bounded by ``MAX_METADATA_BYTES``): per
    transfer key, the parameters of what to load into which local blocks, what to save
    (offer, put) from which blocks, and the offers this side will not read (the producer
    may free them now)."""
    loads: dict = field(default_factory=dict)      # key -> {..., "local_block_ids"}
    saves: dict = field(default_factory=dict)      # key -> {..., "block_ids"}
    declines: dict = field(default_factory=dict)   # transfer id -> the producer's params

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.declines)

    def to_dict(self) -> dict:
        return {"loads": self.loads, "saves": self.saves, "declines": self.declines}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "KVConnectorMetadata":
        d = d or {}
        return cls(dict(d.get("loads", {})), dict(d.get("saves", {})),
                   dict(d.get("declines", {})))

    def to_array(self) -> np.ndarray:
        """uint8 JSON bytes, for the step input (empty when there is nothing to do)."""
        if not self:
            return _NO_BYTES
        return np.frombuffer(json.dumps(self.to_dict(), separators=(",", ":")).encode(),
                             np.uint8)

    @classmethod
    def from_array(cls, a: Optional[np.ndarray]) -> Optional["KVConnectorMetadata"]:
        if a is None or not len(a):
            return None
        return cls.from_dict(json.loads(bytes(a)))


# The bound on one step's connector metadata; the scheduler side puts off what does not fit
# to the next step.
MAX_METADATA_BYTES = 1 << 20
_NO_BYTES = np.zeros(0, np.uint8)


@dataclass
class KVConnectorOutput:
    """What one worker (rank) reports after a step, back to the scheduler side (JSON):
    transfers it finished sending (the reader is done, or the offer expired: the blocks may
    be freed), loads that ended (done or failed: the destination blocks are no longer
    written), loads that failed with the reason (a load that timed out while Mooncake still
    writes is reported failed first and ended later), and the bytes it received."""
    sent: list = field(default_factory=list)
    recved: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)     # key -> reason
    bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.sent or self.recved or self.failed or self.bytes)

    def to_bytes(self) -> bytes:
        if not self:
            return b""
        return json.dumps({"sent": list(self.sent), "recved": list(self.recved),
                           "failed": self.failed, "bytes": self.bytes}).encode()

    @classmethod
    def from_bytes(cls, b: bytes) -> "KVConnectorOutput":
        if not b:
            return cls()
        d = json.loads(b)
        return cls(d["sent"], d["recved"], d["failed"], d["bytes"])


def num_transfer_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks moved for a prompt, the same number on both sides: every full block
    except that the last prompt token is always computed by the consumer (its logits give
    the first token), so a prompt of exactly k blocks moves k - 1."""
    return max(0, num_prompt_tokens - 1) // block_size


class KVConnectorBase(ABC):
    """vLLM V1's connector split; see the module docstring for who calls what."""

    def __init__(self, config: "KVTransferConfig", role: KVConnectorRole, block_size: int,
                 rank: int = 0, tp_size: int = 1):
        self.config = config
        self.role = role
        self.block_size = block_size
        self.rank = rank
        self.tp_size = tp_size
        self.model_tag = ""             # what the KV depends on (factory.kv_model_tag)
        self._metadata: Optional[KVConnectorMetadata] = None
        self._failed: dict = {}        # worker side: key -> reason, since the last report
        self._bytes = 0                # worker side: bytes loaded since the last report

    # ---- scheduler side -------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: KVRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens beyond ``num_computed_tokens`` that a remote cache holds, whether
        they are loaded asynchronously); (None, False) while the answer is not known yet (a
        lookup in flight, vLLM's meaning): the scheduler asks again at a later step."""

    @abstractmethod
    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """The blocks the engine allocated for the request (the remote tokens' first)."""

    def wants_remote_lookup(self, request: KVRequest) -> bool:
        """Whether to ask ``get_num_new_matched_tokens`` for this waiting request (default:
        it carries a producer's ``do_remote_prefill`` parameters)."""
        p = getattr(request, "kv_transfer_params", None)
        return bool(p and p.get("do_remote_prefill"))

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves; the pending ones are handed over and forgotten.
        ``scheduler_output``: the step's plan (``seqs`` and ``num_tokens``)."""

    def set_worker_info(self, infos: list) -> None:
        """Each rank's ``handshake_info()``, once the workers are up (what the producer puts
        in its kv_transfer_params so that a reader finds its memory)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers reported after a step (already combined across ranks)."""

    def load_key(self, request: KVRequest) -> Optional[str]:
        """The key of the request's load (after ``update_state_after_alloc``)."""
        return None

    def request_load_done(self, request: KVRequest) -> bool:
        """The request's load ended (done, failed or abandoned): forget it. True when it was
        never handed to the workers (so nothing writes into its blocks)."""
        return False

    def forget(self, request: KVRequest) -> None:
        """The request ended without finishing (abort, timeout): drop what is kept on it."""

    def request_not_loaded(self, request: KVRequest) -> None:
        """The request will not read the producer's offer: its own prefix cache holds the
        tokens, the offer does not fit its prompt, it scores its prompt, or it ended before
        its load began. The producer is told (with the next step), so it frees the blocks
        now rather than when the offer expires (vLLM's NIXL connector does the same on a
        full prefix hit)."""
        self.decline_offer(getattr(request, "kv_transfer_params", None) or {})

    def decline_offer(self, params: dict) -> None:
        """The producer's offer ``params`` (a request's ``kv_transfer_params``) will not be
        read here: tell the producer with the next step. Default: nothing (an offer that is
        not held)."""

    def has_pending_meta(self) -> bool:
        """Metadata is waiting for the next step."""
        return False

    @classmethod
    def check_offer(cls, params: dict) -> None:
        """A consumer's check of a producer's offer (``kv_transfer_params`` with
        ``do_remote_prefill``) as a request arrives: ValueError naming the field whose value
        this connector could not use (it would fail a step later, and every request in it).
        Default: nothing read from it."""

    @abstractmethod
    def request_finished(self, request: KVRequest,
                         block_ids: Sequence[int]) -> tuple[bool, Optional[dict]]:
        """(keep the blocks allocated until the transfer ends, the kv_transfer_params for
        the caller). With True the engine frees them when ``finished_sending`` names it."""

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        """The rank's KV cache: per layer a (key, value) pair of arrays."""

    def handshake_info(self) -> dict:
        """What the scheduler side must know about this rank (JSON-able), sent once."""
        return {}

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def has_connector_metadata(self) -> bool:
        return self._metadata is not None

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start this step's loads (non-blocking)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's KV has arrived (a no-op for whole-request loads)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None) -> None:
        """Start saving the layer's KV for this step's saves (non-blocking)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are safe (the blocks may then be overwritten)."""

    def get_finished(self, finished_req_ids: set) -> tuple[set, set]:
        """(request ids that finished sending, request ids that finished receiving)."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set:
        """Local blocks whose load failed since the last call (their requests recompute or
        fail, by kv_failure_policy)."""
        return set()

    def get_load_failures(self) -> dict:
        """Loads that failed since the last call: key -> reason. A failed load still being
        written into (a timeout) appears in ``get_finished``'s receiving set only later."""
        failed, self._failed = self._failed, {}
        return failed

    def take_num_bytes_received(self) -> int:
        """Bytes loaded since the last call (for /metrics)."""
        n, self._bytes = self._bytes, 0
        return n

    def build_connector_output(self) -> KVConnectorOutput:
        """This step's report to the scheduler side (after the forward)."""
        sending, recving = self.get_finished(set())
        return KVConnectorOutput(sorted(sending), sorted(recving), self.get_load_failures(),
                                 self.take_num_bytes_received())

    def shutdown(self) -> None:
        """Free the transfer engine and its registrations."""

    # ---- seed 001's model-runner calls -----------------------------------------------------

    def recv_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: list) -> tuple[Any, bool, Any]:
        """Before the forward: load this step's remote KV into ``kv_caches``. Returns
        (hidden states, bypass_model_exec, model_input): the forward always runs here (it
        computes at least the prompt's last token), so (None, False, model_input)."""
        self.start_load_kv(None)
        for layer in range(len(kv_caches)):
            self.wait_for_layer_load(str(layer))
        return None, False, model_input

    def send_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: list, hidden_or_intermediate_states: Any
                                         ) -> None:
        """After the forward: save this step's KV (non-blocking; ``wait_for_save`` waits)."""
        for layer, kv in enumerate(kv_caches):
            self.save_kv_layer(str(layer), kv, None)
