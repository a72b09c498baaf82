"""Results handed back to the user, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union


@dataclass
class Logprob:
    """One token's log-probability, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per generated token: token id -> Logprob (the chosen token plus the top alternatives).
SampleLogprobs = List[Dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = List[Optional[Dict[int, Logprob]]]

FINISH_REASONS = ("stop", "length", "abort", "repetition")


@dataclass
class CompletionOutput:
    """One completion of a request.

    finish_reason: "stop" (EOS, a stop string or a stop token), "length" (max_tokens or the
        model's length), "abort", or None while still generating.
    stop_reason: the stop token id or stop string that ended the output; None for EOS, for
        "length", or while running.
    """

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    # --per-request-spec-decode-metrics: the sequence's draft acceptance, once it ended
    # (spec_decode/request_metrics.py's SpecDecodeRequestMetrics); None otherwise
    spec_decode_metrics: Optional[object] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.time()) of one request's life; fields are None until reached."""

    arrival_time: float
    last_token_time: Optional[float] = None
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    time_in_queue: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0      # the longest sequence's
    num_output_tokens: int = 0          # every sequence's (n > 1: the answer's usage)
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    n: int = 1                          # sequences asked for
    max_tokens: Optional[int] = None    # as the engine ran it: capped to fit max_model_len
    finish_reasons: tuple = ()          # each sequence's (abort: ended unfinished)

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, from arrival, in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first, in seconds."""
        if self.first_token_time is None or self.last_token_time is None \
                or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    # vLLM's phases: prefill from first scheduled to the first token, decode from the first
    # token to the last, inference both (time preempted included).
    @property
    def prefill_time(self) -> Optional[float]:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> Optional[float]:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> Optional[float]:
        if self.first_scheduled_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_scheduled_time


@dataclass
class RequestOutput:
    """Everything known about one request: its prompt and its `n` completions so far."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[List[int]]
    outputs: List[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[PromptLogprobs] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: Optional[int] = None
    # Why the engine ended the request itself (queue timeout, engine error); None otherwise.
    error: Optional[str] = None
    # PD disaggregation: a producer's offer of the prompt's KV (vLLM's kv_transfer_params,
    # for the consumer), on the finished output; None otherwise.
    kv_transfer_params: Optional[dict] = None
    # A pooling request's embedding, or a classifier's class probabilities (--runner pooling),
    # on its finished output; None otherwise.
    embedding: Optional[List[float]] = None


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""
    embedding: List[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    """vLLM's: one prompt's pooled data, as ``LLM.encode`` returns it (an embedding, or a
    classifier's probabilities; a numpy array where vLLM's is a torch tensor)."""
    data: Any


@dataclass
class PoolingRequestOutput:
    """vLLM's: one prompt's pooling result (``outputs``: its PoolingOutput, EmbeddingOutput,
    ClassificationOutput or ScoringOutput)."""
    request_id: str
    outputs: Any
    prompt_token_ids: List[int]
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's ``LLM.embed`` result for one prompt."""


@dataclass
class ClassificationOutput:
    """vLLM's: one prompt's class probabilities (the raw logits with use_activation false)."""
    probs: List[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's ``LLM.classify`` result for one prompt."""


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score (a cross-encoder's, or two embeddings' cosine similarity)."""
    score: float


class ScoringRequestOutput(PoolingRequestOutput):
    """vLLM's ``LLM.score`` result for one pair."""
