"""Multi-stream's knobs: when a step is split into micro-batches, and how they overlap.

``--enable-multi-stream`` (CLI) or ``enable_multi_stream: true`` turns it on; the
``multi_stream:`` YAML section (or ``EngineArgs.multi_stream``, a dict) sets the knobs below.
It is off by default: published systems lose at small batches, and so do we below the
thresholds (see docs/multistream.md for the measurements behind the defaults).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from llm_serving.errors import ConfigError

APPLY_TO = ("prefill", "decode", "both")
# sequential: the micro-batch schedule with blocking communication (the reference; any
# device, TP=1 included). overlapped: micro-batch A's all-reduces run while B computes (CPU:
# a communication thread over the host shared-memory all-reduce; Ascend: a second stream).
# auto: overlapped where there is communication to hide (TP >= 2), else off.
OVERLAP = ("auto", "sequential", "overlapped")


@dataclass(frozen=True)
class MultiStreamConfig:
    num_micro_batches: int = 2
    # A step is split only with at least this many tokens in all (512: decode steps of up to
    # 256 sequences stay whole; split, they ran 12-18% slower on CPU, docs/multistream.md) ...
    min_total_tokens: int = 512
    # ... and, if it holds any prefill, at least this many prefill tokens.
    min_prefill_tokens: int = 256
    # The two halves' token counts may differ by at most this fraction of the step's tokens.
    max_imbalance: float = 0.25
    apply_to: str = "both"
    overlap: str = "auto"

    def __post_init__(self):
        def positive(key, value, low=1):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"multi_stream.{key}",
                                  f"expected an integer >= {low}, got {value!r}")
        if self.num_micro_batches != 2:
            raise ConfigError("multi_stream.num_micro_batches",
                              f"only 2 micro-batches are supported, got {self.num_micro_batches!r}")
        positive("min_total_tokens", self.min_total_tokens, 2)
        positive("min_prefill_tokens", self.min_prefill_tokens, 0)
        m = self.max_imbalance
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            raise ConfigError("multi_stream.max_imbalance",
                              f"expected a fraction between 0 and 1, got {m!r}")
        for key, allowed in (("apply_to", APPLY_TO), ("overlap", OVERLAP)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"multi_stream.{key}", f"expected one of "
                                  f"{', '.join(allowed)}, got {getattr(self, key)!r}")

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "MultiStreamConfig":
        """From the YAML section / EngineArgs.multi_stream; unknown keys are refused by name."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"multi_stream.{key}", "unknown key; known ones are "
                                  + ", ".join(sorted(known)))
        return cls(**data)

    def mode(self, tp_size: int, device: str, cpu_allreduce: str = "shm") -> tuple[str, str]:
        """(how the split runs: "sequential", "overlapped" or "off", and why), decided once
        at start-up from the parallel setup (the master and every agent decide alike)."""
        if self.overlap == "sequential":
            return "sequential", "overlap=sequential (the reference schedule, no overlap)"
        if tp_size < 2:
            if self.overlap == "overlapped":
                raise ConfigError("multi_stream.overlap", "overlapped needs "
                                  "tensor_parallel_size >= 2: with one rank there is no "
                                  "communication to overlap")
            return "off", ("tensor_parallel_size is 1: there is no communication to overlap, "
                           "steps run unsplit")
        ascend = device.lower() in ("ascend", "npu")
        if not ascend and cpu_allreduce != "shm":
            if self.overlap == "overlapped":
                raise ConfigError("multi_stream.overlap", "overlapped on CPU needs "
                                  "cpu_allreduce=shm (mccl's all-reduce does not overlap)")
            return "off", ("cpu_allreduce is mccl, whose all-reduce does not overlap on CPU "
                           "(use cpu_allreduce=shm); steps run unsplit")
        where = ("a second stream for communication" if ascend
                 else "a communication thread over the shared-memory all-reduce")
        return "overlapped", f"micro-batch communication overlapped with compute ({where})"
