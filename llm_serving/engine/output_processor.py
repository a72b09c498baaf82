"""From the model's samples to the user's outputs.

The ``OutputProcessor`` owns the state of every live request (its n sequences and what has
been streamed of each). After a step it puts each sampled token (and its logprobs) on its
sequence, detokenizes incrementally, checks the stop conditions (EOS, stop ids, stop strings,
max_tokens, max_model_len), ends finished sequences through the scheduler (which frees their
blocks), records the step's prompt logprobs, and returns the ``RequestOutput`` of every
request that changed, in its output kind (cumulative, delta or final only).
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Optional

from llm_serving.engine.detokenizer import IncrementalDetokenizer
from llm_serving.engine.input_processor import NewRequest
from llm_serving.engine.metrics import EngineStats
from llm_serving.engine.scheduler import Scheduler
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.errors import RequestIdInUseError
from llm_serving.executor.protocol import SamplerOutput
from llm_serving.model_executor.layers.pooler import (PoolerSettings, finish_classification,
                                                      finish_embedding)
from llm_serving.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llm_serving.pooling_params import PoolingParams
from llm_serving.spec_decode.request_metrics import SpecDecodeRequestMetrics
from llm_serving.sampling_params import RequestOutputKind
from llm_serving.tokenizer import Tokenizer

_MAX_FINISHED_METRICS = 10000

logger = logging.getLogger(__name__)


class RequestState:
    """One request: its n sequences and what has been streamed of each."""
    __slots__ = ("request_id", "seqs", "kind", "sent_tokens", "sent_text", "sent_finish",
                 "error", "sent_prompt_logprobs")

    def __init__(self, request_id: str, seqs: list[Sequence], kind: RequestOutputKind):
        self.request_id = request_id
        self.seqs = seqs
        self.kind = kind
        self.sent_tokens = [0] * len(seqs)
        self.sent_text = [0] * len(seqs)
        self.sent_finish = [False] * len(seqs)
        self.error: Optional[str] = None
        self.sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)

    @property
    def finish_reason(self) -> str:
        """One reason per request: abort if any sequence was aborted, else stop if any
        stopped, else repetition if any repeated, else length."""
        reasons = {s.finish_reason for s in self.seqs}
        return next(r for r in ("abort", "stop", "repetition", "length") if r in reasons)


@dataclass
class StepInFlight:
    """A step handed to the model runner and not collected yet: what its rows were."""
    sampled: list[Sequence]                      # in sampled-row order
    prompt_logprobs: list[tuple[Sequence, int, int]]
    dumps: tuple = ()                            # LogitsDumper.plan, when dumping
    # Speculative decoding: each sampled sequence's first row (its drafts' rows follow it);
    # None when the step has no drafts (row i is sequence i's).
    first_rows: Optional[list[int]] = None
    pooled: list = ()                # pooling runner: BuiltStep.pooled


def _no_text(token_id: int) -> None:
    return None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, max_model_len: int,
                 pooler: Optional[PoolerSettings] = None):
        self.pooler = pooler            # a pooling runner's (layers/pooler.py)
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.eos_token_id = tokenizer.eos_token_id      # the tokenizer's own
        self.requests: dict[str, RequestState] = {}
        self.stats: EngineStats = scheduler.stats
        self.finished_metrics: collections.deque = collections.deque(
            maxlen=_MAX_FINISHED_METRICS)
        self.finished_sequences: collections.deque = collections.deque(   # the same, per
            maxlen=_MAX_FINISHED_METRICS)                                   # sequence
        self._token_texts: dict[int, str] = {}      # single-token decodes (at most the vocab)
        self._last_step_time = 0.0      # when the previous step's samples were processed
        # --enable-log-outputs: each request's outputs are logged once, as it ends, cut to
        # max_log_len characters (token ids at debug)
        self.log_outputs = False
        self.max_log_len: Optional[int] = None
        # --per-request-spec-decode-metrics: (drafts per step, detailed) to count each
        # sequence's acceptance with; None: not counted
        self.spec_metrics: Optional[tuple] = None

    # ---- requests -------------------------------------------------------------------------
    def add(self, new: NewRequest, arrival_order: int) -> Sequence:
        """The request's sequences; returns the first, the one that computes the prompt (the
        others are its pending children, forked from it once the prompt is done)."""
        if new.request_id in self.requests:
            raise RequestIdInUseError(new.request_id)
        params, ids = new.params, new.prompt_token_ids
        seqs = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                p = params.clone()
                p.seed = params.seed + i
            seq = Sequence(new.request_id, i, new.prompt, ids, p, new.max_tokens, new.priority,
                           arrival_order, new.arrival_time)
            if new.lora is not None:
                seq.lora_id, seq.lora_path = new.lora.lora_int_id, new.lora.lora_path
                seq.lora_name = new.lora.lora_name
            seq.cache_salt = new.cache_salt
            seq.prompt_embeds = new.prompt_embeds      # (read-only: shared by the n)
            seq.embeds_positions = new.embeds_positions
            if self.spec_metrics is not None:
                seq.spec_metrics = SpecDecodeRequestMetrics(*self.spec_metrics)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids if new.prompt_embeds is None else (),
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop or [], include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens)
            seqs.append(seq)
        seqs[0].pending_children = seqs[1:]
        seqs[0].pooling = new.pooling
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]
        self.requests[new.request_id] = RequestState(new.request_id, seqs, params.output_kind)
        self.stats.num_requests += 1
        return seqs[0]

    def end_request(self, request_id: str, status: SequenceStatus,
                    error: Optional[str] = None) -> Optional[RequestOutput]:
        """Finish every unfinished sequence of the request with ``status`` (freeing its
        blocks) and return its last output; None for an unknown request."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if status is SequenceStatus.FINISHED_ABORTED:
            self.stats.num_aborted_requests += 1
        elif status is SequenceStatus.FINISHED_TIMEOUT:
            self.stats.num_timed_out_requests += 1
        now = time.time()
        if error is not None:
            req.error = error
        for seq in req.seqs:
            seq.forget_in_flight()
            if not seq.status.finished:
                self.scheduler.finish(seq, status)
            if seq.finished_time is None:
                seq.finished_time = now
        return self._request_output(req)

    # ---- after a step ---------------------------------------------------------------------
    def process(self, fl: StepInFlight, result: Optional[SamplerOutput]) -> list[RequestOutput]:
        """Put the step's samples on their sequences, detokenize, check stops; the outputs
        of the requests that changed."""
        if fl.prompt_logprobs:
            self._record_prompt_logprobs(fl.prompt_logprobs, result)
        self.stats.num_steps += 1
        now = time.time()
        previous, self._last_step_time = self._last_step_time, now
        itl = self.stats.inter_token_latency
        touched: dict[str, None] = {}
        ended: list[RequestOutput] = []        # requests ended with an error in this step
        if fl.pooled:
            self._record_pooled(fl.pooled, result.pooled, now, touched)
        generated = firsts = late = extra = 0
        tokens = result.token_ids.tolist() if fl.sampled else ()
        for i, seq in enumerate(fl.sampled):
            if seq.status.finished:         # ended while the step ran (stop, abort, error)
                continue
            if seq.grammar_error is not None:     # sampled under a failed grammar: dropped
                touched.pop(seq.request_id, None)
                out = self.end_request(seq.request_id, SequenceStatus.FINISHED_ABORTED,
                                       seq.grammar_error)
                if out is not None:
                    ended.append(out)
                continue
            generated += 1
            if seq.pending_children:
                self.scheduler.fork(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
                firsts += 1
                self._count_prompt(seq)
            elif seq.last_token_time != previous:   # none last step: preempted, or left out
                itl.observe(now - seq.last_token_time)
                late += 1
            seq.last_token_time = now
            if fl.first_rows is None:
                self._take_token(seq, i, tokens[i], result, now)
            else:
                extra += self._take_verified(seq, fl.first_rows[i], tokens, result, now)
            touched[seq.request_id] = None
        generated += extra
        self.stats.num_generation_tokens += generated
        # Every other sequence had a token in the previous step too: one gap for all.
        if generated - extra - firsts - late:
            itl.observe(now - previous, generated - extra - firsts - late)
        outputs = (self._request_output(self.requests[rid]) for rid in touched)
        return ended + [o for o in outputs if o is not None]

    def _take_verified(self, seq: Sequence, row: int, tokens: list, result: SamplerOutput,
                       now: float) -> int:
        """Speculative decoding: the sequence's drafts were sampled from ``row`` on (the
        target's token after its last token, then after each draft). The drafts equal to the
        target's tokens are accepted, then the target's token after them; each is taken as
        decoding would take it, up to a stop. How many tokens beyond the first were taken."""
        drafts = seq.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and tokens[row + accepted] == drafts[accepted]:
            accepted += 1
        taken = 0
        for j in range(accepted + 1):
            taken += 1
            if self._take_token(seq, row + j, tokens[row + j], result, now):
                break
        if drafts:
            self.scheduler.settle_drafts(seq, accepted)
        return taken - 1

    def _take_token(self, seq: Sequence, row: int, token: int, result: SamplerOutput,
                    now: float) -> bool:
        """Put one sampled token (of ``row``) on the sequence: logprobs, text, stop checks;
        True when it ends the sequence."""
        seq.receive_token(token)
        if seq.params.wants_logprobs:   # as vLLM: none asked, none reported
            self._record_logprobs(seq, row, token, result)
        status = self._stop_token(seq, token)
        stepped = (status is None or seq.params.include_stop_str_in_output) \
            and seq.params.detokenize
        if stepped:
            seq.detokenizer.step([token])   # an EOS or stop id's text is left out (vLLM)
        if status is None:
            status = self._check_stop(seq)
        if status is not None:
            seq.detokenizer.flush()
            seq.forget_in_flight()
            self.scheduler.finish(seq, status)
            seq.finished_time = now
        if stepped and seq.params.wants_logprobs:
            self._name_partial_character(seq, token)
        return status is not None
    def _record_pooled(self, plan: list, pooled, now: float, touched: dict) -> None:
        """Add each pooled row range to its prompt's sum; a prompt whose last chunk ran ends
        with its embedding (layers/pooler.py). A chunk at position 0 starts the sum over (a
        prompt recomputed after a preemption); so does a first chunk after a cached prefix
        (LAST pooling, whose earlier chunks add nothing)."""
        for (seq, start, final), part in zip(plan, pooled):
            if seq.status.finished:         # aborted while the step ran
                continue
            seq.pooled_sum = (part.copy() if start == 0 or seq.pooled_sum is None
                              else seq.pooled_sum + part)
            if not final:
                continue
            p = seq.pooling or PoolingParams()
            seq.embedding = (
                finish_classification(seq.pooled_sum, self.pooler, p.use_activation is not False)
                if self.pooler.task == "classify" else
                finish_embedding(seq.pooled_sum, len(seq.prompt_token_ids), self.pooler,
                                 p.use_activation is not False, p.dimensions))
            seq.pooled_sum = None
            seq.first_token_time = seq.last_token_time = seq.finished_time = now
            self._count_prompt(seq)
            seq.forget_in_flight()
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            touched[seq.request_id] = None

    def _stop_token(self, seq: Sequence, token: int) -> Optional[SequenceStatus]:
        """The token ends the sequence: EOS or one of stop_token_ids. stop_reason is the
        token's id, except for the tokenizer's own EOS (None), as vLLM, which counts
        generation_config's other end ids (Llama 3's <|eot_id|>) among the stop ids."""
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            return None
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.stop_reason = None if token == self.eos_token_id else token
            return SequenceStatus.FINISHED_STOPPED
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        return None

    def _check_stop(self, seq: Sequence) -> Optional[SequenceStatus]:
        """After the token's text: a stop string (the detokenizer looks for them only past
        min_tokens), max_tokens or the model length."""
        if seq.detokenizer.stop_reason is not None:
            seq.stop_reason = seq.detokenizer.stop_reason
            return SequenceStatus.FINISHED_STOPPED
        n_out = seq.num_output_tokens
        if n_out >= seq.max_tokens or len(seq.prompt_token_ids) + n_out >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        rd = seq.params.repetition_detection
        if rd is not None and n_out >= seq.params.min_tokens and rd.repeats(seq.output_token_ids):
            seq.stop_reason = "repetition_detected"       # vLLM's
            return SequenceStatus.FINISHED_REPETITION
        return None

    # ---- logprobs -------------------------------------------------------------------------
    def _logprob_entry(self, token: int, logprob: float, rank: Optional[int], top_ids,
                       top_lps, detokenize: bool = True) -> dict[int, Logprob]:
        """vLLM's shape: the token itself, then its top alternatives by rank (their text
        None without detokenize, as vLLM's)."""
        text = self._token_text if detokenize else _no_text
        entry = {token: Logprob(logprob, rank, text(token))}
        for r, (tid, tlp) in enumerate(zip(top_ids, top_lps), 1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, r, text(tid))
        return entry

    def _record_logprobs(self, seq: Sequence, row: int, token: int, r: SamplerOutput) -> None:
        k = seq.params.num_logprobs
        lp = float(r.logprobs[row])
        seq.cumulative_logprob += lp
        top = k > 0 and r.top_token_ids is not None
        seq.output_logprobs.append(self._logprob_entry(
            token, lp, int(r.ranks[row]) if r.ranks is not None else None,
            r.top_token_ids[row][:k].tolist() if top else (),
            r.top_logprobs[row][:k].tolist() if top else (), seq.params.detokenize))

    @staticmethod
    def _name_partial_character(seq: Sequence, token: int) -> None:
        """A chosen token that holds part of a character (byte fallback) is named by the text
        it adds to the output: "" until the character's last byte, whose token carries the
        whole character (vLLM's), so the tokens add up to the text and the offsets match. (A
        byte no later token completes stays in the text as U+FFFD, with the next token.)"""
        entry = seq.output_logprobs[-1]
        lp = entry[token]
        piece = seq.detokenizer.last_piece
        if "\ufffd" in lp.decoded_token or "\ufffd" in piece:
            entry[token] = Logprob(lp.logprob, lp.rank, piece)

    def _record_prompt_logprobs(self, plan: list, r: SamplerOutput) -> None:
        """Append the step's prompt logprobs to their sequences, one dict per prompt token."""
        lps, ranks = r.prompt_logprobs.tolist(), r.prompt_ranks.tolist()
        top_ids, top_lps = r.prompt_top_token_ids.tolist(), r.prompt_top_logprobs.tolist()
        row = 0
        for seq, first, count in plan:
            scored, k = seq.prompt_logprobs, seq.params.prompt_logprobs
            # Rows are planned from what was recorded when the step was built; with async
            # scheduling a step planned before the previous one was collected may score rows
            # again (a preempted prompt re-admitted at once): keep the first scores.
            again = len(scored) - first
            assert again >= 0, "prompt logprobs must be recorded in order"
            row += min(again, count)
            for tid in seq.prompt_token_ids[first + again:first + count]:
                scored.append(self._logprob_entry(tid, lps[row], ranks[row], top_ids[row][:k],
                                                  top_lps[row][:k], seq.params.detokenize))
                row += 1

    def _token_text(self, token_id: int) -> str:
        """A token's own text (special tokens kept), decoded once per token id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # ---- outputs --------------------------------------------------------------------------
    def _count_prompt(self, seq: Sequence) -> None:
        """A sequence's prompt tokens by source, as its first token comes (``num_cached_tokens``:
        the computed ones it started with, found in the prefix cache or loaded). vLLM counts
        each of a request's n sequences as a request of its own; the siblings of the first
        reuse its prompt's KV, as a cache hit."""
        by_source = self.stats.prompt_tokens_by_source
        if seq.index > 0:
            by_source["local_cache_hit"] += len(seq.prompt_token_ids)
            return
        by_source["local_compute"] += len(seq.prompt_token_ids) - seq.num_cached_tokens
        by_source["local_cache_hit"] += seq.num_cached_tokens - seq.kv_external_tokens
        by_source["external_kv_transfer"] += seq.kv_external_tokens

    def _log_outputs(self, req: RequestState) -> None:
        """vLLM's --enable-log-outputs lines of a finished request, one per sequence. A
        request without text (detokenize off: a beam search's step, whose route logs the
        beams it answers instead) is not logged."""
        if not req.seqs[0].params.detokenize:
            return
        for s in req.seqs:
            name = req.request_id if len(req.seqs) == 1 else f"{req.request_id} (n={s.index})"
            log_generated(name, s.detokenizer.output_text, s.output_token_ids,
                          s.finish_reason or "abort", self.max_log_len)

    def _request_output(self, req: RequestState) -> Optional[RequestOutput]:
        """The request's output in its output kind; None when there is nothing to send."""
        finished = req.finished
        if req.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = req.kind is RequestOutputKind.DELTA
        outs = []
        for i, s in enumerate(req.seqs):
            text = s.detokenizer.output_text
            t0, c0 = (req.sent_tokens[i], req.sent_text[i]) if delta else (0, 0)
            known = s.num_output_tokens
            if delta and req.sent_finish[i] and known == t0 and len(text) == c0:
                continue       # a sibling (n > 1) that ended earlier: nothing new of it
            req.sent_tokens[i], req.sent_text[i] = known, len(text)
            req.sent_finish[i] = s.finish_reason is not None
            want_lp = s.params.wants_logprobs
            outs.append(CompletionOutput(
                index=s.index, text=text[c0:], token_ids=s.output_token_ids[t0:known],
                cumulative_logprob=s.cumulative_logprob if want_lp else None,
                logprobs=s.output_logprobs[t0:] if want_lp else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                spec_decode_metrics=s.spec_metrics if s.finish_reason is not None else None))
        first = req.seqs[0]
        prompt_lp = first.prompt_logprobs
        if prompt_lp is not None and (len(prompt_lp) < len(first.prompt_token_ids)
                                      or (delta and req.sent_prompt_logprobs)):
            prompt_lp = None          # not all scored yet (an abort), or sent already (delta)
        req.sent_prompt_logprobs |= prompt_lp is not None
        metrics = None
        if finished:
            if self.log_outputs:
                self._log_outputs(req)
            del self.requests[req.request_id]
            metrics = _request_metrics(req)
            self.finished_metrics.append(metrics)
            self.stats.num_finished_requests += 1
            by_reason = self.stats.finished_by_reason
            for seq in req.seqs:          # vLLM counts each of the n sequences
                reason = seq.finish_reason or "abort"
                by_reason[reason] = by_reason.get(reason, 0) + 1
                # one sequence: the request's own metrics are its sequence's
                self.finished_sequences.append(metrics if len(req.seqs) == 1
                                               else _sequence_metrics(req, seq))
        return RequestOutput(request_id=req.request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=outs,
                             finished=finished, prompt_logprobs=prompt_lp, metrics=metrics,
                             num_cached_tokens=first.num_cached_tokens, error=req.error,
                             kv_transfer_params=first.kv_transfer_params_out if finished
                             else None, embedding=first.embedding)


