"""``LLM.get_metrics()``: the Prometheus metrics of an offline engine as Python objects.

vLLM's ``LLM(..., disable_log_stats=False).get_metrics()`` returns a list of ``Counter``,
``Gauge``, ``Histogram`` and ``Vector`` (``vllm.v1.metrics.reader``); these are the same
classes with the same fields, read from the registry ``/metrics`` serves (``metrics.py``), so
a script that walks them works unchanged. Series are taken as vLLM takes them: a counter's
``_total`` sample (an int), a histogram's buckets keyed by their ``le`` label ("+Inf"
included) with its count and sum, and the accepted draft tokens per speculative position
(``vllm:spec_decode_num_accepted_tokens_per_pos``, one counter per ``position`` label) as one
``Vector``. Besides vLLM's ``vllm:`` metrics, this server's own ``llm_serving:`` ones come too.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

_PREFIXES = ("vllm:", "llm_serving:")
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Counters by speculative position, in position order."""
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """``buckets``: upper bound ("0.5", ..., "+Inf") -> observations up to it (cumulative)."""
    count: int
    sum: float
    buckets: dict[str, int]


def _key(labels: dict, *drop: str) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of ``registry``'s metrics named with a served prefix."""
    out: list[Metric] = []
    for family in registry.collect():
        name = family.name
        if not name.startswith(_PREFIXES):
            continue
        samples = family.samples
        if family.type == "gauge":
            out += [Gauge(name, s.labels, s.value) for s in samples]
        elif family.type == "counter":
            totals = [s for s in samples if s.name == name + "_total"]
            if name == _PER_POSITION:
                out += _per_position(name, totals)
            else:
                out += [Counter(name, s.labels, int(s.value)) for s in totals]
        elif family.type == "histogram":
            series: dict[tuple, Histogram] = {}
            for s in samples:
                if s.name == name + "_bucket":
                    h = series.setdefault(_key(s.labels, "le"), Histogram(
                        name, {k: v for k, v in s.labels.items() if k != "le"}, 0, 0.0, {}))
                    h.buckets[s.labels["le"]] = int(s.value)
            for s in samples:
                h = series.get(_key(s.labels))
                if h is not None and s.name == name + "_count":
                    h.count = int(s.value)
                elif h is not None and s.name == name + "_sum":
                    h.sum = s.value
            out += series.values()
    return out


def _per_position(name: str, totals: list) -> list[Vector]:
    """One ``Vector`` per label set but ``position``, its values in position order."""
    by: dict[tuple, dict[int, int]] = {}
    labels: dict[tuple, dict] = {}
    for s in totals:
        key = _key(s.labels, "position")
        labels[key] = {k: v for k, v in s.labels.items() if k != "position"}
        by.setdefault(key, {})[int(s.labels["position"])] = int(s.value)
    return [Vector(name, labels[k], [v[p] for p in sorted(v)]) for k, v in by.items()]
