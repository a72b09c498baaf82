"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens in its prompt and output.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens are looked
for among the sequence's earlier tokens, and the latest occurrence found gives up to k drafts:
the tokens after it. The search is a few vectorized comparisons over the last
``SEARCH_WINDOW`` tokens (one per n-gram position), and each sequence keeps its tokens in a
numpy buffer that grows by the new tokens only, so nothing loops over the context in Python.

vLLM (v1/spec_decode/ngram_proposer.py) searches the whole context for the longest match and
takes its first occurrence; here the latest occurrence of the longest n wins (what follows the
most recent repeat is the likelier continuation), in a bounded window.
"""
from __future__ import annotations

import numpy as np

from llm_serving.engine.sequence import Sequence
from llm_serving.spec_decode.config import SpeculativeConfig

# The most recent tokens searched per sequence and step (prompt and output together).
SEARCH_WINDOW = 8192
_NO_DRAFTS: list[int] = []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, window: int = SEARCH_WINDOW):
        self.k = config.num_speculative_tokens
        self.drafts_for_batch = config.drafts_for_batch
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min
        self.window = window

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow the sequence's known tokens (none
        when no n-gram of its end recurs)."""
        limit = min(self.k, limit)
        if limit <= 0:
            return _NO_DRAFTS
        ctx = self._context(seq)
        size = len(ctx)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # hit[i]: ctx[i:i + n] equals the last n tokens, for the starts i < size - n
            # (an occurrence ending before the last token)
            last = ctx[size - n:]
            hit = ctx[:size - n] == last[0]
            for j in range(1, n):
                hit &= ctx[j:size - n + j] == last[j]
            found = np.flatnonzero(hit)
            if found.size:
                start = int(found[-1]) + n
                return ctx[start:start + limit].tolist()
        return _NO_DRAFTS

    def _context(self, seq: Sequence) -> np.ndarray:
        """The sequence's last ``window`` known tokens (prompt + output), from its buffer."""
        buf, used = seq.spec_context
        prompt = seq.prompt_token_ids
        total = len(prompt) + len(seq.output_token_ids)
        if buf is None or used > total:      # first time (or the output was reset)
            buf = np.empty(max(64, 2 * total), np.int32)
            buf[:len(prompt)] = prompt
            used = len(prompt)
        if total > len(buf):
            grown = np.empty(2 * total, np.int32)
            grown[:used] = buf[:used]
            buf = grown
        if total > used:
            p = len(prompt)
            buf[used:total] = seq.output_token_ids[used - p:total - p]
        seq.spec_context = (buf, total)
        return buf[max(0, total - self.window):total]


def takes_drafts(seq: Sequence) -> bool:
    """Whether a decoding sequence's request can be verified with drafts: not under a token
    mask that follows its own tokens (a grammar, allowed_token_ids, bad_words, a thinking
    budget), which would need each draft's matcher state."""
    p = seq.params
    return (p.grammar is None and p.structured_outputs is None and p.allowed_token_ids is None
            and not p.bad_words_token_ids and p.thinking_token_budget is None)
