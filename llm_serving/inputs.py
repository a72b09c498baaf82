"""The prompt shapes ``LLM.generate`` takes besides a plain string, with vLLM's names
(``vllm.inputs.TextPrompt`` / ``TokensPrompt``): a script imports them from here instead.

Either may carry vLLM's ``cache_salt``: the prompt's prefix-cache blocks are then shared only
with prompts of the same salt (the salt enters the hash of its first block)."""
from __future__ import annotations

from typing import List, Optional, TypedDict

# vLLM's bounds on a cache_salt
MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN = "@/\\\0"


def cache_salt_problem(salt: Optional[object]) -> Optional[str]:
    """What vLLM's checks find wrong with a ``cache_salt`` (None: nothing, or no salt)."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        return f"must be a non-empty string, got a {type(salt).__name__}"
    if not salt:
        return "must be a non-empty string, got an empty one"
    if len(salt) > MAX_CACHE_SALT_LENGTH or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        return (f"must be at most {MAX_CACHE_SALT_LENGTH} characters and must not contain "
                "'@', '/', '\\' or NUL (as vLLM)")
    return None


def check_cache_salt(salt: Optional[object]) -> None:
    """vLLM's checks of a ``cache_salt``; ValueError naming it."""
    problem = cache_salt_problem(salt)
    if problem is not None:
        raise ValueError(f"cache_salt: {problem}")


def salt_of(prompt) -> Optional[str]:
    """A prompt's cache_salt (None for a string or a dict without one)."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def with_cache_salt(prompts: list, salt: Optional[str]) -> list:
    """The prompts (texts or dicts) with ``salt`` as their cache_salt (None: as they are)."""
    if salt is None:
        return prompts
    return [{**(p if isinstance(p, dict) else {"prompt": p}), "cache_salt": salt}
            for p in prompts]


class _Salted(TypedDict, total=False):
    cache_salt: str


class TextPrompt(_Salted):
    """A text, tokenized by the engine as a plain string is."""
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: List[int]


class TokensPrompt(_TokenIds, _Salted, total=False):
    """Token ids, used as given; ``prompt``, if given, is echoed back as RequestOutput.prompt."""
    prompt: str


class EmbedsPrompt(_Salted):
    """vLLM's: a prompt given as its input embeddings, a (tokens, hidden_size) float torch
    tensor or NumPy array (enable_prompt_embeds=True; prompt_embeds.py)."""
    prompt_embeds: object

