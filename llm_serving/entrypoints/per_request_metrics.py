"""vLLM 0.32's per-request ``metrics`` object of a completion or chat answer
(``--enable-per-request-metrics``), read from the timestamps the engine keeps for every
request anyway (``RequestMetrics``, the ones /metrics' histograms are filled from): nothing
is measured per step for it.

vLLM's definitions, in milliseconds: ``time_to_first_token_ms`` from the request's first
scheduling (not its arrival) to its first token, ``queue_time_ms`` from its arrival in the
engine to its first scheduling, ``generation_time_ms`` from the first token to the last,
``mean_itl_ms`` that over the tokens after the first, and ``tokens_per_second`` every
generated token over the time from the first scheduling to the last token. A field whose
timestamps are missing (``mean_itl_ms`` of a single token) is null; a stream's final usage
chunk leaves the null fields out, as vLLM's does.
"""
from __future__ import annotations

from typing import Optional

from llm_serving.outputs import RequestMetrics


FIELDS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
          "tokens_per_second")


def per_request_metrics(m: Optional[RequestMetrics], num_tokens: int) -> dict:
    """The ``metrics`` object of an answer of one prompt and one sequence that generated
    ``num_tokens`` tokens: every field, null where unknown (vLLM's non-streamed answer)."""
    out = dict.fromkeys(FIELDS)
    if m is None:
        return out
    scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
    if scheduled is not None and first is not None:
        out["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
    if scheduled is not None:
        out["queue_time_ms"] = (scheduled - m.arrival_time) * 1000
    if first is not None and last is not None and num_tokens > 1:
        out["mean_itl_ms"] = (last - first) / (num_tokens - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out["tokens_per_second"] = num_tokens / (last - scheduled)
    return out
