"""`SamplingParams`: how one request is decoded, with vLLM's field names and defaults.

A bad value fails here, at construction, with a `ValueError` that names the field and the
allowed range, never later inside a decode step.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import numpy as np

from llm_serving import structural_tag

# Below this temperature a request is decoded greedily (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs: the largest `logprobs` / `prompt_logprobs` a request may ask for.
MAX_LOGPROBS = 20


# Bounds on repetition_detection (its check runs on every token of the requests using it).
MAX_REPETITION_PATTERN = 1024
MAX_REPETITION_COUNT = 1024

# vLLM's bound on logprob_token_ids (the engine's max_logprobs bounds it too).
MAX_LOGPROB_TOKEN_IDS = 128

# OpenAI's bound on logit_bias (also its number of entries).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
# Stop strings and ids, and bad words, are checked on the engine thread at every token of the
# request: bounded so that one request cannot slow every step (OpenAI allows 4 stop strings).
MAX_STOPS = 100
MAX_STOP_CHARS = 4096      # all of a request's stop strings together
MAX_BAD_WORDS = 100
MAX_BAD_WORD_CHARS = 4096  # all of a request's bad words together


# StructuredOutputsParams' kinds of constraint (one per request)
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``); exactly one of:

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular
    expression; choice: one of these strings; grammar: a Lark / EBNF grammar (llguidance's
    dialect, which also reads GBNF); structural_tag: free text with JSON between begin and
    end strings after triggers (vLLM's structures + triggers form or its xgrammar format
    form, JSON text or dict; structural_tag.py).

    whitespace_pattern: with json, json_object or structural_tag, a regular expression for
    the whitespace allowed between JSON tokens (instead of the engine's default).
    """
    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[Union[str, Dict[str, Any]]] = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(_KINDS)} "
                             f"(got {given or 'none'})")
        if self.structural_tag is not None:
            try:
                self.structural_tag = structural_tag.parse(self.structural_tag)
            except ValueError as e:
                raise ValueError(f"structured_outputs.structural_tag: {e}") from None
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError("structured_outputs.whitespace_pattern: a regular expression "
                                 "(a string)")
            if given[0] not in ("json", "json_object", "structural_tag"):
                raise ValueError(f"structured_outputs.whitespace_pattern: applies to JSON "
                                 f"(json, json_object, structural_tag), not {given[0]}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json: a JSON schema is an object")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice: a non-empty list of strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k}: a non-empty string")


