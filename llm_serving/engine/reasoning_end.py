"""Where a thinking model's reasoning ends in its output, so that a grammar (response_format,
structured_outputs, a forced tool call) applies from the token after it, as vLLM 0.32 does
with ``--reasoning-parser``: the model thinks freely, then answers under the grammar.

The end is the marker's token (``</think>``) when the tokenizer has the marker as one token
(Qwen3's and DeepSeek-R1's do): a text that merely spells it does not end the reasoning. With a
tokenizer that has no such token the marker is looked for in the decoded text.
"""
from __future__ import annotations

from typing import Optional, Sequence


def marker_token_id(tokenizer, marker: str) -> Optional[int]:
    """The marker's token id when the tokenizer encodes it as exactly one token."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ReasoningEnd:
    """One sequence's search for the end of its reasoning, fed its output tokens as they come."""

    def __init__(self, tokenizer, marker: str, marker_id: Optional[int]):
        self._tokenizer = tokenizer
        self._marker = marker
        self._marker_id = marker_id
        self._tail = ""      # text mode: the last characters seen, which may begin the marker

    def feed(self, ids: Sequence[int]) -> Optional[int]:
        """The index in ``ids`` of the first token after the marker, once it is there (it
        may be ``len(ids)``); None while the reasoning goes on."""
        for k, tid in enumerate(ids):
            if self._marker_id is not None:
                if tid == self._marker_id:
                    return k + 1
                continue
            text = self._tail + self._tokenizer.decode([tid])
            if self._marker in text:
                return k + 1
            self._tail = text[-(len(self._marker) - 1):]
        return None
