"""``--reasoning-parser``: a chat answer's thinking, split off its content as vLLM 0.32 does
for Qwen3 (``qwen3``) and DeepSeek-R1 and its distills (``deepseek_r1``).

The model thinks first, between ``<think>`` and ``</think>``. Its chat template may have put
``<think>`` in the prompt already, so the generated text is taken as reasoning from its first
character: a ``<think>`` in it is dropped, and the first ``</think>`` ends the reasoning
(dropped too); everything after it is content. A text with no ``</think>`` is all reasoning.
For ``qwen3`` a ``<tool_call>`` also ends the reasoning (kept, for the tool parser), a
``</think>`` in the content is dropped (vLLM's Qwen3 parser absorbs a repeated one), and with
the template variable ``enable_thinking`` false the whole text is content.

The markers are the tokenizer's own tokens when it has each as one token (Qwen3's and
DeepSeek-R1's do), as vLLM finds them: a text that merely spells ``</think>`` (a user's words
repeated, a JSON string) is text. A marker token's place in the text is its occurrence there
after the occurrences that the tokens before it spell. With a tokenizer that lacks them the
markers are found in the text, a few characters of a possible marker held back between
pieces. ``ReasoningStream.feed`` looks only at the new piece (and, at a marker token, decodes
the tokens before it once).
"""
from __future__ import annotations

from typing import Optional, Sequence

from llm_serving.engine.reasoning_end import ReasoningEnd, marker_token_id
from llm_serving.reasoning_config import THINK_END, THINK_START

TOOL_CALL_START = "<tool_call>"


class ReasoningStream:
    """One choice's text, piece by piece (with the piece's token ids, when a tokenizer is
    given): each ``feed`` gives the (reasoning, content) the piece adds; ``finish`` gives what
    was held back at the end."""

    def __init__(self, name: str, thinking: bool = True, tokenizer=None):
        self.reasoning = thinking or name != "qwen3"
        self._qwen3 = name == "qwen3"
        markers = [THINK_START, THINK_END] + ([TOOL_CALL_START] if self._qwen3 else [])
        self._tokenizer = tokenizer
        self._by_id: dict[int, str] = {}
        if tokenizer is not None:
            by_id = {marker_token_id(tokenizer, m): m for m in markers}
            if None not in by_id:
                self._by_id = by_id
        self._markers = markers
        self._held = ""
        # by token: every id and the text so far, the marker tokens whose text is to come
        # (global occurrence number, marker), and where the unread text begins
        self._ids: list[int] = []
        self._text = ""
        self._pending: list[tuple[int, str]] = []

    def feed(self, piece: str, ids: Optional[Sequence[int]] = None) -> tuple[str, str]:
        if self._by_id and ids is not None:
            begin = len(self._text)
            self._text += piece
            for k, tid in enumerate(ids):
                marker = self._by_id.get(tid)
                if marker is not None:
                    before = self._tokenizer.decode(self._ids + list(ids[:k]))
                    self._pending.append((before.count(marker), marker))
            self._ids.extend(ids)
            return self._split(piece, self._spans(begin))
        text = self._held + piece
        self._held = ""
        spans = _find_all(text, self._active())
        reasoning, content = self._split(text, spans)
        keep = self._partial_marker(text, spans)
        if keep:            # the end of the text, on the side of the state it leaves
            self._held = text[-keep:]
            if self.reasoning:
                reasoning = reasoning[:-keep]
            else:
                content = content[:-keep]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back as the possible start of a marker: text after all."""
        held, self._held = self._held, ""
        return ("", held) if not self.reasoning else (held, "")

    def _active(self) -> list[str]:
        """The markers the text is searched for (by text)."""
        if self.reasoning:
            return self._markers
        return [THINK_END] if self._qwen3 else []

    def _spans(self, begin: int) -> list[tuple[int, str]]:
        """The marker tokens' (place in the piece starting at ``begin``, marker) whose text has
        come; the others stay pending."""
        spans, waiting = [], []
        for nth, marker in self._pending:
            at = -1
            for _ in range(nth + 1):
                at = self._text.find(marker, at + 1)
                if at < 0:
                    break
            if at < 0:
                waiting.append((nth, marker))
            elif at >= begin:
                spans.append((at - begin, marker))
        self._pending = waiting
        return sorted(spans)

    def _split(self, text: str, spans: list[tuple[int, str]]) -> tuple[str, str]:
        """(reasoning, content) of ``text`` with its markers at ``spans``, moving the state."""
        reasoning, content = [], []
        pos = 0
        for at, marker in spans:
            if at < pos:
                continue
            (reasoning if self.reasoning else content).append(text[pos:at])
            pos = at + len(marker)
            if self.reasoning:
                if marker != THINK_START:
                    self.reasoning = False
                    if marker == TOOL_CALL_START:
                        pos = at                # kept, for the tool parser
            elif marker != THINK_END or not self._qwen3:
                pos = at                        # text in the content
        (reasoning if self.reasoning else content).append(text[pos:])
        return "".join(reasoning), "".join(content)

    def _partial_marker(self, text: str, spans) -> int:
        """The length of the longest end of ``text`` (after its last marker) that begins a
        marker still looked for."""
        floor = spans[-1][0] + len(spans[-1][1]) if spans else 0
        longest = 0
        for marker in self._active():
            for n in range(min(len(marker) - 1, len(text) - floor), longest, -1):
                if text.endswith(marker[:n]):
                    longest = n
                    break
        return longest


class Thoughts:
    """One choice's thinking as its pieces stream (chat's and /v1/responses'): each piece's
    (reasoning, content) split (``ReasoningStream``) and the reasoning tokens so far
    (``ReasoningTokens``, usage's reasoning_tokens)."""

    def __init__(self, name: str, thinking: bool, tokenizer):
        self._split = ReasoningStream(name, thinking, tokenizer)
        self._count = ReasoningTokens(name, thinking, tokenizer)

    @property
    def tokens(self) -> int:
        return self._count.count

    def feed(self, piece: str, ids: Sequence[int], last: bool) -> tuple[str, str]:
        """(reasoning, content) of a piece and its token ids; ``last``: the answer's."""
        self._count.feed(ids)
        thought, text = self._split.feed(piece, ids)
        if last:
            held_thought, held_text = self._split.finish()
            thought, text = thought + held_thought, text + held_text
        return thought, text


def _find_all(text: str, markers: list[str]) -> list[tuple[int, str]]:
    """Every occurrence of the markers in ``text``, left to right, not overlapping."""
    spans, pos = [], 0
    while markers:
        found = None
        for marker in markers:
            at = text.find(marker, pos)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, marker)
        if found is None:
            break
        spans.append(found)
        pos = found[0] + len(found[1])
    return spans


