"""The split decision: where a step's batch is cut into two micro-batches, or why it is not.

``plan_split`` is one pure function of the step's per-request token counts and prefill flags
and the config. It runs once per step on the master, and its answer travels in the step
input (``StepInput.ms_split``): every tensor-parallel rank then takes the same decision, as
it must (ranks that disagree issue different collectives and deadlock).

The cut is at a request boundary (a request's tokens never straddle micro-batches), the one
nearest the token midpoint; it is refused when there is one request, too few tokens, too few
prefill tokens in a step that has prefill, a step kind the config excludes, or no boundary
within the allowed imbalance.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from llm_serving.model_executor.multistream.config import MultiStreamConfig

SPLIT = "split"
# Why a step ran unsplit (the /metrics label values, with SPLIT).
ONE_REQUEST = "one_request"
TOO_FEW_TOKENS = "too_few_tokens"
TOO_FEW_PREFILL_TOKENS = "too_few_prefill_tokens"
KIND_EXCLUDED = "kind_excluded"          # apply_to leaves out this step's kind
IMBALANCE = "imbalance"
REASONS = (ONE_REQUEST, TOO_FEW_TOKENS, TOO_FEW_PREFILL_TOKENS, KIND_EXCLUDED, IMBALANCE)


class SplitDecision(NamedTuple):
    split: int      # the first request of micro-batch B; 0 = don't split
    reason: str     # SPLIT, or one of REASONS


def plan_split(num_tokens: np.ndarray, is_prefill: np.ndarray,
               config: MultiStreamConfig) -> SplitDecision:
    """num_tokens: int [S], each request's tokens this step; is_prefill: bool [S]."""
    n = np.asarray(num_tokens, np.int64)
    if len(n) < 2:
        return SplitDecision(0, ONE_REQUEST)
    total = int(n.sum())
    if total < config.min_total_tokens:
        return SplitDecision(0, TOO_FEW_TOKENS)
    prefill = int(n[np.asarray(is_prefill, bool)].sum())
    has_prefill = prefill > 0
    if (config.apply_to == "prefill" and not has_prefill) or (
            config.apply_to == "decode" and has_prefill):
        return SplitDecision(0, KIND_EXCLUDED)
    if has_prefill and prefill < config.min_prefill_tokens:
        return SplitDecision(0, TOO_FEW_PREFILL_TOKENS)
    left = np.cumsum(n[:-1])                     # tokens before boundary k = 1 .. S-1
    gap = np.abs(2 * left - total)               # |A - B|
    k = int(np.argmin(gap))
    if gap[k] > config.max_imbalance * total:
        return SplitDecision(0, IMBALANCE)
    return SplitDecision(k + 1, SPLIT)


def step_split(query_start_loc: np.ndarray, config: MultiStreamConfig) -> SplitDecision:
    """``plan_split`` for a step input: a request with more than one query row this step is
    prefill (a prompt, a chunk or a recompute); one row is a decode."""
    n = np.diff(query_start_loc)
    return plan_split(n, n > 1, config)


def multi_stream_on_master(config) -> "MultiStreamConfig | None":
    """The config the master plans splits with (None: multi-stream is off), and the one
    start-up log line saying whether it is on, and why not if it was asked for."""
    import logging
    log = logging.getLogger("llm_serving.multistream")
    ms = config.multi_stream
    if ms is None:
        log.info("multi-stream: off (enable with --enable-multi-stream)")
        return None
    mode, why = ms.mode(config.parallel.tensor_parallel_size, config.device.device,
                        config.parallel.cpu_allreduce)
    if mode == "off":
        log.info("multi-stream: asked for but off: %s", why)
        return None
    log.info("multi-stream: on, %s: %s; split from %d tokens (%d prefill), imbalance <= %.0f%%, "
             "for %s steps", mode, why, ms.min_total_tokens, ms.min_prefill_tokens,
             100 * ms.max_imbalance, ms.apply_to)
    return ms