@dataclass
class RepetitionDetectionParams:
    """vLLM's: end the output (finish_reason "repetition") once its last tokens are a pattern
    of ``min_pattern_size``..``max_pattern_size`` tokens repeated ``min_count`` times."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(is_int(x) for x in sizes) or self.max_pattern_size < 0 \
                or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must "
                             "be integers >= 0 with min_pattern_size <= max_pattern_size (both "
                             f"0: off), got {self}")
        if self.max_pattern_size > 0 and not 2 <= self.min_count <= MAX_REPETITION_COUNT:
            raise ValueError(f"repetition_detection: min_count must be in [2, "
                             f"{MAX_REPETITION_COUNT}] when max_pattern_size is set, got "
                             f"{self.min_count}")
        if self.max_pattern_size > MAX_REPETITION_PATTERN:
            raise ValueError(f"repetition_detection: max_pattern_size must be at most "
                             f"{MAX_REPETITION_PATTERN}, got {self.max_pattern_size}")

    def repeats(self, token_ids: List[int]) -> bool:
        """The tokens end with a pattern repeated min_count times (vLLM's check)."""
        if self.max_pattern_size <= 0:
            return False
        count = self.min_count
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * count > len(token_ids):
                return False
            tail = np.asarray(token_ids[-size * count:]).reshape(count, size)
            if (tail == tail[-1]).all():
                return True
        return False


class RequestOutputKind(enum.Enum):
    """What each streamed output holds (vLLM's names)."""
    CUMULATIVE = 0   # everything generated so far
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # nothing until the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_unicode(field: str, texts: List[str]) -> None:
    """Texts that cannot be UTF-8 (an unpaired surrogate, "\ud800", from JSON's escapes) are
    refused by name: the tokenizer and the response writer would fail on them later."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{field}: {t!r} is not a valid Unicode text (it holds an "
                             "unpaired UTF-16 surrogate)") from None


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
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
        token's log-probability; -1 = the whole vocabulary (vLLM's). The engine's
        max_logprobs caps it (default 20).
    prompt_logprobs: same for prompt tokens.
    logprob_token_ids: report the log-probabilities of these token ids (and of the chosen
        token) at every generated position, in place of the top ``logprobs`` (vLLM's; at
        most the engine's max_logprobs ids).
    skip_special_tokens, spaces_between_special_tokens: detokenizer options.
    include_stop_str_in_output: keep the matched stop string in the text.
    detokenize: produce text at all; False: the outputs' text is "" and logprobs' decoded_token
        None (vLLM's), and stop strings are refused.
    output_kind: what each streamed output holds (RequestOutputKind; default cumulative).
    stream_interval: a stream delivers every this many new tokens (the first and the last at
        once); raises the server's --stream-interval, never lowers it (vLLM's).
    logit_bias: token id -> value added to its logit before sampling ([-100, 100], at most
        300 entries; OpenAI's).
    allowed_token_ids: only these ids may be sampled (vLLM's).
    bad_words: words never generated: a word's last token is banned wherever the tokens
        before it were just generated (vLLM's; with and without a leading space).
    structured_outputs: a grammar the output must match (StructuredOutputsParams).
    extra_args: vLLM's: arguments for the engine's custom logits processors (an engine
        without them refuses any key but "kv_transfer_params", which is taken as
        kv_transfer_params).
    skip_reading_prefix_cache: compute the whole prompt, reusing no cached prefix (its blocks
        still enter the cache).
    repetition_detection: end the output once it repeats a pattern
        (RepetitionDetectionParams; finish_reason "repetition").
    thinking_token_budget: the most tokens the model may think (vLLM's): once its reasoning
        (from the reasoning config's start text, in the prompt or the output) has this many
        tokens, the end text is forced token by token and the output goes on; -1 or None:
        no limit. Needs a reasoning config (reasoning_parser or reasoning_config).
    watermarking, flat_logprobs, prompt_logprob_token_ids, prompt_logprob_start, routed_experts_prompt_start, trace_decode_token_ids: vLLM's,
        refused (ValueError naming them) when set to anything but "off"; skip_clone is a
        copying hint with nothing to do here.
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
    logprob_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # PD disaggregation (vLLM's): {"do_remote_decode": true} asks a producer to keep the
    # prompt's KV for a consumer; {"do_remote_prefill": true, ...the producer's answer...}
    # asks a consumer to load it. The engine refuses it without a kv_transfer config.
    kv_transfer_params: Optional[Dict[str, Any]] = None
    # vLLM 0.32's other arguments (_normalize_vllm_extras says what each does here).
    watermarking: Optional[bool] = None
    extra_args: Optional[Dict[str, Any]] = None
    skip_reading_prefix_cache: Optional[bool] = None
    repetition_detection: Optional[RepetitionDetectionParams] = None
    flat_logprobs: bool = False
    skip_clone: bool = False
    thinking_token_budget: Optional[int] = None
    prompt_logprob_token_ids: Optional[Any] = None
    prompt_logprob_start: Optional[int] = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: Optional[List[int]] = None
    # Filled by the engine's input processor (the tokenizer's view of bad_words, the
    # compiled grammar); not part of the user's request.
    bad_words_token_ids: Optional[List[List[int]]] = field(default=None, repr=False)
    grammar: Optional[Any] = field(default=None, repr=False, compare=False)
    # Set by the chat route under --reasoning-parser: the grammar holds from the token after
    # this marker (the end of the model's thinking), not from the first token.
    reasoning_end: Optional[str] = field(default=None, repr=False, compare=False)

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
            if not is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
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
        self._normalize_constraints()
        self._normalize_vllm_extras()

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
        _check_unicode("stop", self.stop)

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            try:
                self.stop_token_ids = list(self.stop_token_ids)
            except TypeError:
                raise ValueError("stop_token_ids must be a list of integers, "
                                 f"got {self.stop_token_ids!r}") from None
            for t in self.stop_token_ids:
                if not is_int(t) or t < 0:
                    raise ValueError(
                        f"stop_token_ids must be integers >= 0, got {t!r} in it")

    def _normalize_vllm_extras(self) -> None:
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise ValueError(f"extra_args must be a dict, got {self.extra_args!r}")
            kv = self.extra_args.get("kv_transfer_params")
            if kv is not None:
                if self.kv_transfer_params is not None and self.kv_transfer_params != kv:
                    raise ValueError("extra_args: its kv_transfer_params differs from "
                                     "kv_transfer_params")
                self.kv_transfer_params = kv
        if isinstance(self.repetition_detection, dict):
            try:
                self.repetition_detection = RepetitionDetectionParams(
                    **self.repetition_detection)
            except TypeError as e:
                raise ValueError(f"repetition_detection: {e}") from None
        elif self.repetition_detection is not None and \
                not isinstance(self.repetition_detection, RepetitionDetectionParams):
            raise ValueError("repetition_detection must be a RepetitionDetectionParams, got "
                             f"{self.repetition_detection!r}")
        if self.repetition_detection is not None \
                and self.repetition_detection.max_pattern_size == 0:
            self.repetition_detection = None
        budget = self.thinking_token_budget
        if budget is not None and (not is_int(budget) or budget < -1):
            raise ValueError("thinking_token_budget must be a non-negative integer or -1 for "
                             f"unlimited, got {budget!r}")
        if budget == -1:         # vLLM's "unlimited": unset
            self.thinking_token_budget = None
        refused = {"watermarking": self.watermarking not in (None, False),
                   "flat_logprobs": bool(self.flat_logprobs),
                   "prompt_logprob_token_ids": self.prompt_logprob_token_ids is not None,
                   "prompt_logprob_start": self.prompt_logprob_start is not None,
                   "routed_experts_prompt_start": self.routed_experts_prompt_start != 0,
                   "trace_decode_token_ids": self.trace_decode_token_ids is not None}
        for name, is_set in refused.items():
            if is_set:
                raise ValueError(f"{name}: not supported by this engine "
                                 f"(got {getattr(self, name)!r})")

    def _normalize_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                                 f"{len(self.logit_bias)}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
                if tid < 0 or tid >= 2**31 or not is_number(v) \
                        or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias: token {k!r} -> {v!r}; ids are >= 0 and "
                                     f"values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
                bias[tid] = float(v)
            self.logit_bias = bias or None
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, (list, tuple)) \
                    or not all(is_int(t) and 0 <= t < 2**31 for t in ids):
                raise ValueError(f"logprob_token_ids must be a list of token ids, got {ids!r}")
            if len(ids) > MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(f"logprob_token_ids must hold at most {MAX_LOGPROB_TOKEN_IDS} "
                                 f"ids, got {len(ids)}")
            self.logprob_token_ids = [int(t) for t in ids] or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids \
                    or not all(is_int(t) and 0 <= t < 2**31 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) \
                    or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got "
                                 f"{self.bad_words!r}")
            _check_unicode("bad_words", self.bad_words)
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words, got "
                                 f"{len(self.bad_words)}")
            chars = sum(map(len, self.bad_words))
            if chars > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words must hold at most {MAX_BAD_WORD_CHARS} characters "
                                 f"in all, got {chars}")
            self.bad_words = list(self.bad_words) or None
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")

    @property
    def constrained(self) -> bool:
        """Whether a step must build a token mask or bans for this request."""
        return (self.structured_outputs is not None or self.allowed_token_ids is not None
                or self.bad_words is not None)

    @property
    def wants_logprobs(self) -> bool:
        """Log-probabilities are reported: ``logprobs`` or ``logprob_token_ids`` is set."""
        return self.logprobs is not None or self.logprob_token_ids is not None

    @property
    def num_logprobs(self) -> int:
        """The alternatives reported per token besides the chosen one (-1: none asked)."""
        if self.logprob_token_ids is not None:
            return len(self.logprob_token_ids)
        return -1 if self.logprobs is None else self.logprobs

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
        if self.stream_interval is not None:
            need(self.stream_interval >= 1,
                 f"stream_interval must be >= 1 or None, got {self.stream_interval}")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens,
                 f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                need(value >= -1, f"{name} must be >= 0, -1 (the whole vocabulary) or None "
                     f"(the engine's max_logprobs caps it), got {value}")
        need("" not in self.stop, "stop must not contain an empty string")
        need(self.detokenize or not self.stop,
             "stop: stop strings are matched on the text, so they need detokenize=True")
        need(len(self.stop) <= MAX_STOPS,
             f"stop must hold at most {MAX_STOPS} strings, got {len(self.stop)}")
        stop_chars = sum(map(len, self.stop))
        need(stop_chars <= MAX_STOP_CHARS,
             f"stop must hold at most {MAX_STOP_CHARS} characters in all, got {stop_chars}")
        need(len(self.stop_token_ids) <= MAX_STOPS,
             f"stop_token_ids must hold at most {MAX_STOPS} ids, got {len(self.stop_token_ids)}")
        if self.kv_transfer_params is not None:
            need(isinstance(self.kv_transfer_params, dict),
                 f"kv_transfer_params must be a JSON object, got {self.kv_transfer_params!r}")
            # A producer offers one sequence's blocks; a consumer's n > 1 children fork from
            # the loaded prompt as they fork from a computed one.
            need(self.n == 1 or not self.kv_transfer_params.get("do_remote_decode"),
                 f"kv_transfer_params: do_remote_decode needs n = 1, got n={self.n}")
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


@dataclass
class BeamSearchParams:
    """vLLM's, for ``LLM.beam_search`` (entrypoints/beam_search.py): the number of beams
    (and of sequences returned), the most new tokens, and how hypotheses are scored and
    shown."""
    beam_width: int
    max_tokens: Optional[int]        # None: as many as the model's length leaves
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's too; taken only unset here (a ValueError naming the field otherwise)
    structured_outputs: Optional[Any] = None
    watermarking: Optional[bool] = None

    def __post_init__(self):
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs: not supported with beam search here")
        if self.watermarking:
            raise ValueError("watermarking: not supported here")
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(
                self.length_penalty):
            raise ValueError(f"length_penalty: expected a finite number, got "
                             f"{self.length_penalty!r}")

    def step_params(self) -> SamplingParams:
        """What each beam asks of the engine at a step: one token and the top 2 x beam_width
        log-probabilities (transformers' and vLLM's candidate count)."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width,
                              temperature=self.temperature, detokenize=False)
