"""`SamplingParams`: how one request is decoded, with vLLM's field names and defaults.

A bad value fails here, at construction, with a `ValueError` that names the field and the
allowed range, never later inside a decode step.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass
from typing import List, Optional, Union

# Below this temperature a request is decoded greedily (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# The largest `logprobs` / `prompt_logprobs` a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each streamed output holds (vLLM's names)."""
    CUMULATIVE = 0   # everything generated so far
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # nothing until the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling parameters for one request, as in vLLM.

    n: number of completions to return for the prompt.
    presence_penalty: subtracted from the logit of every token already generated (-2..2).
    frequency_penalty: subtracted once per occurrence of a token already generated (-2..2).
    repetition_penalty: tokens seen in the prompt or the output have positive logits divided
        and negative logits multiplied by it (> 0; 1 = off).
    temperature: 0 (below 1e-5) means greedy decoding.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 = off (stored as 0).
    min_p: drop tokens whose probability is below min_p times the most likely one's [0, 1].
    seed: makes this request's sampling reproducible whatever else is in the batch.
    stop: strings that end the output; stored as a list.
    stop_token_ids: token ids that end the output; stored as a list.
    ignore_eos: keep generating after the EOS token.
    max_tokens: most tokens to generate; None = up to the model's length (the engine resolves it).
    min_tokens: EOS and stop_token_ids are banned until this many tokens were generated.
    logprobs: number of top alternatives to return per generated token; 0 = only the chosen
        token's log-probability (0..20).
    prompt_logprobs: same for prompt tokens (0..20).
    skip_special_tokens, spaces_between_special_tokens: detokenizer options.
    include_stop_str_in_output: keep the matched stop string in the text.
    detokenize: produce text at all.
    output_kind: what each streamed output holds (RequestOutputKind; default cumulative).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy decoding ignores the filters; reset them as vLLM does, so that a greedy
            # request is recognisable and batches cheaply.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    # ----------------------------------------------------------------- construction

    def _normalize(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")

        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.top_k == -1:
            self.top_k = 0

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            try:
                self.stop = list(self.stop)
            except TypeError:
                raise ValueError(
                    f"stop must be a string or a list of strings, got {self.stop!r}") from None
            for s in self.stop:
                if not isinstance(s, str):
                    raise ValueError(f"stop must be a string or a list of strings, got {s!r} in it")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            try:
                self.stop_token_ids = list(self.stop_token_ids)
            except TypeError:
                raise ValueError("stop_token_ids must be a list of integers, "
                                 f"got {self.stop_token_ids!r}") from None
            for t in self.stop_token_ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(
                        f"stop_token_ids must be integers >= 0, got {t!r} in it")

    def _verify(self) -> None:
        # Written as `not (ok)` so that NaN fails every range check.
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.n >= 1, f"n must be >= 1, got {self.n}")
        need(-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(0.0 < self.repetition_penalty < math.inf,
             f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        need(0.0 <= self.temperature < math.inf,
             f"temperature must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            need(self.max_tokens >= 1, f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        need(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens,
                 f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                need(0 <= value <= MAX_LOGPROBS,
                     f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")
        need("" not in self.stop, "stop must not contain an empty string")
        if self.seed is not None:
            need(-(2**63) <= self.seed < 2**63, f"seed must fit in 64 bits, got {self.seed}")
        need(all(t < 2**31 for t in self.stop_token_ids),
             "stop_token_ids must be token ids (< 2**31)")
        need(self.top_k < 2**31, f"top_k must be < 2**31, got {self.top_k}")
        need(self.max_tokens is None or self.max_tokens < 2**31,
             f"max_tokens must be < 2**31, got {self.max_tokens}")
        need(self.min_tokens < 2**31, f"min_tokens must be < 2**31, got {self.min_tokens}")

    # ----------------------------------------------------------------- queries

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer must hold back so a stop string is never half-streamed."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def clone(self) -> "SamplingParams":
        """An independent copy (lists are not shared)."""
        return copy.deepcopy(self)
