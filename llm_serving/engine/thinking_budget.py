"""One sequence's ``thinking_token_budget``, as vLLM 0.32 enforces it.

The reasoning is open when the last start text (``<think>``) among the sequence's tokens,
prompt included (a chat template that opens it), comes after the last natural end
(``</think>``). Its tokens are those after the start text. Once they number the budget, the
next token is forced: the reasoning config's end text, token by token (the one after the part
of it the output already ends with), until the natural end closes the reasoning; then
generation goes on freely, and a reasoning opened again has the budget again.

The state is a few integers and the last tokens (fewer than the longest text), advanced over
the tokens a sequence gained since it was last asked; only requests with a budget have one.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from llm_serving.reasoning_config import ReasoningMarkers


def _last_match(ids: np.ndarray, pattern: tuple[int, ...]) -> int:
    """The start of the last occurrence of ``pattern`` in ``ids``, -1 when none."""
    n = ids.size - len(pattern) + 1
    if n <= 0:
        return -1
    hit = ids[:n] == pattern[0]
    for j in range(1, len(pattern)):
        hit &= ids[j:j + n] == pattern[j]
    found = np.flatnonzero(hit)
    return int(found[-1]) if found.size else -1


class ThinkingBudget:
    def __init__(self, markers: ReasoningMarkers, budget: int, prompt: Sequence[int]):
        self.markers = markers
        self.budget = budget
        self._keep = max(map(len, (markers.start, markers.natural_end, markers.forced_end))) - 1
        self.seen = 0               # output tokens looked at
        self.length = 0             # tokens looked at, prompt included
        self.start = self.end = -1  # where the last start and natural end texts begin
        self._tail: list[int] = []
        self._look(prompt)

    def _look(self, new: Sequence[int]) -> None:
        """Move over ``new`` tokens, finding the texts among them (and across the tail)."""
        window = np.asarray(self._tail + list(new), np.int64)
        base = self.length - len(self._tail)
        at = _last_match(window, self.markers.start)
        if at >= 0:
            self.start = base + at
        at = _last_match(window, self.markers.natural_end)
        if at >= 0:
            self.end = base + at
        self.length += len(new)
        self._tail = window[max(0, window.size - self._keep):].tolist() if self._keep else []

    def advance(self, output: Sequence[int]) -> None:
        """Look at the output tokens added since the last call."""
        if len(output) > self.seen:
            self._look(output[self.seen:])
            self.seen = len(output)

    def left(self) -> Optional[int]:
        """Reasoning tokens the budget still allows (<= 0: spent); None outside reasoning."""
        if self.start < 0 or self.start <= self.end:
            return None
        return self.budget - (self.length - self.start - len(self.markers.start))

    def may_force(self, unknown: int) -> bool:
        """Whether a token may be forced after ``unknown`` more tokens not yet known: the
        reasoning may spend its budget by then (or, with a budget of 0, open)."""
        left = self.left()
        return self.budget == 0 if left is None else left - unknown <= 0

    def forced(self) -> Optional[int]:
        """The token the next sample must be (None: free): the end text's next token once
        the budget is spent."""
        left = self.left()
        if left is None or left > 0:
            return None
        end = self.markers.forced_end
        done = next((k for k in range(min(len(end) - 1, len(self._tail)), 0, -1)
                     if tuple(self._tail[-k:]) == end[:k]), 0)
        return end[done]
