"""The synchronous engine: add requests, then ``step()`` until they finish.

One step is ``schedule() -> execute(batch) -> update(outputs)``:
- the scheduler picks the sequences and token counts, and the KV block moves (swap out,
  swap in, copy-on-write) that must happen first;
- the model runner moves those blocks, runs one ragged forward pass over all the tokens and
  samples one token for every sequence that reached the end of its known tokens;
- the update appends the tokens, detokenizes incrementally, checks stop conditions and
  frees finished sequences' blocks.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from llm_serving.config import EngineArgs
from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.detokenizer import IncrementalDetokenizer
from llm_serving.engine.metrics import EngineStats
from llm_serving.engine.scheduler import Scheduler, SchedulerOutput
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.errors import ConfigError
from llm_serving.sample.sampler import SamplerOutput, SamplingBatch
from llm_serving.model_executor.loader import ModelConfig
from llm_serving.model_executor.model_runner import ModelRunner, StepInput, kv_bytes_per_block
from llm_serving.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llm_serving.sampling_params import RequestOutputKind, SamplingParams
from llm_serving.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
PromptType = Union[str, dict]
_EMPTY_PAIRS = np.zeros((0, 2), np.int32)
_NO_ROWS = np.zeros(0, np.int32)
_WARM_UP_ID = "__warm_up__"


def _request_finish_reason(req) -> str:
    """One reason per request, as vLLM counts them: abort if any sequence was aborted, else
    stop if any stopped, else length."""
    reasons = {s.finish_reason for s in req.seqs}
    return next(r for r in ("abort", "stop", "length") if r in reasons)


def _pairs(pairs: list) -> np.ndarray:
    """Block pairs from the scheduler as an int32 [K, 2] array."""
    return np.asarray(pairs, np.int32).reshape(-1, 2) if pairs else _EMPTY_PAIRS
_MAX_FINISHED_METRICS = 10000


@dataclass
class NewRequest:
    """A checked, tokenized request, ready to queue."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int
    arrival_time: float


class _Request:
    """One request: its n sequences and what has been streamed of each."""
    __slots__ = ("request_id", "seqs", "kind", "sent_tokens", "sent_text", "error",
                 "sent_prompt_logprobs")

    def __init__(self, request_id: str, seqs: list[Sequence], kind: RequestOutputKind):
        self.request_id = request_id
        self.seqs = seqs
        self.kind = kind
        self.sent_tokens = [0] * len(seqs)
        self.sent_text = [0] * len(seqs)
        self.error: Optional[str] = None
        self.sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)


