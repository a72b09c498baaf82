"""vLLM's ``--custom-histogram-buckets``: the /metrics histogram families whose bucket bounds a
deployment may set, and the check of the value (engine/metrics.py and entrypoints/metrics.py
build their histograms with them)."""
from __future__ import annotations

import math

from llm_serving.errors import ConfigError

# vLLM's --custom-histogram-buckets families (vllm/v1/metrics/buckets.py); kv_cache_residency
# is --kv-cache-metrics' three histograms.
HISTOGRAM_FAMILIES = ("request_latency", "time_to_first_token", "inter_token_latency",
                      "iteration_tokens", "request_params_n", "request_num_preemptions",
                      "request_tokens", "kv_cache_residency")


def check_histogram_buckets(value) -> dict:
    """--custom-histogram-buckets: family -> its bucket bounds (a non-empty, strictly
    increasing list of finite numbers > 0), as vLLM checks them; ConfigError naming the
    family otherwise."""
    key = "custom_histogram_buckets"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a mapping of bucket family to bounds, got {value!r}")
    for family, bounds in value.items():
        where = f"{key}.{family}"
        if family not in HISTOGRAM_FAMILIES:
            raise ConfigError(where, f"unknown bucket family (vLLM's are "
                              f"{', '.join(HISTOGRAM_FAMILIES)})")
        if not isinstance(bounds, list) or not bounds or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                and b > 0 for b in bounds):
            raise ConfigError(where, f"expected a non-empty list of finite numbers > 0, got "
                              f"{bounds!r}")
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(where, f"bounds {bounds} must be strictly increasing")
    return {family: tuple(bounds) for family, bounds in value.items()}
