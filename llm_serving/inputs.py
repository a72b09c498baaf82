"""The prompt shapes ``LLM.generate`` takes besides a plain string, with vLLM's names
(``vllm.inputs.TextPrompt`` / ``TokensPrompt``): a script imports them from here instead."""
from __future__ import annotations

from typing import List, TypedDict


class TextPrompt(TypedDict):
    """A text, tokenized by the engine as a plain string is."""
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: List[int]


class TokensPrompt(_TokenIds, total=False):
    """Token ids, used as given; ``prompt``, if given, is echoed back as RequestOutput.prompt."""
    prompt: str
