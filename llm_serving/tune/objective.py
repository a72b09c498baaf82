"""What a trial is scored by: one number taken from ``clients/benchmark_serving.py``'s summary.

- ``throughput``: output tokens per second (higher is better);
- ``ttft-p99`` / ``tpot-p99``: the 99th percentile of time to first token / time per output
  token, in ms (lower is better);
- ``goodput``: requests per second that meet every SLO given with ``--slo`` (``ttft:500
  tpot:100 e2el:10000``, ms), benchmark_serving's definition (higher is better).
"""
from __future__ import annotations

from dataclasses import dataclass

from llm_serving.errors import ConfigError


@dataclass(frozen=True)
class Objective:
    name: str
    direction: str        # "maximize" | "minimize"
    unit: str
    slo: tuple = ()       # ("ttft:500", ...) for goodput

    def value(self, summary: dict) -> float:
        if self.name == "throughput":
            return float(summary["output_throughput"])
        if self.name == "ttft-p99":
            return float(summary["ttft_ms"]["p99"])
        if self.name == "tpot-p99":
            return float(summary["tpot_ms"]["p99"])
        return float(summary["request_goodput"])

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b

    @property
    def worse_when_slower(self) -> bool:
        """A run over the same requests that takes longer is worse: true of throughput (the
        output tokens are the same, so tok/s falls with the duration), not of latencies."""
        return self.name == "throughput"


OBJECTIVES = {"throughput": ("maximize", "output tok/s"), "ttft-p99": ("minimize", "ms"),
              "tpot-p99": ("minimize", "ms"), "goodput": ("maximize", "good req/s")}
SLO_KEYS = ("ttft", "tpot", "e2el")


def make_objective(name: str, slo: list[str] | None = None) -> Objective:
    if name not in OBJECTIVES:
        raise ConfigError("--objective", f"expected one of {', '.join(OBJECTIVES)}, got {name!r}")
    slo = list(slo or [])
    for item in slo:
        key, _, ms = item.partition(":")
        try:
            ok = key in SLO_KEYS and float(ms) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError("--slo", f"expected KEY:MS with KEY one of {', '.join(SLO_KEYS)} "
                              f"and MS > 0, got {item!r}")
    if name == "goodput" and not slo:
        raise ConfigError("--slo", "the goodput objective needs at least one SLO, e.g. "
                          "--slo ttft:500 tpot:100")
    if name != "goodput" and slo:
        raise ConfigError("--slo", f"only the goodput objective uses SLOs, not {name}")
    direction, unit = OBJECTIVES[name]
    return Objective(name, direction, unit, tuple(slo))
