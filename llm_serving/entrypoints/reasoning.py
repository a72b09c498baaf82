"""``--reasoning-parser``: a chat answer's thinking, split off its content as vLLM 0.32 does
for Qwen3 (``qwen3``) and DeepSeek-R1 and its distills (``deepseek_r1``).

The model thinks first, between ``<think>`` and ``</think>``. Its chat template may have put
``<think>`` in the prompt already, so the generated text is taken as reasoning from its first
character: a ``<think>`` in it is dropped, and the first ``</think>`` ends the reasoning
(dropped too); everything after it is content, verbatim. A text with no ``</think>`` is all
reasoning. For ``qwen3`` a ``<tool_call>`` also ends the reasoning (kept, for the tool
parser), and with the template variable ``enable_thinking`` false the whole text is content.

The markers are found in the text (Qwen3's and DeepSeek-R1's tokenizers decode them as text),
incrementally: ``ReasoningStream.feed`` looks only at the new piece and the few characters of
a marker held back from the last one.
"""
from __future__ import annotations

from typing import Optional

from llm_serving.engine.reasoning_end import ReasoningEnd, marker_token_id

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


class ReasoningStream:
    """One choice's text, piece by piece: each ``feed`` gives the (reasoning, content) the
    piece adds; ``finish`` gives what was held back at the end."""

    def __init__(self, name: str, thinking: bool = True):
        self.reasoning = thinking or name != "qwen3"
        # (marker, ends the reasoning, kept in the content)
        self._markers = [(THINK_START, False, False), (THINK_END, True, False)]
        if name == "qwen3":
            self._markers.append((TOOL_CALL_START, True, True))
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        if not self.reasoning:
            return "", piece
        text = self._held + piece
        self._held = ""
        parts = []
        while True:
            found = None
            for marker, ends, kept in self._markers:
                at = text.find(marker)
                if at >= 0 and (found is None or at < found[0]):
                    found = (at, marker, ends, kept)
            if found is None:
                break
            at, marker, ends, kept = found
            parts.append(text[:at])
            if ends:
                self.reasoning = False
                return "".join(parts), text[at:] if kept else text[at + len(marker):]
            text = text[at + len(marker):]
        keep = self._partial_marker(text)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        parts.append(text)
        return "".join(parts), ""

    def finish(self) -> tuple[str, str]:
        """What was held back as the possible start of a marker: reasoning after all."""
        held, self._held = self._held, ""
        return held, ""

    def _partial_marker(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a marker."""
        longest = 0
        for marker, _, _ in self._markers:
            for n in range(min(len(marker) - 1, len(text)), longest, -1):
                if text.endswith(marker[:n]):
                    longest = n
                    break
        return longest


class Counted:
    """A ``ReasoningStream`` that also counts the reasoning's generated tokens (usage's
    reasoning_tokens, as vLLM counts the tokens between the markers): a piece's tokens count
    while the reasoning goes on after it (a piece held back as a possible marker too), or
    when it adds reasoning and no content; the markers' own do not."""

    def __init__(self, name: str, thinking: bool = True):
        self.stream = ReasoningStream(name, thinking)
        self.tokens = 0

    def feed(self, piece: str, tokens: int, last: bool) -> tuple[str, str]:
        """(reasoning, content) of a piece of ``tokens`` tokens; ``last``: the answer's."""
        thought, text = self.stream.feed(piece)
        if last:
            thought += self.stream.finish()[0]
        if (self.stream.reasoning and piece != THINK_START) or (thought and not text):
            self.tokens += tokens
        return thought, text


def split(text: str, name: str, thinking: bool = True) -> tuple[Optional[str], Optional[str]]:
    """A whole answer's (reasoning, content), each None when empty (as vLLM)."""
    stream = ReasoningStream(name, thinking)
    reasoning, content = stream.feed(text)
    reasoning += stream.finish()[0]
    return reasoning or None, content or None


class ReasoningTokens:
    """A choice's reasoning tokens (vLLM's usage.completion_tokens_details.reasoning_tokens):
    its tokens before the end of its thinking, the ``<think>`` tokens left out; fed its token
    ids as they come. The end is found as a grammar finds it (engine/reasoning_end.py): by
    token where the tokenizer has the marker as one token, else in the text (there the
    marker's first pieces count too)."""

    def __init__(self, name: str, thinking: bool, tokenizer):
        self.count = 0
        self._done = name == "qwen3" and not thinking
        ends = [THINK_END, TOOL_CALL_START] if name == "qwen3" else [THINK_END]
        self._ends = [ReasoningEnd(tokenizer, m, marker_token_id(tokenizer, m)) for m in ends]
        self._start = marker_token_id(tokenizer, THINK_START)

    def feed(self, ids) -> None:
        if self._done:
            return
        n = len(ids)
        for end in self._ends:
            at = end.feed(ids)
            if at is not None and at - 1 < n:
                n = at - 1
                self._done = True
        self.count += n - list(ids[:n]).count(self._start)


# Qwen3's turn boundaries (ChatML): the prompt's last one begins the turn being answered.
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


def ended_in_prompt(name: str, thinking: bool, prompt: str, prompt_ids: list[int],
                    tokenizer) -> bool:
    """Whether the prompt leaves the model past its thinking (vLLM's ``is_reasoning_end`` on
    the prompt, which decides if a grammar holds from the first token): its last marker is a
    ``</think>``. For qwen3, a turn boundary after the last marker means the answer is still
    to think (unless ``enable_thinking`` is false: then there is no thinking to wait for).
    Markers are the tokenizer's single tokens when it has them, else the text's."""
    if name == "qwen3" and not thinking:
        return True
    kinds = {THINK_START: False, THINK_END: True}
    if name == "qwen3":
        kinds.update(dict.fromkeys(TURN_BOUNDARIES, False))
    ids = {marker_token_id(tokenizer, m): m for m in kinds}
    if None not in ids:
        for tid in reversed(prompt_ids):
            if tid in ids:
                return kinds[ids[tid]]
        return False
    last = max(kinds, key=prompt.rfind)
    return prompt.rfind(last) >= 0 and kinds[last]


def thinking_enabled(template_kwargs: dict) -> bool:
    """Whether the chat template was asked to let the model think (Qwen3's
    ``enable_thinking``, true unless set false)."""
    return bool(template_kwargs.get("enable_thinking", True))
