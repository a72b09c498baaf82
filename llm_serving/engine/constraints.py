"""What a step may sample, per request: ``logit_bias``, ``allowed_token_ids``, ``bad_words``
and structured outputs (a grammar, on llguidance).

Where each part runs:
- ``prepare(params)`` (the input processor, any thread): checks ids against the vocabulary,
  tokenizes the bad words, checks that some allowed token is left, compiles and validates
  the grammar, so that a bad schema or regex
  is a ValueError (HTTP 400) before the request is queued;
- ``apply(batch, sampled)`` (the input builder, each step): adds the logit_bias entries, the
  bad-words bans and, for rows with a grammar or allowed_token_ids, one bitmask row (one bit
  per token) to the step's ``SamplingBatch``; the sampler in the WorkAgent sets the tokens a
  row leaves out to -inf;
- the grammar matchers live here, in the master, which sees every sampled token: one per
  sequence (n > 1 children have their own), advanced lazily over the tokens the sequence
  gained since the previous step, rebuilt from the output tokens when a sequence has none
  (a fork) or lost tokens, and dropped when the sequence finishes or is aborted
  (``release``). A request with ``reasoning_end`` (the chat route's ``--reasoning-parser``)
  is not masked while the model thinks: its matcher is made at the token after the end of
  the reasoning (engine/reasoning_end.py), as vLLM's structured output does.

A request with ``thinking_token_budget`` (engine/thinking_budget.py) gets a mask row that
allows one token at the steps where its budget is spent, the end of its reasoning forced;
the other steps it costs nothing.

Under async scheduling a grammar row's mask needs the token the running step is sampling:
``apply`` then leaves a placeholder and the engine sends ``deferred_bitmask()`` to the runner
once that step is processed, while the new step's forward runs (``mask_deferred``).
"""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from llm_serving import structural_tag
from llm_serving.engine.reasoning_end import ReasoningEnd, marker_token_id
from llm_serving.engine.thinking_budget import ThinkingBudget
from llm_serving.reasoning_config import ReasoningConfig
from llm_serving.structured_outputs_config import StructuredOutputsConfig
from llm_serving.executor.protocol import SamplingBatch
from llm_serving.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from llm_serving.engine.sequence import Sequence
    from llm_serving.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_EMPTY = np.zeros(0, np.int64)
# llguidance's parallel fill hands the rows to its thread pool. On 2 cores, where the model
# already uses both, it cost 5-10x the plain loop (JSON schema, vocab 8000: 6.7 vs 1.2 ms at
# 64 rows, 3.8 vs 0.3 ms at 16): it is used only with cores to spare and rows to share.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
_PAR_CORES, _PAR_ROWS = 8, 32
# llguidance's fuel for building a grammar's lexer: a tenth of its default, so that a
# pathological regex ("a{1000}{1000}", 60 bytes) fails in ~30 ms instead of holding the
# engine thread ~1 s per request (every other request's tokens wait on that thread). The
# grammars of the tests and common JSON schemas, emails, dates and counted repetitions up to
# "a{300}{100}" need far less (measured on the tiny model's vocabulary).
_LEXER_FUEL = 100_000


def compile_grammar(so: StructuredOutputsParams,
                    config: StructuredOutputsConfig = StructuredOutputsConfig(),
                    is_special: Callable[[str], bool] = lambda text: False) -> str:
    """llguidance's grammar text for a request's structured output (not yet validated).
    JSON is compact by default: vLLM's default lets any whitespace through, which a weak
    model fills; ``config`` (the engine's structured_outputs_config) may ask for that, or
    close objects to unlisted keys, and the request's ``whitespace_pattern`` says which
    whitespace. ``is_special``: whether a text is one special token (structural tags)."""
    import llguidance
    from llguidance import LLMatcher
    defaults = config.json_defaults()
    if so.whitespace_pattern is not None:
        defaults["whitespace_pattern"] = so.whitespace_pattern
    if so.json is not None:
        return LLMatcher.grammar_from_json_schema(config.json_schema(so.json),
                                                  defaults=defaults)
    if so.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)
    if so.structural_tag is not None:
        def schema_of(schema: dict) -> dict:
            schema = dict(config.json_schema(schema))
            schema["x-guidance"] = {**defaults, **schema.get("x-guidance", {})}
            return schema
        return structural_tag.to_grammar(so.structural_tag, schema_of, is_special)
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    return llguidance.grammar_from("grammar", so.grammar)


