"""A sequence being generated: its tokens, status, KV blocks and timings.

A request with ``n > 1`` becomes ``n`` sequences sharing a request id (index 0..n-1). Only
the first one computes the prompt; the others wait as its ``pending_children`` and are forked
from it (sharing its KV blocks) when the prompt is done, each sampling its own first token
from the same logits.
"""
from __future__ import annotations

import enum
import hashlib
import itertools
import time
from typing import Optional

import numpy as np

from llm_serving.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # Its prompt's KV is being loaded from another instance (PD disaggregation): it holds
    # blocks for it, but neither a batch slot nor a place in the waiting queue.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    SWAPPED = "swapped"                 # preempted, KV blocks held in the host pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"        # waited longer than queue_timeout before starting
    FINISHED_REPETITION = "repetition"  # its output repeated a pattern (repetition_detection)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_TIMEOUT,
                       SequenceStatus.FINISHED_REPETITION})


_KEYS = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt: Optional[str],
                 prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 priority: int = 0, arrival_order: int = 0,
                 arrival_time: Optional[float] = None):
        self.request_id = request_id
        self.index = index
        self.key = next(_KEYS)          # unique in this process (custom logits processors' rows)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        # Scheduling order: lower first. Under FCFS the priority part is left out.
        self.order_key = (priority, arrival_order, index)
        self.status = SequenceStatus.WAITING
        # KV cache state, owned by the block manager.
        self.block_table: list[int] = []          # device blocks
        self.cpu_block_table: list[int] = []      # host blocks while swapped out
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []         # hash chain of the full blocks' tokens
        self.cached_uids: list[Optional[int]] = []  # prefix-cache entry per registered block
        self.num_cached_tokens = 0                # prompt tokens found cached or loaded
        # Async scheduling: tokens sampled for this sequence by steps still running on the
        # model. They are not known yet and are not in ``output_token_ids``; they count in
        # ``num_tokens`` (the scheduler plans past them) and the model runner fills the input
        # of the one in ``in_flight_row`` of the previous step (see ``expect_token``).
        self.tokens_in_flight = 0
        self.in_flight_row = -1
        # Speculative decoding (spec_decode/): the draft tokens scheduled after the last
        # known token in the running step (their KV slots are held; verified when the step's
        # tokens come back), and the proposer's token buffer (array, tokens in it).
        self.draft_token_ids: list[int] = []
        # --per-request-spec-decode-metrics: its drafts' acceptance (None: not counted)
        self.spec_metrics = None
        self.spec_context: tuple = (None, 0)
        # n > 1: sequences forked from this one once its prompt is computed.
        self.pending_children: list[Sequence] = []
        # KV transfer (PD disaggregation, engine/remote_kv.py): the caller's
        # kv_transfer_params, the ones returned to it (a producer's offer), the key and token
        # count of a load in progress (kept once loaded, 0 after a failed load), and whether
        # loading is over (done or given up).
        self.kv_transfer_params: Optional[dict] = params.kv_transfer_params
        self.kv_transfer_params_out: Optional[dict] = None
        self.kv_load_key: Optional[str] = None
        self.kv_external_tokens = 0
        self.kv_remote_done = False
        # Results.
        # Prompt logprobs (vLLM's shape: None, then one dict per prompt token) when asked:
        # set on the sequence that computes the prompt, filled as its prefill chunks run.
        self.prompt_logprobs: Optional[list] = None
        self.output_logprobs: list = []
        self.cumulative_logprob = 0.0
        self.stop_reason = None
        self.detokenizer = None
        self.grammar_error: Optional[str] = None    # its grammar's matcher failed (why)
        # A pooling request (--runner pooling): its params, the sum of its pooled rows so
        # far (layers/pooler.py), and its embedding (or class probabilities) once its last
        # prompt chunk ran.
        self.pooling = None
        self.pooled_sum = None
        self.embedding: Optional[list] = None
        # Timings (time.time(), for metrics).
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None
        self.num_preemptions = 0
        # LoRA: the adapter it runs with (its LoRARequest's lora_int_id, path and name; 0:
        # none).
        self.lora_id = 0
        self.lora_path: Optional[str] = None
        self.lora_name: Optional[str] = None
        # vLLM's cache_salt: its blocks are shared only with sequences of the same salt
        self.cache_salt: Optional[str] = None
        # vLLM's prompt_embeds: float32 [E, hidden], the model's input at the prompt
        # positions ``embeds_positions`` (int32 [E], ascending: all of the prompt's, or
        # those of a chat message's prompt_embeds parts; their prompt_token_ids are
        # placeholder 0s); kept until the sequence ends, for a recompute after preemption.
        # Their sha256 per KV block (``embeds_digest``), for the prefix cache.
        self.prompt_embeds = None
        self.embeds_positions = None
        self._embeds_digests: dict[int, bytes] = {}

    @property
    def num_tokens(self) -> int:
        """Prompt, known output, and the tokens in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.tokens_in_flight

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known so far."""
        return len(self.output_token_ids)

    @property
    def finishing(self) -> bool:
        """Its token in flight is its last one (max_tokens, which is capped so that the
        sequence fits max_model_len): nothing more to schedule."""
        return (self.tokens_in_flight > 0
                and len(self.output_token_ids) + self.tokens_in_flight >= self.max_tokens)

    # ---- async scheduling: the one owner of tokens in flight ------------------------------
    def expect_token(self, row: int) -> None:
        """A step that samples this sequence in ``row`` has started."""
        self.tokens_in_flight += 1
        self.in_flight_row = row

    def receive_token(self, token: int) -> None:
        """The oldest running step's sample for this sequence (or a fork's first token)."""
        self.output_token_ids.append(token)
        if self.tokens_in_flight:
            self.tokens_in_flight -= 1

    def forget_in_flight(self) -> None:
        """The sequence has ended: the samples of steps still running are discarded."""
        self.tokens_in_flight = 0

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def embeds_digest(self, block: int, block_size: int) -> Optional[bytes]:
        """sha256 of the prompt embeddings in KV block ``block`` (None: it holds none): of
        its rows when they fill the block's prompt positions (vLLM's digest), else of
        their offsets in the block too."""
        e = self.prompt_embeds
        if e is None:
            return None
        d = self._embeds_digests.get(block)
        if d is None:
            first = block * block_size
            pos = self.embeds_positions
            lo, hi = np.searchsorted(pos, (first, first + block_size))
            if lo == hi:
                return None
            h = hashlib.sha256(e[lo:hi])
            if hi - lo < min(block_size, len(self.prompt_token_ids) - first):
                h.update((pos[lo:hi] - first).astype(np.int32).tobytes())
            d = self._embeds_digests[block] = h.digest()
        return d

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end); a position in flight reads -1 (the model runner
        fills it in from the previous step's sample)."""
        p = len(self.prompt_token_ids)
        known = p + len(self.output_token_ids)
        if end > known:
            return self.token_ids(start, known) + [-1] * (end - max(start, known))
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def finish_reason(self) -> Optional[str]:
        """vLLM's finish reasons: "stop", "length", "repetition" or "abort" (a queue timeout
        is an abort)."""
        if not self.status.finished:
            return None
        if self.status is SequenceStatus.FINISHED_TIMEOUT:
            return "abort"
        return self.status.value
