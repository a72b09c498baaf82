"""The synchronous engine: add requests, then ``step()`` until they finish.

One step is ``schedule() -> execute(batch) -> update(outputs)``.
"""
from __future__ import annotations

import itertools
import time
from typing import Optional, Union

import numpy as np

from llm_serving.config import EngineArgs
from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.detokenizer import IncrementalDetokenizer
from llm_serving.engine.scheduler import Scheduler, SchedulerOutput
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.errors import ConfigError
from llm_serving.model_executor.layers.sampler import SamplerOutput, SamplingBatch
from llm_serving.model_executor.model_runner import ModelRunner, StepInput, kv_bytes_per_block
from llm_serving.model_executor.loader import ModelConfig
from llm_serving.outputs import CompletionOutput, Logprob, RequestOutput
from llm_serving.sampling_params import SamplingParams
from llm_serving.tokenizer import Tokenizer

PromptType = Union[str, dict]


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
        num_blocks = args.num_blocks or max(
            1, int(args.kv_cache_space * 2**30) // kv_bytes_per_block(mc, args.block_size))
        budget = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill
                                                 else self.max_model_len)
        if not args.enable_chunked_prefill and budget < self.max_model_len:
            raise ConfigError("max_num_batched_tokens",
                              f"{budget} is smaller than max_model_len ({self.max_model_len}); "
                              "without chunked prefill a whole prompt must fit in one step")
        self.runner = ModelRunner(args.model, num_blocks, args.block_size, args.checkpoint,
                                  args.device, args.seed, config=mc)
        self.block_manager = BlockManager(num_blocks, args.block_size)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, budget,
                                   args.enable_chunked_prefill)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict needs 'prompt_token_ids'")
            text, ids = prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; the maximum model length is "
                             f"{self.max_model_len}, leaving no room to generate")
        max_tokens = min(params.max_tokens or room, room)
        seqs = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                p = params.clone()
                p.seed = params.seed + i
            seq = Sequence(request_id, i, text, ids, p, max_tokens)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=p.skip_special_tokens,
                stop=p.stop or [], include_stop_str_in_output=p.include_stop_str_in_output)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return request_id

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        step_input, sampled = self._build_step(batch)
        result = self.runner.execute(step_input)
        return self._update(batch, sampled, result)

    def _build_step(self, batch: SchedulerOutput) -> tuple[StepInput, list[Sequence]]:
        bs = self.block_manager.block_size
        n = np.asarray(batch.num_tokens, np.int32)
        starts = np.asarray([s.num_computed_tokens for s in batch.seqs], np.int32)
        qsl = np.zeros(len(n) + 1, np.int32)
        np.cumsum(n, out=qsl[1:])
        positions = (np.arange(qsl[-1], dtype=np.int32)
                     - np.repeat(qsl[:-1], n) + np.repeat(starts, n))
        ids = np.fromiter(itertools.chain.from_iterable(
            s.token_ids(a, a + k) for s, a, k in zip(batch.seqs, starts, n)),
            np.int32, count=int(qsl[-1]))
        width = max(len(s.block_table) for s in batch.seqs)
        tables = np.zeros((len(n), width), np.int32)
        for row, s in enumerate(batch.seqs):
            tables[row, :len(s.block_table)] = s.block_table
        seq_rows = np.repeat(np.arange(len(n)), n)
        slots = tables[seq_rows, positions // bs] * bs + positions % bs
        # A sequence samples when this step reaches the end of its known tokens.
        done = starts + n == np.asarray([s.num_tokens for s in batch.seqs])
        sample_seqs = np.flatnonzero(done).astype(np.int32)
        sampled = [batch.seqs[i] for i in sample_seqs]
        sampling = SamplingBatch.from_params(
            [s.params for s in sampled], [s.prompt_token_ids for s in sampled],
            [s.output_token_ids for s in sampled], self.eos_token_ids) if sampled else None
        step = StepInput(ids, positions, slots.astype(np.int32), tables, qsl,
                         (starts + n).astype(np.int32), sample_seqs, sampling)
        return step, sampled

    def _update(self, batch: SchedulerOutput, sampled: list[Sequence],
                result: Optional[SamplerOutput]) -> list[RequestOutput]:
        for seq, k in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += k
        touched = {}
        for row, seq in enumerate(sampled):
            token = int(result.token_ids[row])
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            self._record_logprobs(seq, row, token, result)
            seq.detokenizer.step([token])
            status = self._check_stop(seq, token)
            if status is not None:
                seq.detokenizer.flush()
                self.scheduler.finish(seq, status)
            touched[seq.request_id] = True
        return [self._request_output(rid) for rid in touched]

    def _record_logprobs(self, seq: Sequence, row: int, token: int, r: SamplerOutput) -> None:
        k = seq.params.logprobs
        if k is None:         # as vLLM: no logprobs asked, none computed or reported
            return
        lp = float(r.logprobs[row])
        seq.cumulative_logprob += lp
        entry = {token: Logprob(lp, int(r.ranks[row]) if r.ranks is not None else None,
                                self.tokenizer.decode([token], skip_special_tokens=False))}
        if k > 0 and r.top_token_ids is not None:
            for rank, (tid, tlp) in enumerate(zip(r.top_token_ids[row][:k],
                                                  r.top_logprobs[row][:k]), 1):
                tid = int(tid)
                if tid not in entry:
                    entry[tid] = Logprob(float(tlp), rank,
                                         self.tokenizer.decode([tid], skip_special_tokens=False))
        seq.output_logprobs.append(entry)

    def _check_stop(self, seq: Sequence, token: int) -> Optional[SequenceStatus]:
        p = seq.params
        n_out = len(seq.output_token_ids)
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
        if n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _request_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        finished = all(s.status.finished for s in seqs)
        outs = []
        for s in seqs:
            outs.append(CompletionOutput(
                index=s.index, text=s.detokenizer.output_text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        if finished:
            del self.requests[request_id]
        first = seqs[0]
        return RequestOutput(request_id=request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=outs,
                             finished=finished)
