"""Prometheus metrics at ``/metrics``.

What vLLM measures goes under vLLM's own names and labels (``vllm:num_requests_running{engine="0",
model_name="..."}``), so a vLLM dashboard or alert reads this server unchanged. What only this
server has (swapped sequences, the host swap pool, timeouts, KV transfer, multi-stream) goes
under ``llm_serving:``.

They are refreshed from ``EngineStats`` at each scrape: gauges are set, counters advance by
what the engine counted since the previous scrape, and the histograms take the requests that
finished since then.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llm_serving.engine.metrics import EngineStats

P = "llm_serving:"
V = "vllm:"
_LABELS = ("model_name", "engine")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0)
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))   # 1, 2, 5, 10, ...

# counter name -> EngineStats field
_VLLM_COUNTERS = {
    "num_preemptions": ("num_preemptions", "Preemptions (swap or recompute)"),
    "prompt_tokens": ("num_prefill_tokens", "Prompt tokens computed (recompute included)"),
    "generation_tokens": ("num_generation_tokens", "Tokens generated"),
    "prefix_cache_queries": ("prefix_cache_queries", "Tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Tokens found in the prefix cache"),
}
_COUNTERS = {
    "request_aborted": ("num_aborted_requests", "Requests aborted"),
    "request_timeout": ("num_timed_out_requests", "Requests that timed out in the queue"),
    # KV transfer (PD disaggregation)
    "kv_transfer_recomputes": ("kv_transfer_recomputes", "Prefills computed here after a "
                               "failed or refused KV load (policy recompute)"),
    "kv_transfer_bytes": ("kv_transfer_bytes", "KV bytes received from other instances"),
    "kv_remote_prefill_tokens": ("kv_remote_prefill_tokens", "Prompt tokens whose KV was "
                                 "loaded from another instance instead of computed"),
    "kv_transfers_offered": ("kv_transfers_offered", "Prompts whose KV blocks were held for "
                             "a consumer (producer side)"),
}


class ServerMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}

        def vllm(kind, name, doc, extra=(), **kw):
            """One of vLLM's metrics, labelled as vLLM labels it (bound to this model unless
            it has labels of its own)."""
            m = kind(V + name, doc, [*_LABELS, *extra], registry=r, **kw)
            return m.labels(**labels) if not extra else m
        self._labels = labels
        self.running = vllm(Gauge, "num_requests_running", "Sequences running")
        self.waiting = vllm(Gauge, "num_requests_waiting", "Sequences waiting")
        self.kv_usage = vllm(Gauge, "kv_cache_usage_perc", "KV blocks in use (0..1)")
        self.vllm_counters = {name: vllm(Counter, name, doc)
                              for name, (_, doc) in _VLLM_COUNTERS.items()}
        # Every finished request, labelled by why it ended (stop, length, abort).
        self.success = vllm(Counter, "request_success", "Requests finished, by finish reason",
                            ["finished_reason"])
        self.ttft = vllm(Histogram, "time_to_first_token_seconds", "Time to first token",
                         buckets=_LATENCY_BUCKETS)
        self.tpot = vllm(Histogram, "request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request",
                         buckets=_TPOT_BUCKETS)
        self.e2e = vllm(Histogram, "e2e_request_latency_seconds", "Request latency",
                        buckets=_LATENCY_BUCKETS)
        self.queue = vllm(Histogram, "request_queue_time_seconds", "Time waiting to start",
                          buckets=_LATENCY_BUCKETS)
        self.prompt_len = vllm(Histogram, "request_prompt_tokens", "Prompt tokens per request",
                               buckets=_TOKEN_BUCKETS)
        self.output_len = vllm(Histogram, "request_generation_tokens",
                               "Tokens generated per request", buckets=_TOKEN_BUCKETS)
        # This server's own.
        self.swapped = Gauge(P + "num_requests_swapped", "Sequences swapped out", registry=r)
        self.cpu_usage = Gauge(P + "cpu_cache_usage_perc", "Host swap blocks in use (0..1)",
                               registry=r)
        self.hit_rate = Gauge(P + "prefix_cache_hit_rate", "Prefix-cache hit rate (tokens)",
                              registry=r)
        self.counters = {name: Counter(P + name, doc, registry=r)
                         for name, (_, doc) in _COUNTERS.items()}
        self._last: dict = {}            # counter key -> engine count at the last scrape
        # Multi-stream: every step the engine planned with it on, split or not (and why).
        self.multistream = Counter(P + "multistream_steps", "Steps planned with multi-stream "
                                   "on, by outcome (split/unsplit) and reason",
                                   ["outcome", "reason"], registry=r)
        self.kv_transfers = Counter(P + "kv_transfers", "KV loads from other instances, by "
                                    "outcome (done, failed, timeout)", ["outcome"], registry=r)
        self.kv_blocks_held = Gauge(P + "kv_blocks_held", "KV blocks held for transfers in "
                                    "flight (deferred release)", registry=r)
        self.kv_loads = Gauge(P + "kv_loads_in_flight", "Requests waiting for their KV from "
                              "another instance", registry=r)

    def update(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.swapped.set(s.num_swapped)
        self.kv_usage.set(s.kv_cache_usage)
        self.cpu_usage.set(s.cpu_cache_usage)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        for table, counters in ((_VLLM_COUNTERS, self.vllm_counters),
                                (_COUNTERS, self.counters)):
            for name, (attr, _) in table.items():
                self._advance(name, counters[name], getattr(s, attr))
        for reason, value in s.finished_by_reason.items():
            self._advance(("success", reason),
                          self.success.labels(**self._labels, finished_reason=reason), value)
        for reason, value in s.multistream_steps.items():
            outcome = "split" if reason == "split" else "unsplit"
            self._advance(("multistream", reason),
                          self.multistream.labels(outcome=outcome, reason=reason), value)
        for outcome, value in s.kv_transfers.items():
            self._advance(("kv", outcome), self.kv_transfers.labels(outcome=outcome), value)
        self.kv_blocks_held.set(s.kv_blocks_held)
        self.kv_loads.set(s.kv_loads_in_flight)
        for m in s.finished_requests:
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot),
                                (self.e2e, m.e2e_latency), (self.queue, m.time_in_queue),
                                (self.prompt_len, m.num_prompt_tokens),
                                (self.output_len, m.num_generation_tokens)):
                if value is not None:
                    hist.observe(value)

    def _advance(self, key, counter, value: int) -> None:
        """Move a counter on by what the engine counted since the previous scrape."""
        last = self._last.get(key, 0)
        if value > last:
            counter.inc(value - last)
            self._last[key] = value

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
