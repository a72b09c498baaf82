"""``speculative_config``: vLLM's keys for n-gram (prompt lookup) speculative decoding.

Only ``method: "ngram"`` runs here; any other method (a draft model, eagle, mtp, ...) is a
ConfigError naming it. As vLLM: ``num_speculative_tokens`` (k) is required; with neither
``prompt_lookup_min`` nor ``prompt_lookup_max`` both are 5, with one the other takes its
value, and min must not exceed max.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from llm_serving.errors import ConfigError, config_mapping

KEY = "speculative_config"
_KNOWN = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
          "num_speculative_tokens_per_batch_size")
_SCHEDULE = "num_speculative_tokens_per_batch_size"
# The longest run of drafts per step this engine takes (vLLM has no bound; each draft is a
# query row of the step, and a long run is mostly rejected).
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    # vLLM 0.32's dynamic speculative decoding: (first, last, k) inclusive batch-size ranges,
    # sorted; see drafts_for_batch.
    per_batch_size: Optional[tuple] = None

    def drafts_for_batch(self, batch: int) -> int:
        """The most drafts a sequence gets when ``batch`` sequences run, as vLLM's schedule
        reads: the range holding ``batch``, else (a gap, or past the last range) the range
        before it; never more than num_speculative_tokens."""
        k = self.num_speculative_tokens
        if self.per_batch_size is None:
            return k
        chosen = self.per_batch_size[0][2]
        for first, _, drafts in self.per_batch_size:
            if first > batch:
                break
            chosen = drafts
        return min(k, chosen)

    @classmethod
    def from_value(cls, value: Union[dict, str, None]) -> Optional["SpeculativeConfig"]:
        """None (off), a mapping of vLLM's keys, or that mapping as JSON."""
        if value is None:
            return None
        value = config_mapping(KEY, value)
        unknown = sorted(set(value) - set(_KNOWN))
        if unknown:
            raise ConfigError(f"{KEY}.{unknown[0]}", "not supported here (n-gram speculative "
                              "decoding takes " + ", ".join(_KNOWN) + ")")
        method = value.get("method")
        if method in ("ngram", "[ngram]"):
            method = "ngram"
        elif method is None:
            raise ConfigError(f"{KEY}.method", 'missing: only "ngram" (prompt lookup) is '
                              "supported")
        else:
            raise ConfigError(f"{KEY}.method", f"{method!r} is not supported here: only "
                              '"ngram" (prompt lookup drafts, no draft model)')
        k = _positive(value, "num_speculative_tokens", required=True)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{KEY}.num_speculative_tokens", f"{k} is more than "
                              f"{MAX_SPECULATIVE_TOKENS}, the most drafts per step here")
        hi = _positive(value, "prompt_lookup_max")
        lo = _positive(value, "prompt_lookup_min")
        if hi is None and lo is None:
            hi = lo = 5
        hi = lo if hi is None else hi
        lo = hi if lo is None else lo
        if lo > hi:
            raise ConfigError(f"{KEY}.prompt_lookup_min", f"{lo} is more than "
                              f"prompt_lookup_max ({hi})")
        return cls(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                   method=method, per_batch_size=_schedule(value.get(_SCHEDULE)))


def max_sample_rows(spec: Optional[SpeculativeConfig], max_num_seqs: int,
                    max_num_batched_tokens: int) -> int:
    """The most rows a step samples: one a sequence, and one more for each draft."""
    if spec is None:
        return max_num_seqs
    return max_num_seqs + min(max_num_batched_tokens,
                              max_num_seqs * spec.num_speculative_tokens)


def _schedule(value) -> Optional[tuple]:
    """vLLM's num_speculative_tokens_per_batch_size: [first, last, k] ranges of batch sizes,
    positive, first <= last, k >= 0, not overlapping, the first starting at 1 (so every
    batch size has a k)."""
    if value is None:
        return None
    name = f"{KEY}.{_SCHEDULE}"
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(name, f"expected a non-empty list of [first, last, k], got {value!r}")
    ranges = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 \
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry):
            raise ConfigError(name, f"each entry is [first, last, k] (integers), got {entry!r}")
        first, last, k = entry
        if first <= 0 or last < first or k < 0:
            raise ConfigError(name, f"{list(entry)}: batch sizes are positive with first <= "
                              "last, and k >= 0")
        ranges.append((first, last, k))
    ranges.sort()
    for (_, last, _), (first, _, _) in zip(ranges, ranges[1:]):
        if first <= last:
            raise ConfigError(name, "the batch-size ranges overlap")
    if ranges[0][0] != 1:
        raise ConfigError(name, "the first range must start at batch size 1")
    return tuple(ranges)


def _positive(value: dict, key: str, required: bool = False) -> Optional[int]:
    v = value.get(key)
    if v is None:
        if required:
            raise ConfigError(f"{KEY}.{key}", "missing: how many draft tokens a step "
                              "verifies (k)")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{KEY}.{key}", f"expected a positive integer, got {v!r}")
    return v