@dataclass
class _StepInFlight:
    """A step handed to the model runner and not collected yet."""
    batch: SchedulerOutput
    sampled: list[Sequence]        # in sampled-row order
    pending_at: list[int]          # per sampled row: index of its placeholder, or -1 (a fork)
    dumps: list[tuple[int, str]]


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_config = ModelConfig.from_pretrained(args.model)
        self.tokenizer = Tokenizer.from_pretrained(args.tokenizer or args.model)
        mc = self.model_config
        self.max_model_len = args.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError("max_model_len", f"{self.max_model_len} exceeds the model's "
                              f"max_position_embeddings ({mc.max_position_embeddings})")
        block_bytes = kv_bytes_per_block(mc, args.block_size, args.tensor_parallel_size)
        num_blocks = args.num_blocks or max(1, int(args.kv_cache_space * 2**30) // block_bytes)
        capacity = num_blocks * args.block_size
        if capacity < self.max_model_len and args.max_model_len is None:
            logger.warning("max_model_len lowered from %d to %d, what %d KV blocks hold",
                           self.max_model_len, capacity, num_blocks)
            self.max_model_len = capacity
        if capacity < self.max_model_len:
            raise ConfigError("num_blocks", f"{num_blocks} blocks of {args.block_size} tokens "
                              f"cannot hold one sequence of max_model_len ({self.max_model_len})"
                              " tokens; raise num_blocks or lower max_model_len")
        num_cpu_blocks = (int(args.swap_space * 2**30) // block_bytes
                          if args.preemption_mode == "swap" else 0)
        budget = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill
                                                 else self.max_model_len)
        if not args.enable_chunked_prefill and budget < self.max_model_len:
            raise ConfigError("max_num_batched_tokens",
                              f"{budget} is smaller than max_model_len ({self.max_model_len}); "
                              "without chunked prefill a whole prompt must fit in one step")
        if args.dtype not in ("auto", "float32") and str(args.device).lower() in ("auto", "cpu"):
            import mindspore as ms
            if ms.get_context("device_target") == "CPU":
                raise ConfigError("dtype", f"{args.dtype} is not supported on CPU, which runs "
                                  "float32 (use auto or float32)")
        self._runner_args = (num_blocks, budget, num_cpu_blocks)
        self.runner = self._make_runner()
        self.block_manager = BlockManager(num_blocks, args.block_size,
                                          args.enable_prefix_caching, num_cpu_blocks,
                                          args.watermark)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, budget,
                                   args.enable_chunked_prefill, args.scheduling_policy,
                                   args.preemption_mode, args.max_waiting_requests,
                                   args.queue_timeout)
        self.async_scheduling = (args.async_scheduling if args.async_scheduling is not None
                                 else args.distributed_executor_backend == "mp")
        self._in_flight: Optional[_StepInFlight] = None
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.stats = EngineStats()
        self._finished_metrics: collections.deque = collections.deque(
            maxlen=_MAX_FINISHED_METRICS)
        self._token_texts: dict[int, str] = {}      # single-token decodes (at most the vocab)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, priority: int = 0,
                    arrival_time: Optional[float] = None) -> str:
        """Queue a request. Raises ValueError for bad input, QueueFullError when full."""
        return self.add_processed(self.process_request(prompt, params, request_id, priority,
                                                       arrival_time))

    def process_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                        request_id: Optional[str] = None, priority: int = 0,
                        arrival_time: Optional[float] = None,
                        strict_length: bool = False) -> NewRequest:
        """Check and tokenize a request without touching the engine's state (so any thread
        may call it). Raises ValueError naming what is wrong. ``max_tokens`` is lowered to
        what fits in max_model_len, or with ``strict_length`` refused when it does not fit."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if priority != 0 and self.scheduler.policy != "priority":
            raise ValueError("priority is only used with scheduling_policy='priority'")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs "
                             f"({self.scheduler.max_num_seqs})")
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict needs 'prompt_token_ids'")
            try:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
            except (TypeError, ValueError):
                raise ValueError("prompt_token_ids must be a list of integers") from None
            text = prompt.get("prompt")
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: it is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: it is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt: it has {len(ids)} tokens; the maximum model length is "
                             f"{self.max_model_len}, leaving no room to generate")
        if strict_length and params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens: the prompt has {len(ids)} tokens and max_tokens is "
                             f"{params.max_tokens}, more than the maximum model length "
                             f"({self.max_model_len}) allows")
        max_tokens = min(params.max_tokens or room, room)
        return NewRequest(request_id, text, ids, params, max_tokens, priority,
                          time.time() if arrival_time is None else arrival_time)

    def add_processed(self, new: NewRequest) -> str:
        """Queue a checked request (from ``process_request``)."""
        if new.request_id in self.requests:
            raise ValueError(f"request id {new.request_id!r} is already in use")
        order = next(self._arrivals)
        params, ids = new.params, new.prompt_token_ids
        seqs = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                p = params.clone()
                p.seed = params.seed + i
            seq = Sequence(new.request_id, i, new.prompt, ids, p, new.max_tokens, new.priority,
                           order, new.arrival_time)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=p.skip_special_tokens,
                stop=p.stop or [], include_stop_str_in_output=p.include_stop_str_in_output)
            seqs.append(seq)
        # Only the first sequence computes the prompt; the others fork from it.
        seqs[0].pending_children = seqs[1:]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]
        self.scheduler.add(seqs[0])
        self.requests[new.request_id] = _Request(new.request_id, seqs, params.output_kind)
        self.stats.num_requests += 1
        return new.request_id

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """End the request now, whatever its state, and free its KV blocks and its slot.

        Returns its final output (finish_reason "abort"), or None for an unknown request.
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.stats.num_aborted_requests += 1
        return self._end_request(req, SequenceStatus.FINISHED_ABORTED)

    def _end_request(self, req: _Request, status: SequenceStatus,
                     error: Optional[str] = None) -> Optional[RequestOutput]:
        """Finish every unfinished sequence of the request with ``status`` (freeing its blocks)
        and return its last output."""
        now = time.time()
        if error is not None:
            req.error = error
        for seq in req.seqs:
            seq.drop_pending()
            if not seq.status.finished:
                self.scheduler.finish(seq, status)
            if seq.finished_time is None:
                seq.finished_time = now
        return self._request_output(req)

    def has_unfinished_requests(self) -> bool:
        """Requests are unfinished, or a step is still running on the model."""
        return bool(self.requests) or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and start a step; return the outputs of the step that completed.

        Without async scheduling that is the step just started. With it, the step started
        here runs on the model (a WorkAgent) while this method finishes the previous one
        (tokens, detokenizing, stop checks, outputs), so the model never waits for the
        master. Decodes of the new step take their input token from the running step's
        samples (a placeholder until it is collected), as vLLM's async scheduling does; a
        sequence that stops on that token had one wasted row, which is discarded.
        """
        outputs = []
        batch = self.scheduler.schedule()
        outputs += [o for o in map(self._fail_timed_out, batch.timed_out) if o is not None]
        if not batch.seqs:
            if self._in_flight is not None:
                outputs += self._collect()
            if batch.swap_out:      # a step that only preempted still moves the KV
                self.runner.move_blocks(_pairs(batch.swap_out), _EMPTY_PAIRS, _EMPTY_PAIRS)
            return outputs
        step_input, sampled, dumps = self._build_step(batch)
        self.runner.submit(step_input)
        previous, self._in_flight = self._in_flight, self._start_pending(batch, sampled, dumps)
        if previous is not None:
            outputs += self._collect(previous)   # fills in the placeholders the new step read
        self.scheduler.after_step(batch)
        if not self.async_scheduling:
            outputs += self._collect()
        return outputs

    def _start_pending(self, batch: SchedulerOutput, sampled: list[Sequence],
                       dumps) -> _StepInFlight:
        """Give each sequence sampled by the started step a placeholder for its token."""
        pending_at = []
        for row, seq in enumerate(sampled):
            if seq.status is not SequenceStatus.RUNNING:     # a pending n > 1 child
                pending_at.append(-1)
                continue
            pending_at.append(len(seq.output_token_ids))
            seq.output_token_ids.append(-1)
            seq.num_pending_tokens += 1
            seq.pending_row = row
        return _StepInFlight(batch, sampled, pending_at, dumps)

    def _drain(self) -> None:
        """Collect a step still running, ignoring its result (the requests are failing)."""
        if self._in_flight is not None:
            self._in_flight = None
            try:
                self.runner.collect()
            except Exception:   # noqa: BLE001 - the runner failed; its owner restarts it
                pass

    def _build_step(self, batch: SchedulerOutput):
        """The step's StepInput, the sequences that sample (in row order), and the logits dumps
        planned for them."""
        bs = self.block_manager.block_size
        n = np.asarray(batch.num_tokens, np.int32)
        starts = np.asarray([s.num_computed_tokens for s in batch.seqs], np.int32)
        totals = np.asarray([s.num_tokens for s in batch.seqs], np.int32)
        qsl = np.zeros(len(n) + 1, np.int32)
        np.cumsum(n, out=qsl[1:])
        positions = (np.arange(qsl[-1], dtype=np.int32)
                     - np.repeat(qsl[:-1], n) + np.repeat(starts, n))
        ids = np.fromiter(itertools.chain.from_iterable(
            s.token_ids(a, a + k) for s, a, k in zip(batch.seqs, starts, n)),
            np.int32, count=int(qsl[-1]))
        # Decodes whose input is the running step's sample: the model runner fills it in.
        pending = [i for i, s in enumerate(batch.seqs) if s.num_pending_tokens]
        if pending:
            pending_pos = qsl[1:][pending] - 1
            pending_src = np.asarray([batch.seqs[i].pending_row for i in pending], np.int32)
        else:
            pending_pos = pending_src = _NO_ROWS
        width = max(len(s.block_table) for s in batch.seqs)
        tables = np.zeros((len(n), width), np.int32)
        for row, s in enumerate(batch.seqs):
            tables[row, :len(s.block_table)] = s.block_table
        seq_rows = np.repeat(np.arange(len(n)), n)
        slots = tables[seq_rows, positions // bs] * bs + positions % bs
        # A sequence samples when this step reaches the end of its known tokens; the pending
        # n > 1 children of a sequence finishing its prompt sample from the same row (only
        # then: with async scheduling they are forked after the parent's next step started).
        done = np.flatnonzero(starts + n == totals)
        sampled, sample_rows = [], []
        for i in done:
            seq = batch.seqs[i]
            children = seq.pending_children if not seq.output_token_ids else ()
            sampled.append(seq)
            sampled.extend(children)
            sample_rows.extend([i] * (1 + len(children)))
        prompt_lens = self._prompt_lens(batch.seqs)
        self.stats.num_prefill_tokens += int(qsl[-1]) - int(np.count_nonzero(
            (n == 1) & (starts == totals - 1) & (totals > prompt_lens)))
        prompt_lp = self._plan_prompt_logprobs(batch, starts, n, qsl, prompt_lens)
        sampling = SamplingBatch.from_params(
            [s.params for s in sampled], [s.prompt_token_ids for s in sampled],
            [s.output_token_ids for s in sampled], self.eos_token_ids) if sampled else None
        dumps = self._dump_plan(sampled) if self.args.dump_logits else []
        step = StepInput(ids, positions, slots.astype(np.int32), tables, qsl,
                         (starts + n).astype(np.int32), np.asarray(sample_rows, np.int32),
                         sampling, swap_out=_pairs(batch.swap_out),
                         swap_in=_pairs(batch.swap_in), copies=_pairs(batch.copies),
                         dump_rows=np.asarray([r for r, _ in dumps], np.int32),
                         pending_pos=pending_pos.astype(np.int32), pending_src=pending_src,
                         **prompt_lp)
        return step, sampled, dumps

    @staticmethod
    def _plan_prompt_logprobs(batch: SchedulerOutput, starts, n, qsl, prompt_lens) -> dict:
        """The StepInput fields of the prompt rows to score this step, planned in
        ``batch.prompt_logprobs``. Row p of a sequence that asked for prompt logprobs scores
        prompt token p + 1; rows scored before (a recompute after preemption) are skipped.
        Only sequences still in their prompt are looked at."""
        rows, ids, ks = [], [], []
        for i in np.flatnonzero(starts < prompt_lens - 1).tolist():
            seq = batch.seqs[i]
            scored = seq.prompt_logprobs
            if scored is None:
                continue
            first = max(int(starts[i]), len(scored) - 1)
            end = min(int(starts[i] + n[i]), int(prompt_lens[i]) - 1)
            if end <= first:
                continue
            batch.prompt_logprobs.append((seq, first + 1, end - first))
            rows.append(np.arange(first, end, dtype=np.int32) + (qsl[i] - starts[i]))
            ids.append(np.asarray(seq.prompt_token_ids[first + 1:end + 1], np.int32))
            ks.append(np.full(end - first, seq.params.prompt_logprobs, np.int32))
        if not rows:
            return {}
        return dict(prompt_lp_rows=np.concatenate(rows), prompt_lp_token_ids=np.concatenate(ids),
                    prompt_lp_k=np.concatenate(ks))

    def _dump_plan(self, sampled: list[Sequence]) -> list[tuple[int, str]]:
        """(sampled row, file name) for the rows whose logits are saved this step. Names come
        from the request's content and the output position, so runs at any batch size pair."""
        import hashlib
        every, plan = self.args.dump_logits_every, []
        for row, seq in enumerate(sampled):
            pos = len(seq.output_token_ids)
            if pos % every == 0 and seq.request_id != _WARM_UP_ID:
                key = hashlib.sha1(np.asarray(seq.prompt_token_ids, np.int64).tobytes()
                                   + repr((seq.params.seed, seq.index)).encode()).hexdigest()
                plan.append((row, f"{key[:20]}_pos{pos}.npy"))
        return plan

    @staticmethod
    def _prompt_lens(seqs: list[Sequence]) -> np.ndarray:
        return np.asarray([len(s.prompt_token_ids) for s in seqs], np.int32)

    def _collect(self, fl: Optional[_StepInFlight] = None) -> list[RequestOutput]:
        """Take the oldest running step's result (``fl``, or the one in flight): fill in its
        tokens, detokenize, check stops."""
        if fl is None:
            fl, self._in_flight = self._in_flight, None
        result = self.runner.collect()
        if fl.dumps:
            out_dir = Path(self.args.dump_logits)
            out_dir.mkdir(parents=True, exist_ok=True)
            for k, (_, name) in enumerate(fl.dumps):
                np.save(out_dir / name, result.dump_logits[k])
        if fl.batch.prompt_logprobs:
            self._record_prompt_logprobs(fl.batch.prompt_logprobs, result)
        self.stats.num_steps += 1
        now = time.time()
        touched: dict[str, None] = {}
        generated = 0
        for row, seq in enumerate(fl.sampled):
            if seq.status.finished:         # ended while the step ran (stop, abort, error)
                continue
            generated += 1
            if seq.pending_children:
                self.scheduler.fork(seq)
            token = int(result.token_ids[row])
            at = fl.pending_at[row]
            if at < 0:
                seq.output_token_ids.append(token)
            else:
                seq.output_token_ids[at] = token
                seq.num_pending_tokens -= 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            self._record_logprobs(seq, row, token, result)
            seq.detokenizer.step([token])
            status = self._check_stop(seq, token)
            if status is not None:
                seq.detokenizer.flush()
                seq.drop_pending()
                self.scheduler.finish(seq, status)
                seq.finished_time = now
            touched[seq.request_id] = None
        self.stats.num_generation_tokens += generated
        outputs = []
        for rid in touched:
            out = self._request_output(self.requests[rid])
            if out is not None:
                outputs.append(out)
        return outputs

    def _fail_timed_out(self, seq: Sequence) -> Optional[RequestOutput]:
        req = self.requests.get(seq.request_id)
        if req is None:
            return None
        waited = time.time() - seq.arrival_time
        self.stats.num_timed_out_requests += 1
        return self._end_request(
            req, SequenceStatus.FINISHED_TIMEOUT,
            f"request waited {waited:.1f} s in the queue without starting "
            f"(queue_timeout={self.scheduler.queue_timeout} s)")

    def _record_logprobs(self, seq: Sequence, row: int, token: int, r: SamplerOutput) -> None:
        k = seq.params.logprobs
        if k is None:         # as vLLM: no logprobs asked, none computed or reported
            return
        lp = float(r.logprobs[row])
        seq.cumulative_logprob += lp
        text = self._token_text
        entry = {token: Logprob(lp, int(r.ranks[row]) if r.ranks is not None else None,
                                text(token))}
        if k > 0 and r.top_token_ids is not None:
            for rank, (tid, tlp) in enumerate(zip(r.top_token_ids[row][:k],
                                                  r.top_logprobs[row][:k]), 1):
                tid = int(tid)
                if tid not in entry:
                    entry[tid] = Logprob(float(tlp), rank, text(tid))
        seq.output_logprobs.append(entry)

    def _record_prompt_logprobs(self, plan: list, r: SamplerOutput) -> None:
        """Append the step's prompt logprobs to their sequences: per prompt token, a dict of
        the token itself, then the top-k by rank (vLLM's shape)."""
        lps, ranks = r.prompt_logprobs.tolist(), r.prompt_ranks.tolist()
        top_ids, top_lps = r.prompt_top_token_ids.tolist(), r.prompt_top_logprobs.tolist()
        text = self._token_text
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
                entry = {tid: Logprob(lps[row], ranks[row], text(tid))}
                for rank, (t, lp) in enumerate(zip(top_ids[row][:k], top_lps[row][:k]), 1):
                    if t not in entry:
                        entry[t] = Logprob(lp, rank, text(t))
                scored.append(entry)
                row += 1

    def _token_text(self, token_id: int) -> str:
        """A token's own text (special tokens kept), decoded once per token id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _check_stop(self, seq: Sequence, token: int) -> Optional[SequenceStatus]:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if seq.detokenizer.stop_reason is not None:
                seq.stop_reason = seq.detokenizer.stop_reason
                return SequenceStatus.FINISHED_STOPPED
        if n_out >= seq.max_tokens or len(seq.prompt_token_ids) + n_out >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # ---- outputs --------------------------------------------------------------------------
    def _request_output(self, req: _Request) -> Optional[RequestOutput]:
        """The request's output in its output kind; None when there is nothing to send."""
        finished = req.finished
        kind = req.kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        outs = []
        for i, s in enumerate(req.seqs):
            text = s.detokenizer.output_text
            t0, c0 = (req.sent_tokens[i], req.sent_text[i]) if delta else (0, 0)
            known = s.num_output_tokens
            req.sent_tokens[i], req.sent_text[i] = known, len(text)
            want_lp = s.params.logprobs is not None
            outs.append(CompletionOutput(
                index=s.index, text=text[c0:], token_ids=s.output_token_ids[t0:known],
                cumulative_logprob=s.cumulative_logprob if want_lp else None,
                logprobs=s.output_logprobs[t0:] if want_lp else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        first = req.seqs[0]
        prompt_lp = first.prompt_logprobs
        if prompt_lp is not None and (len(prompt_lp) < len(first.prompt_token_ids)
                                      or (delta and req.sent_prompt_logprobs)):
            prompt_lp = None          # not all scored yet (an abort), or sent already (delta)
        req.sent_prompt_logprobs |= prompt_lp is not None
        metrics = None
        if finished:
            del self.requests[req.request_id]
            metrics = self._metrics(req)
            self._finished_metrics.append(metrics)
            self.stats.num_finished_requests += 1
            reason = _request_finish_reason(req)
            by_reason = self.stats.finished_by_reason
            by_reason[reason] = by_reason.get(reason, 0) + 1
        return RequestOutput(request_id=req.request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=outs,
                             finished=finished, prompt_logprobs=prompt_lp, metrics=metrics,
                             num_cached_tokens=first.num_cached_tokens, error=req.error)

    @staticmethod
    def _metrics(req: _Request) -> RequestMetrics:
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
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(s.num_preemptions for s in req.seqs))

    def _make_runner(self):
        args, (num_blocks, budget, num_cpu_blocks) = self.args, self._runner_args
        if args.distributed_executor_backend == "mp":
            from llm_serving.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor(
                args.model, num_blocks, args.block_size, max_num_batched_tokens=budget,
                max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                checkpoint=args.checkpoint, device=args.device, seed=args.seed,
                num_cpu_blocks=num_cpu_blocks,
                dump_vocab=self.model_config.vocab_size if args.dump_logits else 0,
                tensor_parallel_size=args.tensor_parallel_size, cpu_affinity=args.cpu_affinity,
                device_id=args.start_device_id)
        return ModelRunner(args.model, num_blocks, args.block_size, args.checkpoint,
                           args.device, args.seed, config=self.model_config,
                           num_cpu_blocks=num_cpu_blocks, device_id=args.start_device_id)

    def warm_up(self) -> None:
        """Run one small request through every path a first request takes (prefill, decode,
        sampling, kernel loading), so that the first real request is not slow. Leaves the
        stats and the prefix cache as they were."""
        rid = _WARM_UP_ID
        self.add_request({"prompt_token_ids": [1] * min(16, self.max_model_len - 2)},
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                        output_kind=RequestOutputKind.FINAL_ONLY),
                         request_id=rid)
        while self.has_unfinished_requests():     # a step still in flight included
            self.step()
        self.block_manager.reset()
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        self.scheduler.num_preemptions = self.scheduler.num_swap_preemptions = 0
        self.stats = EngineStats()
        self._finished_metrics.clear()

    def runner_alive(self) -> bool:
        is_alive = getattr(self.runner, "is_alive", None)
        return is_alive() if is_alive is not None else True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with ``error`` (finish_reason "abort"), freeing all blocks."""
        self._drain()
        outs = []
        for req in list(self.requests.values()):
            self.stats.num_aborted_requests += 1
            out = self._end_request(req, SequenceStatus.FINISHED_ABORTED, error)
            if out is not None:
                outs.append(out)
        return outs

    def restart_runner(self) -> None:
        """Replace a dead model runner (a WorkAgent that died). Call after ``fail_all``: the
        KV cache is gone, so the block pools and the prefix cache start empty."""
        self._in_flight = None
        try:
            self.runner.shutdown()
        except Exception:   # noqa: BLE001 - it is dead already
            pass
        self.block_manager.reset()
        self.runner = self._make_runner()
        self.warm_up()

    def shutdown(self) -> None:
        """Stop WorkAgent processes, if any (the in-process runner needs nothing)."""
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()

    # ---- stats ----------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters; per-request timings of requests
        finished since the previous call are handed over once."""
        sch, bm, st = self.scheduler, self.block_manager, self.stats
        snap = EngineStats(**{k: v for k, v in vars(st).items() if k != "finished_requests"})
        snap.finished_by_reason = dict(st.finished_by_reason)
        snap.num_running = len(sch.running)
        snap.num_waiting = len(sch.waiting) + sum(len(s.pending_children) for s in sch.waiting)
        snap.num_swapped = len(sch.swapped)
        snap.kv_cache_usage = bm.usage
        snap.cpu_cache_usage = bm.cpu_usage
        snap.num_preemptions = sch.num_preemptions
        snap.num_swap_preemptions = sch.num_swap_preemptions
        snap.prefix_cache_queries = bm.prefix_queries
        snap.prefix_cache_hits = bm.prefix_hits
        snap.finished_requests = list(self._finished_metrics)
        self._finished_metrics.clear()
        return snap
