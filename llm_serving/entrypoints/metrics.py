"""Prometheus metrics at ``/metrics``.

What vLLM measures goes under vLLM's own names and labels (``vllm:num_requests_running{engine="0",
model_name="..."}``), so a vLLM dashboard or alert reads this server unchanged. What only this
server has (swapped sequences, the host swap pool, timeouts, KV transfer, multi-stream) goes
under ``llm_serving:``.

They are refreshed from ``EngineStats`` at each scrape: gauges are set, counters advance by
what the engine counted since the previous scrape, the per-request histograms take the
requests that finished since then, and the per-step ones (tokens per step, inter-token
latency, and the KV block residency of --kv-cache-metrics), which the engine counts into
buckets itself, advance by its counts.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from llm_serving.histogram_buckets import check_histogram_buckets
from llm_serving.spec_decode.config import SpeculativeConfig
from llm_serving.engine.metrics import (INTER_TOKEN_LATENCY_BUCKETS, ITERATION_TOKENS_BUCKETS,
                                        KV_CACHE_RESIDENCY_BUCKETS, PROMPT_TOKEN_SOURCES,
                                        EngineStats, StepHistogram, histogram_bounds)

P = "llm_serving:"
V = "vllm:"
_LABELS = ("model_name", "engine")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0)
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))   # 1, 2, 5, 10, ...
# vLLM's (vllm/v1/metrics/buckets.py): request phases, n, preemptions per request.
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's finish reasons: each has its request_success_total series from the start (at 0), so
# that a query on one reads 0, not "no data". This engine ends a failed request as "abort".
_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# vLLM's tiers of cached prompt tokens (prompt_tokens_cached_by_source), from this engine's
# sources: its own prefix cache is vLLM's "device", KV loaded from another instance "p2p".
_CACHED_SOURCES = {"device": "local_cache_hit", "host": None, "p2p": "external_kv_transfer",
                   "disk": None, "external_unspecified": None}
# vLLM's admission limits (a request refused with 503 counts under its limit's name).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# counter name -> EngineStats field
_VLLM_COUNTERS = {
    "num_preemptions": ("num_preemptions", "Preemptions (swap or recompute)"),
    "generation_tokens": ("num_generation_tokens", "Tokens generated"),
    "prefix_cache_queries": ("prefix_cache_queries", "Tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Tokens found in the prefix cache"),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Decodes verified with drafts"),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                        "Draft tokens accepted"),
    "external_prefix_cache_queries": ("external_prefix_cache_queries", "Prompt tokens not "
                                      "found locally, looked up through the KV connector"),
    "external_prefix_cache_hits": ("external_prefix_cache_hits", "Prompt tokens loaded "
                                   "through the KV connector (from another instance)"),
    # --enable-mfu-metrics (engine/mfu.py; 0 without it, as vLLM's): per device, which here
    # is a tensor-parallel rank (its CPU cores)
    "estimated_flops_per_gpu": ("estimated_flops", "Estimated number of floating point "
                                "operations per device (for Model Flops Utilization)"),
    "estimated_read_bytes_per_gpu": ("estimated_read_bytes", "Estimated number of bytes read "
                                     "from memory per device (for Model Flops Utilization)"),
    "estimated_write_bytes_per_gpu": ("estimated_write_bytes", "Estimated number of bytes "
                                      "written to memory per device (for Model Flops "
                                      "Utilization)"),
}
# --kv-cache-metrics' histograms: EngineStats field -> (vLLM's name, what it is)
_KV_RESIDENCY = {
    "kv_block_lifetime": ("kv_block_lifetime_seconds", "KV cache block lifetime from "
                          "allocation to eviction (sampled: --kv-cache-metrics-sample)"),
    "kv_block_idle_before_evict": ("kv_block_idle_before_evict_seconds", "Idle time before "
                                   "a KV cache block's eviction (sampled: "
                                   "--kv-cache-metrics-sample)"),
    "kv_block_reuse_gap": ("kv_block_reuse_gap_seconds", "Time between a KV cache block's "
                           "consecutive prefix-cache hits, its last four (sampled: "
                           "--kv-cache-metrics-sample)"),
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


class _EngineHistogram:
    """A histogram the engine counts into buckets itself (a ``StepHistogram``), exposed as a
    Prometheus histogram: each ``advance`` adds what the engine counted since the previous."""

    def __init__(self, name: str, doc: str, labels: dict, bounds: tuple, registry):
        self.name, self.doc, self.labels = name, doc, labels
        self.les = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self.counts, self.sum = [0] * len(self.les), 0.0
        self._last = StepHistogram(bounds)
        registry.register(self)

    def advance(self, h: StepHistogram) -> None:
        last = self._last
        self.counts = [t + c - b for t, c, b in zip(self.counts, h.counts, last.counts)]
        self.sum += h.sum - last.sum
        self._last = h

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))

    def describe(self):
        yield self._family()

    def collect(self):
        family = self._family()
        family.add_metric(list(self.labels.values()),
                          list(zip(self.les, accumulate(self.counts))), self.sum)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0,
                 buckets: Optional[dict] = None, kv_cache_metrics: bool = False):
        """``num_speculative_tokens``: the draft positions (speculative_config's k, 0 when
        off), whose accepted-token series exist from the start at 0, as vLLM's; ``buckets``:
        --custom-histogram-buckets (family -> bounds), over the defaults below;
        ``kv_cache_metrics``: --kv-cache-metrics' histograms are registered (only then, as
        vLLM)."""
        r = self.registry = CollectorRegistry()
        buckets = buckets or {}

        def bounds(family: str, default: tuple) -> tuple:
            return histogram_bounds(buckets, family, default)
        labels = {"model_name": model_name, "engine": "0"}

        def vllm(kind, name, doc, extra=(), **kw):
            """One of vLLM's metrics, labelled as vLLM labels it (bound to this model unless
            it has labels of its own)."""
            m = kind(V + name, doc, [*_LABELS, *extra], registry=r, **kw)
            return m.labels(**labels) if not extra else m
        self._labels = labels
        self.running = vllm(Gauge, "num_requests_running", "Sequences running")
        self.waiting = vllm(Gauge, "num_requests_waiting", "Sequences waiting (for room, or "
                            "for their KV from another instance)")
        # vLLM's reasons: "capacity" (the waiting queue: room in the batch, the token budget
        # or KV blocks), "deferred" (its KV being loaded from another instance).
        waiting_by = vllm(Gauge, "num_requests_waiting_by_reason", "Sequences waiting, by "
                          "reason: capacity (for room), deferred (for their KV from another "
                          "instance); the sum is num_requests_waiting", ["reason"])
        self.waiting_capacity = waiting_by.labels(**labels, reason="capacity")
        self.waiting_deferred = waiting_by.labels(**labels, reason="deferred")
        self.kv_usage = vllm(Gauge, "kv_cache_usage_perc", "KV blocks in use (0..1)")
        self.vllm_counters = {name: vllm(Counter, name, doc)
                              for name, (_, doc) in _VLLM_COUNTERS.items()}
        # Each request's prompt tokens once, as its first token comes: in all, by source, and
        # those not computed (found in the prefix cache or loaded from another instance).
        self.prompt_tokens = vllm(Counter, "prompt_tokens", "Prompt tokens of the requests "
                                  "prefilled (each once, cached or computed)")
        by_source = vllm(Counter, "prompt_tokens_by_source", "Prompt tokens by source: "
                         "local_compute, local_cache_hit, external_kv_transfer", ["source"])
        self.prompt_sources = {source: by_source.labels(**labels, source=source)
                               for source in PROMPT_TOKEN_SOURCES}
        self.cached_tokens = vllm(Counter, "prompt_tokens_cached", "Prompt tokens not computed: "
                                  "found in the prefix cache or loaded from another instance")
        cached_by = vllm(Counter, "prompt_tokens_cached_by_source", "Prompt tokens not "
                         "computed, by tier: device (this engine's prefix cache), p2p (loaded "
                         "from another instance); host, disk, external_unspecified stay 0",
                         ["source"])
        self.cached_sources = {source: cached_by.labels(**labels, source=source)
                               for source in _CACHED_SOURCES}
        # labelled by model only, as vLLM's
        rejected = Counter(V + "admission_rejections", "Requests refused by an admission "
                           "limit (503), by limit", ["model_name", "reason"], registry=r)
        self.admission_rejections = {reason: rejected.labels(model_name=model_name,
                                                             reason=reason)
                                     for reason in ADMISSION_REASONS}
        # vLLM's sleep mode state: this engine has no sleep mode, it is always awake
        sleep = vllm(Gauge, "engine_sleep_state", "Engine sleep state: always awake here (no "
                     "sleep mode)", ["sleep_state"])
        for state in ("awake", "weights_offloaded", "discard_all"):
            sleep.labels(**labels, sleep_state=state).set(state == "awake")
        # Speculative decoding: accepted drafts by their position in the step's drafts.
        self.accepted_per_pos = vllm(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the drafts",
                                     ["position"])
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(**labels, position=str(pos))
        # Every finished request, labelled by why it ended (stop, length, abort here).
        self.success = vllm(Counter, "request_success", "Requests finished, by finish reason",
                            ["finished_reason"])
        for reason in _FINISH_REASONS:
            self.success.labels(**labels, finished_reason=reason)
        # vLLM's info gauge: the KV cache's configuration in its labels, set once the engine
        # is up (it labels it by engine only).
        self.cache_info = Gauge(V + "cache_config_info", "The KV cache's configuration, in "
                                "the labels (the value is 1)",
                                ["engine", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                 "enable_prefix_caching", "cache_dtype", "kv_cache_size_tokens"],
                                registry=r)
        self._cache_info_set: tuple = ()
        self.lora_info: Optional[Gauge] = None      # registered with LoRA only, as vLLM
        self.ttft = vllm(Histogram, "time_to_first_token_seconds", "Time to first token",
                         buckets=bounds("time_to_first_token", _LATENCY_BUCKETS))
        self.tpot = vllm(Histogram, "request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request",
                         buckets=bounds("inter_token_latency", _TPOT_BUCKETS))
        self.e2e = vllm(Histogram, "e2e_request_latency_seconds", "Request latency",
                        buckets=bounds("request_latency", _LATENCY_BUCKETS))
        self.queue = vllm(Histogram, "request_queue_time_seconds", "Time waiting to start",
                          buckets=bounds("request_latency", _LATENCY_BUCKETS))
        self.prompt_len = vllm(Histogram, "request_prompt_tokens", "Prompt tokens per request",
                               buckets=bounds("request_tokens", _TOKEN_BUCKETS))
        self.output_len = vllm(Histogram, "request_generation_tokens",
                               "Tokens generated per request",
                               buckets=bounds("request_tokens", _TOKEN_BUCKETS))
        self.prefill_time = vllm(Histogram, "request_prefill_time_seconds", "Time from first "
                                 "scheduled to the first token",
                                 buckets=bounds("request_latency", _PHASE_BUCKETS))
        self.decode_time = vllm(Histogram, "request_decode_time_seconds", "Time from the first "
                                "token to the last",
                                buckets=bounds("request_latency", _PHASE_BUCKETS))
        self.inference_time = vllm(Histogram, "request_inference_time_seconds", "Time from "
                                   "first scheduled to the last token (prefill and decode)",
                                   buckets=bounds("request_latency", _PHASE_BUCKETS))
        self.params_n = vllm(Histogram, "request_params_n", "The n request parameter",
                             buckets=bounds("request_params_n", _N_BUCKETS))
        self.params_max_tokens = vllm(Histogram, "request_params_max_tokens", "The max_tokens "
                                      "request parameter (capped to fit max_model_len)",
                                      buckets=bounds("request_tokens", _TOKEN_BUCKETS))
        self.max_generation = vllm(Histogram, "request_max_num_generation_tokens", "Tokens "
                                   "generated per request by its longest sequence",
                                   buckets=bounds("request_tokens", _TOKEN_BUCKETS))
        self.preemptions = vllm(Histogram, "request_num_preemptions", "Times a request was "
                                "preempted",
                                buckets=bounds("request_num_preemptions", _PREEMPTION_BUCKETS))
        self.prefill_computed = vllm(Histogram, "request_prefill_kv_computed_tokens", "Prompt "
                                     "tokens computed per request (cached ones left out)",
                                     buckets=bounds("request_tokens", _TOKEN_BUCKETS))
        # Counted by the engine per step.
        self.iteration_tokens = _EngineHistogram(
            V + "iteration_tokens_total", "Tokens per engine step (prefill chunks and "
            "decodes)", labels, bounds("iteration_tokens", ITERATION_TOKENS_BUCKETS), r)
        self.itl = _EngineHistogram(
            V + "inter_token_latency_seconds", "Time between a sequence's tokens",
            labels, bounds("inter_token_latency", INTER_TOKEN_LATENCY_BUCKETS), r)
        residency = bounds("kv_cache_residency", KV_CACHE_RESIDENCY_BUCKETS)
        self.kv_residency = {field: _EngineHistogram(V + name, doc, labels, residency, r)
                             for field, (name, doc) in _KV_RESIDENCY.items()
                             } if kv_cache_metrics else {}
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
        for outcome in ("done", "failed", "timeout"):      # each at 0 from the start
            self.kv_transfers.labels(outcome=outcome)
        self.kv_blocks_held = Gauge(P + "kv_blocks_held", "KV blocks held for transfers in "
                                    "flight (deferred release)", registry=r)
        self.kv_loads = Gauge(P + "kv_loads_in_flight", "Requests waiting for their KV from "
                              "another instance", registry=r)

    @classmethod
    def for_engine(cls, model_name: str, engine_args) -> "ServerMetrics":
        """The metrics of an engine of ``engine_args`` (its drafts per step, its
        --custom-histogram-buckets), labelled ``model_name``."""
        spec = SpeculativeConfig.from_value(engine_args.speculative_config)
        return cls(model_name, spec.num_speculative_tokens if spec is not None else 0,
                   check_histogram_buckets(engine_args.custom_histogram_buckets),
                   engine_args.kv_cache_metrics)

    def update(self, s: EngineStats, cache_info: tuple = (),
               max_loras: Optional[int] = None, admission_rejections: Optional[dict] = None
               ) -> None:
        """``cache_info``: the engine's ``EngineLimits.cache``; ``max_loras``: its LoRA
        bound (None without LoRA); ``admission_rejections``: requests refused by each
        admission limit so far (``AsyncLLMEngine.admission_rejections``)."""
        if cache_info and cache_info != self._cache_info_set:
            self.cache_info.clear()
            self.cache_info.labels(engine="0", **dict(cache_info)).set(1)
            self._cache_info_set = cache_info
        if max_loras is not None:
            self._update_lora_info(s, max_loras)
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting + s.kv_loads_in_flight)
        self.waiting_capacity.set(s.num_waiting)
        self.waiting_deferred.set(s.kv_loads_in_flight)
        self.swapped.set(s.num_swapped)
        self.kv_usage.set(s.kv_cache_usage)
        self.cpu_usage.set(s.cpu_cache_usage)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        for table, counters in ((_VLLM_COUNTERS, self.vllm_counters),
                                (_COUNTERS, self.counters)):
            for name, (attr, _) in table.items():
                self._advance(name, counters[name], getattr(s, attr))
        by_source = s.prompt_tokens_by_source
        for source, value in by_source.items():
            self._advance(("prompt", source), self.prompt_sources[source], value)
        self._advance("prompt_tokens", self.prompt_tokens, sum(by_source.values()))
        self._advance("prompt_tokens_cached", self.cached_tokens,
                      by_source["local_cache_hit"] + by_source["external_kv_transfer"])
        for tier, source in _CACHED_SOURCES.items():
            if source is not None:
                self._advance(("cached", tier), self.cached_sources[tier], by_source[source])
        for reason, value in (admission_rejections or {}).items():
            self._advance(("admission", reason), self.admission_rejections[reason], value)
        for pos, value in enumerate(s.spec_decode_accepted_per_pos):
            self._advance(("spec_pos", pos), self.accepted_per_pos.labels(
                **self._labels, position=str(pos)), value)
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
        self.iteration_tokens.advance(s.iteration_tokens)
        self.itl.advance(s.inter_token_latency)
        for field, histogram in self.kv_residency.items():
            histogram.advance(getattr(s, field))
        for m in s.finished_requests:       # once per request, as vLLM
            self.params_n.observe(m.n)
            self.max_generation.observe(m.num_generation_tokens)
        for m in s.finished_sequences:      # each of n's, as vLLM
            prefilled = m.first_token_time is not None
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot),
                                (self.e2e, m.e2e_latency), (self.queue, m.time_in_queue),
                                (self.prompt_len, m.num_prompt_tokens),
                                (self.output_len, m.num_generation_tokens),
                                (self.prefill_time, m.prefill_time),
                                (self.decode_time, m.decode_time),
                                (self.inference_time, m.inference_time),
                                (self.params_max_tokens, m.max_tokens),
                                (self.preemptions, m.num_preemptions),
                                (self.prefill_computed, m.num_prompt_tokens
                                 - m.num_cached_tokens if prefilled else None)):
                if value is not None:
                    hist.observe(value)

    def _update_lora_info(self, s: EngineStats, max_loras: int) -> None:
        """vLLM's lora_requests_info: the adapters running and waiting now, comma-joined in
        its labels; the value is when that set was last seen (vLLM keeps earlier sets too, so
        a dashboard takes the series with the latest value)."""
        if self.lora_info is None:
            self.lora_info = Gauge(V + "lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters",
                                    "running_lora_adapters"], registry=self.registry)
        self.lora_info.labels(max_lora=str(max_loras),
                              waiting_lora_adapters=",".join(s.waiting_lora_adapters),
                              running_lora_adapters=",".join(s.running_lora_adapters)
                              ).set_to_current_time()

    def _advance(self, key, counter, value: int) -> None:
        """Move a counter on by what the engine counted since the previous scrape."""
        last = self._last.get(key, 0)
        if value > last:
            counter.inc(value - last)
            self._last[key] = value

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