def split(text: str, name: str, thinking: bool = True, ids: Optional[Sequence[int]] = None,
          tokenizer=None) -> tuple[Optional[str], Optional[str]]:
    """A whole answer's (reasoning, content), each None when empty (as vLLM)."""
    stream = ReasoningStream(name, thinking, tokenizer)
    reasoning, content = stream.feed(text, ids)
    held_r, held_c = stream.finish()
    reasoning, content = reasoning + held_r, content + held_c
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


def gate_grammar(params, args, thinking: bool, include_reasoning: bool, prompt: str,
                 prompt_ids: list[int], tokenizer) -> Optional[str]:
    """The parser that splits the answer (None: no split), ``args.reasoning_parser``. Under a
    grammar the model thinks first and the grammar holds from the end of its thinking
    (``params.reasoning_end``, as vLLM); from the first token, with no split, when the prompt
    left no thinking to do or ``include_reasoning`` is false (vLLM's too, which then has no
    thinking to show). With structured_outputs_config's enable_in_reasoning the grammar holds
    from the first token, thinking included, and the answer is split as without a grammar."""
    name = args.reasoning_parser
    if name is None or params.structured_outputs is None:
        return name
    if args.structured_outputs_config["enable_in_reasoning"]:
        return name
    if include_reasoning and not ended_in_prompt(name, thinking, prompt, prompt_ids,
                                                 tokenizer):
        params.reasoning_end = THINK_END
        return name
    return None


def thinking_enabled(template_kwargs: dict) -> bool:
    """Whether the chat template was asked to let the model think (Qwen3's
    ``enable_thinking``, true unless set false)."""
    return bool(template_kwargs.get("enable_thinking", True))
