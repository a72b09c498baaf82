"""``reasoning_config``: vLLM 0.32's ``--reasoning-config``, where a thinking model's reasoning
begins and the text forced to end it when a request's ``thinking_token_budget`` is spent.

Its keys are vLLM's:
- ``reasoning_parser``: the parser whose markers are the defaults (``qwen3`` and
  ``deepseek_r1``: ``<think>`` and ``</think>``); ``--reasoning-parser`` sets it (and wins, as
  in vLLM), so that parser alone is enough for budgets;
- ``reasoning_start_str``: the text that opens the reasoning (default: the parser's);
- ``reasoning_end_str``: the text forced, token by token, once the budget is spent (default:
  the parser's end marker; it may hold a phrase before it, e.g. "Time is up.\\n</think>").

The reasoning ends naturally at the parser's end marker (or, without a parser, at
``reasoning_end_str``). Without a start and an end text (no parser, no strings) budgets are
off, and a request that sets one is refused naming it, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from llm_serving.errors import ConfigError, config_fields

KEY = "reasoning_config"
# --reasoning-parser's names and each one's (start, end) markers (entrypoints/reasoning.py
# splits answers at them)
THINK_START, THINK_END = "<think>", "</think>"
PARSER_MARKERS = {"deepseek_r1": (THINK_START, THINK_END), "qwen3": (THINK_START, THINK_END)}


@dataclass(frozen=True)
class ReasoningMarkers:
    """The token ids of a reasoning config's texts (``ReasoningConfig.token_ids``)."""
    start: tuple[int, ...]          # opens the reasoning
    natural_end: tuple[int, ...]    # ends it (the parser's end marker)
    forced_end: tuple[int, ...]     # forced when a budget is spent


@dataclass(frozen=True)
class ReasoningConfig:
    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    @classmethod
    def resolve(cls, value: Union[dict, str, None, "ReasoningConfig"],
                parser: Optional[str]) -> Optional["ReasoningConfig"]:
        """The engine's config: ``value`` (a mapping of vLLM's keys, its JSON text, or None)
        with ``parser`` (--reasoning-parser) as its parser; None when neither is given."""
        if value is None and not parser:
            return None
        config = value if isinstance(value, cls) else cls(**config_fields(KEY, value or {},
                                                                          cls))
        if parser:
            config = cls(parser, config.reasoning_start_str, config.reasoning_end_str)
        if config.reasoning_parser not in ("", *PARSER_MARKERS):
            raise ConfigError(f"{KEY}.reasoning_parser", f"expected one of "
                              f"{', '.join(PARSER_MARKERS)}, got {config.reasoning_parser!r}")
        return config

    def texts(self) -> Optional[tuple[str, str, str]]:
        """(start, natural end, forced end), None when a start or an end is missing."""
        start, end = PARSER_MARKERS.get(self.reasoning_parser, ("", ""))
        natural = end or self.reasoning_end_str
        start, forced = self.reasoning_start_str or start, self.reasoning_end_str or end
        return (start, natural, forced) if start and forced else None

    def token_ids(self, tokenizer) -> Optional[ReasoningMarkers]:
        """The texts' token ids under the model's tokenizer; None when budgets are off (no
        start or end text). A text that encodes to nothing is a ConfigError naming it."""
        texts = self.texts()
        if texts is None:
            return None
        ids = [tuple(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        for key, text, got in zip(("reasoning_start_str", "reasoning_end_str",
                                   "reasoning_end_str"), texts, ids):
            if not got:
                raise ConfigError(f"{KEY}.{key}", f"{text!r} is no token of the model's "
                                  "vocabulary")
        return ReasoningMarkers(*ids)
