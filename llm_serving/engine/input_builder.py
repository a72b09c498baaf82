"""From the scheduler's plan to the model runner's input: one pure function.

``build_step_input(batch, block_size, eos_token_ids)`` turns a ``SchedulerOutput`` (which
sequences run, how many tokens each, which KV blocks move) into a ``StepInput``: the ragged
token ids and positions, each token's KV slot, the block tables, the rows that sample and
their ``SamplingBatch``, the prompt rows to score (prompt logprobs) and, under async
scheduling, where the previous step's samples go. It reads the sequences and changes nothing.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from llm_serving.engine.scheduler import SchedulerOutput
from llm_serving.engine.sequence import Sequence
from llm_serving.executor.protocol import SamplingBatch, StepInput
from llm_serving.model_executor.layers.pooler import pool_row_range

_EMPTY_PAIRS = np.zeros((0, 2), np.int32)
_NO_ROWS = np.zeros(0, np.int32)


def block_pairs(pairs: list) -> np.ndarray:
    """Block pairs from the scheduler as an int32 [K, 2] array."""
    return np.asarray(pairs, np.int32).reshape(-1, 2) if pairs else _EMPTY_PAIRS


@dataclass
class BuiltStep:
    step: StepInput
    sampled: list[Sequence]                 # one per sampled row, in row order
    # (sequence, first prompt token, count) scored this step, in StepInput.prompt_lp_rows order
    prompt_logprobs: list[tuple[Sequence, int, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0             # tokens that are not plain decodes
    num_tokens: int = 0                     # every token the step runs through the model
    prompt_lens: Optional[np.ndarray] = None   # each row's prompt length
    # Speculative decoding (None/empty when no sequence has drafts): each sampled sequence's
    # first sampled row, and every sampled row's sequence.
    first_rows: Optional[list[int]] = None
    row_seqs: list[Sequence] = field(default_factory=list)
    # pooling runner: (sequence, first prompt position of its chunk, last chunk?) per pooled
    # row range, in StepInput.pool_starts order
    pooled: list[tuple[Sequence, int, bool]] = field(default_factory=list)

    def phase_counts(self) -> tuple[int, int, int, int]:
        """(context rows, their tokens, generation rows, their tokens), vLLM's iteration
        details: a row is in its context phase while it computes prompt tokens."""
        n = np.diff(self.step.query_start_loc)
        ctx = self.step.seq_lens - n < self.prompt_lens
        return (int(ctx.sum()), int(n[ctx].sum()), int(len(n) - ctx.sum()),
                int(n[~ctx].sum()))


def build_step_input(batch: SchedulerOutput, block_size: int,
                     eos_token_ids: set[int], constraints=None,
                     pooling: Optional[str] = None, processor_rows=None) -> BuiltStep:
    """``constraints`` (engine.constraints.Constraints): adds logit_bias, bans and token
    masks to the sampling batch (it advances the rows' grammar matchers). ``pooling`` (a
    pooling runner's LAST, MEAN or CLS): the prompts' rows are pooled, nothing samples.
    ``processor_rows`` (engine.processor_rows.ProcessorRows, with custom logits processors):
    adds the rows' requests."""
    seqs = batch.seqs
    b = len(seqs)
    n = np.asarray(batch.num_tokens, np.int32)
    starts, totals, prompt_lens = np.array(
        [(s.num_computed_tokens, s.num_tokens, len(s.prompt_token_ids)) for s in seqs],
        np.int32).reshape(b, 3).T
    qsl = np.zeros(b + 1, np.int32)
    np.cumsum(n, out=qsl[1:])
    one_each = int(qsl[-1]) == b            # one token a row: decodes (or 1-token chunks)
    positions = (starts.copy() if one_each else
                 np.arange(qsl[-1], dtype=np.int32) - np.repeat(qsl[:-1] - starts, n))
    # Speculative decoding: a decode's drafts follow its last known token.
    spec = batch.drafted
    drafts = (np.fromiter((len(s.draft_token_ids) for s in seqs), np.int32, b) if spec
              else 0)
    ids = np.fromiter(itertools.chain.from_iterable(
        s.token_ids(a, a + k - len(s.draft_token_ids)) + s.draft_token_ids if spec
        else s.token_ids(a, a + k) for s, a, k in zip(seqs, starts.tolist(), n.tolist())),
        np.int32, count=int(qsl[-1]))
    # Decodes whose input is the running step's sample: the model runner fills it in.
    in_flight = [i for i, s in enumerate(seqs) if s.tokens_in_flight]
    if in_flight:
        pending_pos = (qsl[1:][in_flight] - 1).astype(np.int32)
        pending_src = np.asarray([seqs[i].in_flight_row for i in in_flight], np.int32)
    else:
        pending_pos = pending_src = _NO_ROWS
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((len(n), width), np.int32)
    for row, s in enumerate(seqs):
        tables[row, :len(s.block_table)] = s.block_table
    seq_rows = np.arange(b) if one_each else np.repeat(np.arange(b), n)
    slots = tables[seq_rows, positions // block_size] * block_size + positions % block_size
    # A sequence samples when this step reaches the end of its tokens; the pending n > 1
    # children of a sequence finishing its prompt sample from the same row (only then: with
    # async scheduling they are forked after the parent's next step started).
    sampled, sample_rows = [], []
    ends = (starts + n - drafts == totals) if pooling is None else np.zeros(b, bool)
    for i in np.flatnonzero(ends).tolist():
        seq = seqs[i]
        first_sample = not seq.output_token_ids and not seq.tokens_in_flight
        children = seq.pending_children if first_sample else ()
        sampled.append(seq)
        sampled.extend(children)
        sample_rows.extend([i] * (1 + len(children)))
    decodes = (n - drafts == 1) & (starts == totals - 1) & (totals > prompt_lens)
    built = BuiltStep(None, sampled,
                      num_prefill_tokens=int(qsl[-1]) - int(n[decodes].sum()),
                      num_tokens=int(qsl[-1]), prompt_lens=prompt_lens)
    spec_fields = _spec_rows(built, sample_rows) if spec else {}
    built.step = StepInput(
        ids, positions, slots.astype(np.int32), tables, qsl, (starts + n).astype(np.int32),
        spec_fields.pop("sample_seqs", np.asarray(sample_rows, np.int32)),
        (_sampling_batch(built.row_seqs or sampled, eos_token_ids, constraints, spec,
                         processor_rows) if sampled else None),
        swap_out=block_pairs(batch.swap_out), swap_in=block_pairs(batch.swap_in),
        copies=block_pairs(batch.copies), pending_pos=pending_pos, pending_src=pending_src,
        **spec_fields, **_prompt_logprob_rows(built, seqs, starts, n, qsl, prompt_lens),
        **_lora_fields(seqs), **_embeds_fields(seqs, starts, n, qsl, prompt_lens))
    if pooling is not None:
        _pool_rows(built, pooling, seqs, starts, n, totals, qsl)
    return built


def _embeds_fields(seqs: list[Sequence], starts, n, qsl, prompt_lens) -> dict:
    """The StepInput fields of the prompt rows given as embeddings (vLLM's prompt_embeds)
    this step: their rows and embeddings (none when the step computes none of them), cut
    from each sequence's embedded positions by the step's span of its prompt."""
    rows, embeds = [], []
    for i in np.flatnonzero(starts < prompt_lens).tolist():     # sequences in their prompt
        seq = seqs[i]
        if seq.prompt_embeds is None:
            continue
        a = int(starts[i])
        pos = seq.embeds_positions
        lo, hi = np.searchsorted(pos, (a, a + min(int(n[i]), int(prompt_lens[i]) - a)))
        if lo < hi:
            rows.append((pos[lo:hi] + (int(qsl[i]) - a)).astype(np.int32))
            embeds.append(seq.prompt_embeds[lo:hi])
    if not rows:
        return {}
    return dict(embed_rows=np.concatenate(rows), embeds=np.concatenate(embeds))


def _lora_fields(seqs: list[Sequence]) -> dict:
    """The StepInput fields of the sequences' LoRA adapters (none when no sequence has one)."""
    paths = {s.lora_id: s.lora_path for s in seqs if s.lora_id}
    if not paths:
        return {}
    return dict(lora_ids=np.fromiter((s.lora_id for s in seqs), np.int32, len(seqs)),
                lora_paths=lora_paths_array(paths))


def lora_paths_array(paths: dict) -> np.ndarray:
    """StepInput.lora_paths: {adapter id: path} as JSON bytes."""
    meta = json.dumps({str(i): p for i, p in paths.items()}, ensure_ascii=False).encode()
    return np.frombuffer(meta, np.uint8).copy()


def _spec_rows(built: BuiltStep, sample_rows: list[int]) -> dict:
    """Speculative decoding: a sequence with d drafts samples d + 1 rows, one at its last
    known token and one at each draft (the target's token after each prefix), in position
    order; each row's sampling sees the drafts before it as output tokens. Records each
    sampled sequence's first row and the sequence of every row in ``built``."""
    seqs, rows, offsets, first = [], [], [], []
    for seq, i in zip(built.sampled, sample_rows):
        d = len(seq.draft_token_ids)
        first.append(len(seqs))
        seqs.extend([seq] * (d + 1))
        rows.extend([i] * (d + 1))
        offsets.extend(range(d, -1, -1))
    built.first_rows = first
    built.row_seqs = seqs
    return dict(sample_seqs=np.asarray(rows, np.int32),
                sample_offsets=np.asarray(offsets, np.int32))


def _pool_rows(built: BuiltStep, kind: str, seqs, starts, n, totals, qsl) -> None:
    """The step's pooled row ranges (a pooling runner's prompts; each is only prefilled)."""
    pool_starts, pool_ends = [], []
    for i, seq in enumerate(seqs):
        final = bool(starts[i] + n[i] == totals[i])
        a, b = pool_row_range(kind, int(starts[i]), int(n[i]), final, int(qsl[i]))
        if b > a or final:
            built.pooled.append((seq, int(starts[i]), final))
            pool_starts.append(a)
            pool_ends.append(b)
    built.step.pool_starts = np.asarray(pool_starts, np.int32)
    built.step.pool_ends = np.asarray(pool_ends, np.int32)


def _sampling_batch(sampled: list[Sequence], eos_token_ids: set[int],
                    constraints=None, spec: bool = False,
                    processor_rows=None) -> SamplingBatch:
    """Each sampled row's parameters. A penalized row's output tokens end with -1 for each
    token in flight (the model runner fills the newest in)."""
    outputs = [s.output_token_ids + [-1] * s.tokens_in_flight if s.tokens_in_flight
               else s.output_token_ids for s in sampled]
    if spec:        # speculative decoding: row j of a sequence samples after j drafts
        outputs = _with_drafts(sampled, outputs)
    batch = SamplingBatch.from_params([s.params for s in sampled],
                                      [s.prompt_token_ids for s in sampled], outputs,
                                      eos_token_ids)
    if constraints is not None:
        constraints.apply(batch, sampled)
    if processor_rows is not None:
        processor_rows.apply(batch, sampled)
    return batch


def _with_drafts(rows: list[Sequence], outputs: list) -> list:
    """Each row's output tokens when consecutive rows of one sequence sample after its
    drafts: the j-th row of a sequence sees its first j drafts too."""
    out, j = [], 0
    for r, seq in enumerate(rows):
        j = j + 1 if r and rows[r - 1] is seq else 0
        out.append(outputs[r] + seq.draft_token_ids[:j] if j else outputs[r])
    return out


def _prompt_logprob_rows(built: BuiltStep, seqs, starts, n, qsl, prompt_lens) -> dict:
    """The StepInput fields of the prompt rows to score this step, recorded in
    ``built.prompt_logprobs``. Row p of a sequence that asked for prompt logprobs scores
    prompt token p + 1; rows scored before (a recompute after preemption) are skipped. Only
    sequences still in their prompt are looked at."""
    rows, ids, ks = [], [], []
    for i in np.flatnonzero(starts < prompt_lens - 1).tolist():
        seq = seqs[i]
        scored = seq.prompt_logprobs
        if scored is None:
            continue
        first = max(int(starts[i]), len(scored) - 1)
        end = min(int(starts[i] + n[i]), int(prompt_lens[i]) - 1)
        if end <= first:
            continue
        built.prompt_logprobs.append((seq, first + 1, end - first))
        rows.append(np.arange(first, end, dtype=np.int32) + (qsl[i] - starts[i]))
        ids.append(np.asarray(seq.prompt_token_ids[first + 1:end + 1], np.int32))
        ks.append(np.full(end - first, seq.params.prompt_logprobs, np.int32))
    if not rows:
        return {}
    return dict(prompt_lp_rows=np.concatenate(rows), prompt_lp_token_ids=np.concatenate(ids),
                prompt_lp_k=np.concatenate(ks))
