"""Engine statistics: a snapshot of the queues and the KV cache, counters since start, and the
per-request timings of requests finished since the last snapshot, ready to export as metrics.

One ``EngineStats`` object holds every counter. The engine owns it and hands it to the parts
that count (scheduler: preemptions; block manager: prefix-cache lookups; output processor:
requests, steps and tokens); ``LLMEngine.get_stats()`` adds the gauges to a copy.

What is measured per step (tokens per step, the gap before each token) goes into a
``StepHistogram``: counted into fixed buckets as it comes, so nothing grows between two reads.
The gaps cost one bisect per step: the tokens whose sequences had one in the previous step
share its gap (the output processor only compares each token's previous time with the
step's); a token whose sequence missed steps (preempted) is counted alone.
"""
from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field
from typing import Optional

from llm_serving.outputs import RequestMetrics

# vLLM's bucket bounds (vllm/v1/metrics/buckets.py) for the histograms filled per step.
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KV_CACHE_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10,
                              20, 30, 60, 120, 300, 600, 1200, 1800)
# Where a prompt's tokens came from (vLLM's ``PromptTokenStats`` sources): computed here,
# found in the prefix cache, loaded from another instance.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# The EngineStats histograms of --kv-cache-metrics (vLLM's names, less "_seconds").
KV_RESIDENCY_HISTOGRAMS = ("kv_block_lifetime", "kv_block_idle_before_evict",
                           "kv_block_reuse_gap")


def histogram_bounds(buckets: dict, family: str, default: tuple) -> tuple:
    """A histogram family's bounds: --custom-histogram-buckets', else ``default``."""
    return tuple(buckets[family]) if family in buckets else default


class StepHistogram:
    """Observations counted into buckets (``counts[i]``: values <= ``bounds[i]`` and above
    the bound before; the last: above every bound), with their sum, since the engine started.
    """
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> "StepHistogram":
        h = StepHistogram(self.bounds)
        h.counts, h.sum = list(self.counts), self.sum
        return h


@dataclass
class EngineStats:
    # Gauges, now.
    num_running: int = 0            # sequences
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0     # fraction of device KV blocks in use
    cpu_cache_usage: float = 0.0    # fraction of the host swap pool in use
    # LoRA: the names of the adapters of the running and of the waiting (or swapped)
    # sequences (vLLM's lora_requests_info labels).
    running_lora_adapters: tuple = ()
    waiting_lora_adapters: tuple = ()
    # Counters, since the engine started.
    num_requests: int = 0
    num_finished_requests: int = 0  # every ending: stop, length and abort (timeouts included)
    finished_by_reason: dict = field(default_factory=dict)   # finish reason -> sequences
    num_aborted_requests: int = 0
    num_timed_out_requests: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_steps: int = 0
    num_prefill_tokens: int = 0     # prompt (and recomputed) tokens run through the model
    num_generation_tokens: int = 0  # tokens sampled
    # Each request's prompt tokens once, by source, counted as its first token is sampled
    # (vLLM's prompt_tokens_total and prompt_tokens_by_source; recomputes are not in them).
    prompt_tokens_by_source: dict = field(
        default_factory=lambda: dict.fromkeys(PROMPT_TOKEN_SOURCES, 0))
    prefix_cache_queries: int = 0   # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # tokens found there
    # KV transfer (PD disaggregation): loads by outcome ("done", "failed", "timeout"), prefills
    # recomputed here after a failed load, offers held for readers, bytes received, prompt
    # tokens loaded instead of computed; blocks held for transfers and loads in flight (gauges).
    kv_transfers: dict = field(default_factory=dict)
    kv_transfer_recomputes: int = 0
    kv_transfers_offered: int = 0
    kv_transfer_bytes: int = 0
    kv_remote_prefill_tokens: int = 0
    # vLLM's external prefix cache: with a KV connector, each admitted request's prompt tokens
    # not found locally (queries) and those the connector loads (hits); not a preempted one's
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_blocks_held: int = 0
    kv_loads_in_flight: int = 0
    # Speculative decoding (vLLM's spec_decode_*): decodes verified with drafts, their draft
    # tokens, and the drafts accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list = field(default_factory=list)   # [position] -> count
    # Multi-stream: steps by how they ran ("split", or why not: multistream/split.py).
    multistream_steps: dict = field(default_factory=dict)
    # Per step: the tokens it ran through the model (prefill chunks and decodes), and the
    # time since each sampled token's previous one (vLLM's inter-token latency).
    iteration_tokens: StepHistogram = field(
        default_factory=lambda: StepHistogram(ITERATION_TOKENS_BUCKETS))
    inter_token_latency: StepHistogram = field(
        default_factory=lambda: StepHistogram(INTER_TOKEN_LATENCY_BUCKETS))
    # --kv-cache-metrics (engine/kv_cache_residency.py; None: off): the sampled blocks'
    # lifetimes, idle times before eviction and gaps between prefix-cache hits.
    kv_block_lifetime: Optional[StepHistogram] = None
    kv_block_idle_before_evict: Optional[StepHistogram] = None
    kv_block_reuse_gap: Optional[StepHistogram] = None
    # --enable-mfu-metrics (engine/mfu.py): the FLOPs, bytes read and bytes written estimated
    # for one device (a tensor-parallel rank) over the steps run (0 when off).
    estimated_flops: int = 0
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0
    # Requests finished since the previous snapshot (TTFT, TPOT and queue time are on each).
    finished_requests: list[RequestMetrics] = field(default_factory=list)
    # ... and each of their sequences as a request of its own (vLLM's metrics count each of a
    # request's n sequences: request_success, the per-request histograms but n's)
    finished_sequences: list[RequestMetrics] = field(default_factory=list)

    @classmethod
    def with_buckets(cls, buckets: dict, kv_residency: bool = False) -> "EngineStats":
        """Counters whose step histograms have --custom-histogram-buckets' bounds; with
        ``kv_residency`` (--kv-cache-metrics), the KV block residency histograms too."""
        stats = cls(iteration_tokens=StepHistogram(histogram_bounds(
                        buckets, "iteration_tokens", ITERATION_TOKENS_BUCKETS)),
                    inter_token_latency=StepHistogram(histogram_bounds(
                        buckets, "inter_token_latency", INTER_TOKEN_LATENCY_BUCKETS)))
        if kv_residency:
            bounds = histogram_bounds(buckets, "kv_cache_residency", KV_CACHE_RESIDENCY_BUCKETS)
            for name in KV_RESIDENCY_HISTOGRAMS:
                setattr(stats, name, StepHistogram(bounds))
        return stats

    def saved(self) -> dict:
        """Every counter and gauge now, for ``restore``."""
        return copy.deepcopy(vars(self))

    def restore(self, saved: dict) -> None:
        """Back to ``saved``, in place (the counting parts keep this object)."""
        for name, value in saved.items():
            setattr(self, name, value)

    @property
    def num_unfinished(self) -> int:
        """Sequences the engine holds: waiting, running and swapped out."""
        return self.num_waiting + self.num_running + self.num_swapped

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0