def _sequence_metrics(req: RequestState, seq: Sequence) -> RequestMetrics:
    """One of the request's sequences as vLLM's metrics see it: a request of its own, whose
    prompt a sibling (index > 0) found computed."""
    first = req.seqs[0]
    started = first.first_scheduled_time
    return RequestMetrics(
        arrival_time=first.arrival_time, last_token_time=seq.last_token_time,
        first_scheduled_time=started, first_token_time=seq.first_token_time,
        time_in_queue=None if started is None else started - first.arrival_time,
        finished_time=seq.finished_time, num_prompt_tokens=len(first.prompt_token_ids),
        num_generation_tokens=len(seq.output_token_ids),
        num_output_tokens=len(seq.output_token_ids),
        num_cached_tokens=(first.num_cached_tokens if seq.index == 0
                           else len(first.prompt_token_ids)),
        num_preemptions=seq.num_preemptions, n=len(req.seqs), max_tokens=first.max_tokens,
        finish_reasons=(seq.finish_reason or "abort",))


def _request_metrics(req: RequestState) -> RequestMetrics:
    first = req.seqs[0]
    started = first.first_scheduled_time
    token_times = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
    last_times = [s.last_token_time for s in req.seqs if s.last_token_time is not None]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        last_token_time=max(last_times) if last_times else None,
        first_scheduled_time=started,
        first_token_time=min(token_times) if token_times else None,
        time_in_queue=None if started is None else started - first.arrival_time,
        finished_time=max((s.finished_time or 0.0) for s in req.seqs) or None,
        num_prompt_tokens=len(first.prompt_token_ids),
        num_generation_tokens=max(len(s.output_token_ids) for s in req.seqs),
        num_output_tokens=sum(len(s.output_token_ids) for s in req.seqs),
        num_cached_tokens=first.num_cached_tokens,
        num_preemptions=sum(s.num_preemptions for s in req.seqs),
        n=len(req.seqs), max_tokens=first.max_tokens,
        finish_reasons=tuple(s.finish_reason or "abort" for s in req.seqs))


def log_generated(name: str, text: str, token_ids, finish_reason: Optional[str],
                  max_log_len: Optional[int], stream_info: str = "") -> None:
    """One answer's (or one streamed delta's) --enable-log-outputs lines, in vLLM's form: its
    text at info, its token ids at debug, each cut to max_log_len."""
    cut = max_log_len
    logger.info("Generated response %s%s: output: %r, finish_reason: %s", name, stream_info,
                text if cut is None else text[:cut], finish_reason)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("Generated response %s%s details: output_token_ids: %s", name,
                     stream_info, list(token_ids if cut is None else token_ids[:cut]))
