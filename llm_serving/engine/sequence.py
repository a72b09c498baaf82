"""A sequence being generated: its tokens, status, KV blocks and timings.

A request with ``n > 1`` becomes ``n`` sequences sharing a request id (index 0..n-1).
"""
from __future__ import annotations

import enum
import time
from typing import Optional

from llm_serving.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class Sequence:
    def __init__(self, request_id: str, index: int, prompt: Optional[str],
                 prompt_token_ids: list[int], params: SamplingParams, max_tokens: int):
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.output_logprobs: list = []
        self.cumulative_logprob = 0.0
        self.stop_reason = None
        self.detokenizer = None
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None
