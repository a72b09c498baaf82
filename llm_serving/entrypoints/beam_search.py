"""Beam search, as vLLM runs it: on top of the engine, one token at a time.

Each step asks the engine for one token of every live beam (a request whose prompt is the
beam's tokens, with the top 2 x beam_width log-probabilities; the prefix cache holds the
beam's earlier positions, so only its last token is computed), then keeps the beam_width
best of all the candidates. A candidate that is the end-of-sequence token (unless ignore_eos)
is a finished hypothesis. At the end the finished hypotheses and the live beams are ranked
by cumulative log-probability / length ** length_penalty, the length counting the prompt and
not a final EOS (vLLM's score, after transformers'), and the best beam_width are returned.

``BeamSearch`` is one prompt's search; ``LLM.beam_search`` and the OpenAI routes'
``use_beam_search`` drive it, offline and online.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from llm_serving.outputs import Logprob
from llm_serving.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """A hypothesis: ``tokens`` are the prompt's and the generated ones, ``logprobs`` each
    generated position's candidates."""
    tokens: List[int]
    logprobs: List[Dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None


@dataclass
class BeamSearchOutput:
    """The best beam_width hypotheses of one prompt, best first."""
    sequences: List[BeamSearchSequence]


class BeamSearch:
    """One prompt's beam search."""

    def __init__(self, prompt_token_ids: List[int], params: BeamSearchParams,
                 eos_token_id: Optional[int], max_model_len: int,
                 cache_salt: Optional[str] = None):
        self.params = params
        self.cache_salt = cache_salt        # the prompt's (vLLM's), kept by each step's prompt
        self.prompt_len = len(prompt_token_ids)
        room = max_model_len - self.prompt_len       # the last step's prompt must fit
        self.max_tokens = min(params.max_tokens or room, room)
        self.eos_token_id = eos_token_id
        self.eos = None if params.ignore_eos else eos_token_id     # what finishes a beam
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: List[BeamSearchSequence] = []
        self.steps = 0

    def step_prompt(self, beam: BeamSearchSequence) -> dict:
        """The prompt of a step that extends ``beam`` by one token."""
        if self.cache_salt is None:
            return {"prompt_token_ids": beam.tokens}
        return {"prompt_token_ids": beam.tokens, "cache_salt": self.cache_salt}

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.max_tokens

    def advance(self, candidates: List[Optional[Dict[int, Logprob]]]) -> None:
        """One step: ``candidates[i]`` is the engine's top log-probabilities after beam i
        (None: that beam's request ended without a token, an abort: the search stops)."""
        if any(c is None for c in candidates):
            for beam in self.beams:
                beam.finish_reason = "abort"
            self.finished.extend(self.beams)
            self.beams = []
            return
        grown = []
        for beam, lps in zip(self.beams, candidates):
            for token, lp in lps.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [lps],
                                         beam.cum_logprob + lp.logprob)
                if token == self.eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.finished.append(new)
                else:
                    grown.append(new)
        grown.sort(key=lambda b: b.cum_logprob, reverse=True)   # all of one length
        self.beams = grown[:self.params.beam_width]
        self.steps += 1

    def score(self, beam: BeamSearchSequence) -> float:
        """vLLM's: a final EOS token (even under ignore_eos) is not counted in the length."""
        n = len(beam.tokens) - (beam.tokens[-1] == self.eos_token_id)
        return beam.cum_logprob / (max(n, 1) ** self.params.length_penalty)

    def best(self) -> List[BeamSearchSequence]:
        """The best beam_width hypotheses, finished or not, best first; unfinished ones end
        with "length"."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.finished + self.beams, key=self.score, reverse=True)
        return ranked[:self.params.beam_width]

    def generated(self, beam: BeamSearchSequence) -> List[int]:
        """A hypothesis' new tokens as the OpenAI routes return them: a final EOS only with
        include_stop_str_in_output."""
        return (self.text_tokens(beam) if not self.params.include_stop_str_in_output
                else beam.tokens[self.prompt_len:])

    def text_tokens(self, beam: BeamSearchSequence) -> List[int]:
        """The new tokens its text is decoded from: never a final EOS (vLLM's)."""
        ids = beam.tokens[self.prompt_len:]
        return ids[:-1] if beam.finish_reason == "stop" else ids
