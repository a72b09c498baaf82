"""Incremental, UTF-8-safe detokenization with stop strings.

Text is produced with the prefix/read-offset method: each step decodes only a short window of
tokens, ``tokens[prefix_offset:]`` against ``tokens[prefix_offset:read_offset]``, and the difference
is the new text. A window whose text ends in U+FFFD (an incomplete multi-byte character split
across byte tokens) is held back until later tokens complete it; if the sequence ends first,
:meth:`flush` drops it (as vLLM: the output never ends in a character cut in two).
The cost of a step is proportional to the new tokens (plus a small window), not the output length.

Stop strings are matched on the visible text, including matches that span tokens. Text that
could be the start of a stop string is held back, so a delta never contains text that is later cut.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

__all__ = ["IncrementalDetokenizer"]

# How many prompt tokens give the first output tokens their context (e.g. the space a
# sentencepiece "▁word" token carries after a prompt). Same choice as vLLM.
_PROMPT_CONTEXT_TOKENS = 5
# How far back the context may start further, so that it does not begin inside a multi-byte character.
_MAX_BACKTRACK = 12


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    ``step(new_token_ids)`` returns the newly visible text; ``flush()`` returns what was held back
    once the sequence is finished. ``output_text`` is everything returned so far, ``stop_reason``
    the stop string that matched (None until one does); after a match, steps return "".
    With ``min_tokens``, a stop string counts only if it ends in the text of a later token
    (vLLM's rule): text within the first ``min_tokens`` tokens is released as it comes.

    Joined deltas equal ``tokenizer.decode(output_ids)`` when no stop string matched and the
    output does not end inside a multi-byte character (those bytes are dropped), for
    tokenizers whose decode does not depend on the preceding text (byte-level BPE). A Llama-style
    (sentencepiece) decode drops the leading space of its first token; here the prompt provides
    context, so the first word keeps its space as in ``decode(prompt + output)``.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: List[str] = [s for s in (stop or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: Optional[str] = None
        self.finished = False
        # As vLLM: a stop string counts only if it ends in the text of a token after the
        # first min_tokens (once this count is below 0); until then deltas go out whole.
        self._stop_free = min_tokens

        self._special = tokenizer.special_ids
        context = self._ids_to_tokens(list(prompt_token_ids)[-(_PROMPT_CONTEXT_TOKENS + _MAX_BACKTRACK):])
        # Only the tail of this list is ever read; earlier entries are dropped as offsets advance.
        self._tokens: List[str] = context
        self._read_offset = len(context)
        self._prefix_offset = self._context_start(context)

        self._pending = ""  # decoded text not yet returned (a possible stop-string start)
        self._chunks: List[str] = []  # the deltas returned so far
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._tail = ""  # the last max_stop_len - 1 chars returned: stop strings may start there
        # The text the last step's tokens added to the decoded output,
        # before stop strings are looked for ("" while they hold part of a character).
        self.last_piece = ""

    # --- public ---------------------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """The text returned so far (the joined deltas)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated token ids; return the newly visible text (possibly "")."""
        self.last_piece = ""
        if self.finished or not new_token_ids:
            return ""
        if self._stop_free >= 0:
            self._stop_free -= len(new_token_ids)
        # One token at a time, so that several give the text one by one would: the whole
        # characters before one they leave incomplete come out now.
        for token in self._ids_to_tokens(new_token_ids):
            self._tokens.append(token)
            prefix_text, new_text = self._window_texts()
            # Hold back while the window adds nothing or ends in an incomplete character.
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self.last_piece += new_text[len(prefix_text):]
                self._pending += new_text[len(prefix_text):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
                self._compact()
        return self._emit(final=False)

    def flush(self) -> str:
        """Finish: return the text still held back for stop strings. The bytes of a character
        the last tokens left incomplete are dropped, as vLLM drops them: the text does not
        end in U+FFFD for a character cut off by max_tokens or a stop token."""
        if self.finished:
            return ""
        delta = self._emit(final=True)
        self.finished = True
        return delta

    # --- internals ------------------------------------------------------------------------------

    def _ids_to_tokens(self, ids: Sequence[int]) -> List[str]:
        if self.skip_special_tokens and self._special:
            ids = [i for i in ids if i not in self._special]
        if not ids:
            return []
        # ids outside the tokenizer's vocabulary (a model vocab padded past it) have no text
        return [t for t in self.tokenizer.convert_ids_to_tokens(ids) if t is not None]

    def _context_start(self, context: List[str]) -> int:
        """Where the prompt context starts: 5 tokens back, or further back if that would start in
        the middle of a character split into byte tokens (its text would begin with U+FFFD)."""
        p = max(len(context) - _PROMPT_CONTEXT_TOKENS, 0)
        lowest = max(p - _MAX_BACKTRACK, 0)
        conv = self.tokenizer.convert_tokens_to_string
        while p > lowest and conv(context[p:]).startswith("\ufffd"):
            p -= 1
        return p

    def _window_texts(self):
        conv = self.tokenizer.convert_tokens_to_string
        p, r = self._prefix_offset, self._read_offset
        prefix_text = conv(self._tokens[p:r]) if r > p else ""
        new_text = conv(self._tokens[p:])
        return prefix_text, new_text

    def _compact(self) -> None:
        # Keep the token list short: everything before prefix_offset is never read again.
        if self._prefix_offset > 64:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _emit(self, final: bool) -> str:
        """Check stop strings on the new text and return the next delta."""
        pending = self._pending
        if not pending:
            return ""
        hold = 0
        if self.stop and self._stop_free < 0:
            tail = self._tail
            text = tail + pending  # short: stop strings can only start in the tail or the new text
            # The match that completes first wins (ties: the one starting first), so the result
            # does not depend on how the tokens were grouped into steps. A match ends in the new
            # text (the tail was searched before, or was released before stop strings counted).
            best, match, best_end = -1, None, -1
            for s in self.stop:
                i = text.find(s, max(len(tail) - len(s) + 1, 0))
                if i != -1:
                    end = i + len(s)
                    if match is None or end < best_end or (end == best_end and i < best):
                        best, match, best_end = i, s, end
            if match is not None:
                self.stop_reason = match
                self.finished = True
                cut = best + len(match) if self.include_stop_str_in_output else best
                delta = text[len(tail) : max(cut, len(tail))]
                self._pending = ""
                if delta:
                    self._chunks.append(delta)
                return delta
            if not final and not self.include_stop_str_in_output:
                hold = min(self._partial_stop_len(text), len(pending))
        delta = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        if delta:
            self._chunks.append(delta)
            keep = self._max_stop_len - 1
            if keep > 0:
                self._tail = (self._tail + delta)[-keep:]
        return delta

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.
        Only the places where a stop string's first character occurs are tried: a scan of
        the text per stop string, not one comparison per candidate length (which made long
        stop strings cost milliseconds per token on the engine thread)."""
        longest, n = 0, len(text)
        for s in self.stop:
            i = text.find(s[0], max(n - len(s) + 1, 0), n - longest)
            while i != -1:
                if s.startswith(text[i:]):
                    longest = n - i
                    break
                i = text.find(s[0], i + 1, n - longest)
        return longest
