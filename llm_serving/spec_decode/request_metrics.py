"""One sequence's speculative-decoding acceptance, for vLLM 0.32's per-request
``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics summary`` or
``detailed``): counted as each step's drafts are verified (the scheduler's
``settle_drafts``), nothing when the flag is off.

vLLM's definitions: ``histogram[j]`` counts the verify steps that accepted exactly ``j`` drafts
(``j`` from 0 to ``num_speculative_tokens``; the target's own token after them is not
counted); ``mean_acceptance_length`` is 1 + the accepted drafts per verify step (1 with no
verify step), ``draft_acceptance_rate`` the accepted drafts over the drafts proposed (0 with
none); ``detailed`` also keeps each step's accepted and proposed counts, in order (null
without, and with no verify step, as vLLM's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

LEVELS = ("none", "summary", "detailed")


@dataclass
class SpecDecodeRequestMetrics:
    num_spec_tokens: int
    detailed: bool = False
    histogram: list = field(default_factory=list)
    num_draft_tokens: int = 0
    per_step_accepted: list = field(default_factory=list)
    per_step_drafted: list = field(default_factory=list)

    def __post_init__(self):
        self.histogram = self.histogram or [0] * (self.num_spec_tokens + 1)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify step of ``drafted`` drafts, the first ``accepted`` of them taken."""
        self.histogram[accepted] += 1
        self.num_draft_tokens += drafted
        if self.detailed:
            self.per_step_accepted.append(accepted)
            self.per_step_drafted.append(drafted)

    def to_dict(self) -> dict:
        """The response's ``speculative_decoding`` object."""
        steps = sum(self.histogram)
        accepted = sum(j * c for j, c in enumerate(self.histogram))
        out = {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
               "draft_acceptance_rate": (accepted / self.num_draft_tokens
                                         if self.num_draft_tokens else 0.0),
               "acceptance_histogram": list(self.histogram), "num_spec_steps": steps,
               "num_accepted_draft_tokens": accepted, "num_draft_tokens": self.num_draft_tokens,
               "num_spec_tokens": self.num_spec_tokens}
        detailed = self.detailed and self.num_draft_tokens
        out.update(per_step_accepted=list(self.per_step_accepted) if detailed else None,
                   per_step_drafted=list(self.per_step_drafted) if detailed else None)
        return out