class Constraints:
    def __init__(self, tokenizer: "Tokenizer", vocab_size: int,
                 config: StructuredOutputsConfig = StructuredOutputsConfig(),
                 reasoning: Optional[ReasoningConfig] = None):
        self.tokenizer = tokenizer
        # the reasoning texts' token ids, for thinking_token_budget (None: budgets refused)
        self.reasoning_markers = reasoning.token_ids(tokenizer) if reasoning else None
        self._budgets: dict[int, tuple] = {}     # id(seq) -> (seq, ThinkingBudget)
        self.config = config
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._lltok = None
        self._executor = None
        self._limits = None
        # id(seq) -> [seq, matcher (None while it thinks), tokens seen, ReasoningEnd or None]
        self._matchers: dict[int, list] = {}
        self._marker_ids: dict[str, Optional[int]] = {}
        self._deferred = None      # (sequences of the mask rows, rows with bad words in it)

    # ---- per request (any thread) ---------------------------------------------------------
    def prepare(self, params: SamplingParams) -> None:
        v = self.vocab_size
        if params.thinking_token_budget is not None and self.reasoning_markers is None:
            raise ValueError("thinking_token_budget: set, but no reasoning config is "
                             "configured; start the server with --reasoning-parser and/or "
                             "--reasoning-config to use it (as vLLM)")
        if params.logit_bias and max(params.logit_bias) >= v:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the "
                             f"vocabulary [0, {v})")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= v:
            raise ValueError(f"allowed_token_ids: token id {max(params.allowed_token_ids)} is "
                             f"not in the vocabulary [0, {v})")
        if params.bad_words and params.bad_words_token_ids is None:
            seqs = set()
            for w in params.bad_words:
                for text in (w.lstrip(), " " + w.lstrip()):
                    ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                    if ids:
                        seqs.add(ids)
            params.bad_words_token_ids = [list(s) for s in sorted(seqs)]
        if params.allowed_token_ids is not None:
            self._check_something_allowed(params)
        if params.structured_outputs is not None and params.grammar is None:
            params.grammar = self._compile(params.structured_outputs)

    def _check_something_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids that the other constraints leave empty would have the sampler
        draw from a row of -inf (a token outside them): refused by name instead."""
        left = set(params.allowed_token_ids) - {
            w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
        if not left:
            raise ValueError("allowed_token_ids: bad_words ban every allowed token")
        ends = set(params.stop_token_ids or ()) | (
            set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        if params.min_tokens > 0 and left <= ends:
            raise ValueError(f"allowed_token_ids: every allowed token ends the output (EOS "
                             f"or a stop id), so min_tokens {params.min_tokens} cannot be met")

    def _compile(self, so: StructuredOutputsParams) -> str:
        from llguidance import LLMatcher
        tok = self.lltokenizer()
        if so.whitespace_pattern is not None:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(
                so.whitespace_pattern), tok, limits=self.limits())
            if error:
                raise ValueError(f"structured_outputs.whitespace_pattern: {error}")
        try:
            grammar = compile_grammar(so, self.config, self._is_special)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: {e}") from None
        error = LLMatcher.validate_grammar(grammar, tok, limits=self.limits())
        if error:
            raise ValueError(f"structured_outputs: {error}")
        return grammar

    def _is_special(self, text: str) -> bool:
        """The text is one special token of the tokenizer (a structural tag's trigger)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return len(ids) == 1 and self.lltokenizer().is_special_token(ids[0])

    def limits(self):
        """llguidance's parser limits (``_LEXER_FUEL``), made once."""
        if self._limits is None:
            import llguidance
            self._limits = llguidance.LLParserLimits(initial_lexer_fuel=_LEXER_FUEL)
        return self._limits

    def lltokenizer(self):
        """llguidance's view of the tokenizer (built once, ~1 s for a large vocabulary)."""
        if self._lltok is None:
            import llguidance
            backend = getattr(self.tokenizer, "_backend", None)
            if not hasattr(backend, "tok"):
                raise ValueError("structured_outputs: needs a model with a tokenizer.json "
                                 "(this model has a sentencepiece tokenizer.model only)")
            eos = sorted(self.tokenizer.eos_token_ids)
            self._lltok = llguidance.LLTokenizer(backend.tok.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=eos or None)
            self._executor = llguidance.LLExecutor()
        return self._lltok

    # ---- per step (the engine thread) -----------------------------------------------------
    @property
    def num_matchers(self) -> int:
        """Grammar matchers held (one per live constrained sequence)."""
        return len(self._matchers)

    @property
    def mask_deferred(self) -> bool:
        """The step ``apply`` last built has a placeholder bitmask: ``deferred_bitmask``
        computes it once the previous step's samples are on the sequences."""
        return self._deferred is not None

    def apply(self, batch: SamplingBatch, sampled: list["Sequence"]) -> None:
        """Add the step's logit_bias, bans and token bitmask for the sampled rows.

        A row whose mask depends on a token still in flight (a grammar row, or bad words of
        several tokens, under async scheduling) cannot be masked yet: then the step's bitmask
        is a placeholder (every token allowed), and the engine sends ``deferred_bitmask()``
        after the running step is processed, while this one's forward runs."""
        bias_rows, bias_ids, bias_vals, mask_rows, bans = [], [], [], [], {}
        word_rows, late = set(), False
        for row, seq in enumerate(sampled):
            p = seq.params
            if p.logit_bias:
                ids, vals = _bias_arrays(p)
                bias_rows.append(np.full(ids.size, row, np.int32))
                bias_ids.append(ids)
                bias_vals.append(vals)
            in_flight = seq.tokens_in_flight > 0
            masked = p.grammar is not None or p.allowed_token_ids is not None
            late |= in_flight and p.grammar is not None
            if p.thinking_token_budget is not None:
                budget = self._budget(seq)
                if in_flight and budget.may_force(seq.tokens_in_flight):
                    masked = late = True
                elif not in_flight and budget.forced() is not None:
                    masked = True
            if p.bad_words_token_ids:
                if in_flight and any(len(w) > 1 for w in p.bad_words_token_ids):
                    # Its bans depend on the token in flight: they go into its mask row.
                    word_rows.add(len(mask_rows))
                    masked = late = True
                else:
                    banned = _bad_word_bans(p.bad_words_token_ids, seq.output_token_ids)
                    if banned:
                        bans[row] = banned
            if masked:
                mask_rows.append(row)
        if bias_rows:
            batch.bias_rows = np.concatenate(bias_rows)
            batch.bias_ids = np.concatenate(bias_ids)
            batch.bias_values = np.concatenate(bias_vals)
        if bans:
            old = batch.banned_token_ids or [_EMPTY] * len(batch)
            batch.banned_token_ids = [
                np.union1d(old[r], np.fromiter(bans[r], np.int64)) if r in bans else old[r]
                for r in range(len(batch))]
        self._deferred = None
        if mask_rows:
            batch.mask_rows = np.asarray(mask_rows, np.int32)
            seqs = [sampled[r] for r in mask_rows]
            if late:
                batch.token_bitmask = np.full((len(seqs), self.words), -1, np.int32)
                self._deferred = (seqs, word_rows)
            else:
                batch.token_bitmask = self._bitmask(seqs, word_rows)

    def deferred_bitmask(self) -> np.ndarray:
        """The bitmask of the step built last with ``mask_deferred``, now that its rows'
        previous tokens are known (rows of sequences that ended meanwhile allow everything:
        their sample is dropped)."""
        seqs, word_rows = self._deferred
        self._deferred = None
        return self._bitmask(seqs, word_rows)

    def _bitmask(self, seqs: list["Sequence"], word_rows=()) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
        mask = np.full((len(seqs), self.words), -1, np.int32)
        todo = []
        for i, seq in enumerate(seqs):
            if seq.params.grammar is not None and not seq.status.finished:
                m = self._matcher(seq)
                if m is not None:       # None: it still thinks, every token allowed
                    todo.append((m, i))
        if len(todo) >= _PAR_ROWS and _CORES >= _PAR_CORES:
            fill_next_token_bitmask_par(self._executor, todo, mask)
        else:
            for m, i in todo:
                fill_next_token_bitmask(m, mask, i)
        for m, i in todo:
            self._note_error(seqs[i], m)
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.status.finished:
                continue
            if p.allowed_token_ids is not None:
                np.bitwise_and(mask[i], _allowed_mask(p, self.words), out=mask[i])
            if i in word_rows:
                banned = np.asarray(_bad_word_bans(p.bad_words_token_ids, seq.output_token_ids),
                                    np.int64)
                if banned.size:
                    np.bitwise_and.at(mask[i], banned // 32,
                                      ~np.left_shift(1, banned % 32).astype(np.int32))
            if p.thinking_token_budget is not None:
                forced = self._budget(seq).forced()
                if forced is not None:      # the end of the reasoning, whatever else says
                    mask[i] = 0
                    mask[i, forced // 32] = np.left_shift(1, forced % 32).astype(np.int32)
        return mask

    def _budget(self, seq: "Sequence") -> ThinkingBudget:
        """The sequence's thinking budget state, advanced over its new output tokens."""
        entry = self._budgets.get(id(seq))
        out = seq.output_token_ids
        if entry is None or entry[0] is not seq or entry[1].seen > len(out):
            entry = (seq, ThinkingBudget(self.reasoning_markers,
                                         seq.params.thinking_token_budget, seq.prompt_token_ids))
            self._budgets[id(seq)] = entry
        entry[1].advance(out)
        return entry[1]

    def _matcher(self, seq: "Sequence"):
        """The sequence's matcher, advanced over its new output tokens (every token sampled
        before the step being masked is known by then); None while its reasoning goes on."""
        from llguidance import LLMatcher
        out = seq.output_token_ids
        entry = self._matchers.get(id(seq))
        if entry is None or entry[0] is not seq or entry[2] > len(out):
            entry = [seq, None, 0, self._reasoning_end(seq.params.reasoning_end)]
            self._matchers[id(seq)] = entry
        if entry[1] is None:
            if entry[3] is not None:
                at = entry[3].feed(out[entry[2]:])
                if at is None:
                    entry[2] = len(out)
                    return None
                entry[2] += at
            entry[1] = LLMatcher(self.lltokenizer(), seq.params.grammar, log_level=0,
                                 limits=self.limits())
        m = entry[1]
        if entry[2] < len(out):
            if not m.is_stopped():      # after its end (ignore_eos), EOS again: nothing new
                m.consume_tokens(out[entry[2]:])
            entry[2] = len(out)
        return m

    def _reasoning_end(self, marker: Optional[str]) -> Optional[ReasoningEnd]:
        """A search for the end of a sequence's reasoning (None: the grammar holds from its
        first token)."""
        if marker is None:
            return None
        if marker not in self._marker_ids:
            self._marker_ids[marker] = marker_token_id(self.tokenizer, marker)
        return ReasoningEnd(self.tokenizer, marker, self._marker_ids[marker])

    @staticmethod
    def _note_error(seq: "Sequence", m) -> None:
        """A matcher that failed (a grammar too complex for llguidance's parser, or a token
        outside it: every allowed one banned, as min_tokens banning the EOS the grammar
        needs) ends its request with an error naming why, said once and shortly (the
        parser's message goes on with its whole state)."""
        if seq.grammar_error is None and m.is_error():
            why = (m.get_error() or "").strip().splitlines()
            seq.grammar_error = ("structured_outputs: the grammar could not be followed: "
                                 + (why[0][:300] if why else "unknown error"))
            logger.warning("request %s: %s", seq.request_id, seq.grammar_error)

    def release(self) -> None:
        """Drop the matchers and budgets of finished sequences (finished, aborted, timed out)."""
        for held in (self._matchers, self._budgets):
            if held:
                for k in [k for k, e in held.items() if e[0].status.finished]:
                    del held[k]


def _bias_arrays(p: SamplingParams):
    cached = getattr(p, "_bias_arrays", None)
    if cached is None:
        cached = (np.fromiter(p.logit_bias.keys(), np.int32, len(p.logit_bias)),
                  np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)))
        p._bias_arrays = cached
    return cached


def _allowed_mask(p: SamplingParams, words: int) -> np.ndarray:
    cached = getattr(p, "_allowed_mask", None)
    if cached is None:
        bits = np.zeros(words * 32, np.uint8)
        bits[np.asarray(p.allowed_token_ids, np.int64)] = 1
        cached = np.packbits(bits, bitorder="little").view(np.int32)
        p._allowed_mask = cached
    return cached


def _bad_word_bans(words: list[list[int]], out: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (vLLM's rule)."""
    banned = []
    for w in words:
        k = len(w) - 1
        if k == 0 or (len(out) >= k and out[-k:] == w[:-1]):
            banned.append(w[-1])
    return banned
