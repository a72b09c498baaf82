"""The wire protocol between the engine and the model runner: what one step carries.

- ``StepInput``: the step's tokens, positions, KV slots and block tables, the block moves to
  do first, and the ``SamplingBatch`` of the rows that sample;
- ``SamplerOutput``: what the step sampled (and scored), returned to the engine.

The same dataclasses serve the in-process runner and the WorkAgents. ``shm_channel`` packs
them into shared memory by walking their fields (``array_fields`` / ``ragged_fields``), so a
new field is added here, in one place, and travels. Fields are numpy arrays (at most three
dimensions) or None; a SamplingBatch field marked ``_ragged()`` is a list of 1-D int arrays,
one per row.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable, List, Optional, Sequence, Set, Union

import numpy as np

from llm_serving.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1          # seeds are stored as non-negative int64; -1 = unseeded
_EMPTY_IDS = np.zeros(0, np.int64)
_NO_PAIRS = np.zeros((0, 2), np.int32)
_NO_ROWS = np.zeros(0, np.int32)
_NO_BYTES = np.zeros(0, np.uint8)
_NO_EMBEDS = np.zeros((0, 0), np.float32)


def _ragged():
    return field(default=None, metadata={"ragged": True})


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (B rows), built by the engine's input builder."""

    temperature: np.ndarray          # float32 [B]
    top_k: np.ndarray                # int32 [B], 0 = off
    top_p: np.ndarray                # float32 [B]
    min_p: np.ndarray                # float32 [B]
    presence_penalty: np.ndarray     # float32 [B]
    frequency_penalty: np.ndarray    # float32 [B]
    repetition_penalty: np.ndarray   # float32 [B]
    seeds: np.ndarray                # int64 [B], -1 = unseeded
    output_lens: np.ndarray          # int64 [B], tokens generated so far (the step of a seeded row)
    num_logprobs: np.ndarray         # int32 [B], -1 = none wanted
    # Per row; needed only for rows with penalties (other rows may hold empty arrays).
    prompt_token_ids: Optional[List[np.ndarray]] = _ragged()
    output_token_ids: Optional[List[np.ndarray]] = _ragged()
    # Per row: ids set to -inf this step (min_tokens not reached: EOS + stop_token_ids;
    # bad_words).
    banned_token_ids: Optional[List[np.ndarray]] = _ragged()
    # Per row: the ids whose logprobs are reported in place of the top ones (vLLM's
    # logprob_token_ids; num_logprobs holds their count); only when some row has them.
    logprob_token_ids: Optional[List[np.ndarray]] = _ragged()
    # logit_bias, flat over the batch: logits[bias_rows[i], bias_ids[i]] += bias_values[i].
    bias_rows: Optional[np.ndarray] = None       # int32 [K]
    bias_ids: Optional[np.ndarray] = None        # int32 [K]
    bias_values: Optional[np.ndarray] = None     # float32 [K]
    # Allowed tokens of constrained rows (grammar, allowed_token_ids, bad_words that depend
    # on a token in flight): row mask_rows[i] may sample token t only if bit t % 32 of
    # token_bitmask[i, t // 32] is set. With StepInput.mask_after_forward the bitmask is a
    # placeholder until the master sends it (the step's forward runs meanwhile).
    mask_rows: Optional[np.ndarray] = None       # int32 [R]
    token_bitmask: Optional[np.ndarray] = None   # int32 [R, ceil(V / 32)]
    # Custom logits processors (sample/custom_logits_processors.py; None without them): each
    # row's request key, and the requests that joined since the last step that sampled,
    # pickled {key: (params, prompt token ids, output token ids)}.
    row_keys: Optional[np.ndarray] = None        # int64 [B]
    added_requests: Optional[np.ndarray] = None  # uint8 [N]

    def __len__(self) -> int:
        return len(self.temperature)

    @property
    def penalized_rows(self) -> np.ndarray:
        """bool [B]: rows with any of the three penalties."""
        return ((self.repetition_penalty != 1.0) | (self.frequency_penalty != 0.0)
                | (self.presence_penalty != 0.0))

    @property
    def has_penalties(self) -> bool:
        return bool(self.penalized_rows.any())

    @property
    def modified_rows(self) -> np.ndarray:
        """bool [B]: rows whose logits change before sampling: penalties, banned ids, a logit
        bias or a token mask (only the fields some row uses are looked at)."""
        rows = self.penalized_rows
        if self.banned_token_ids is not None:
            rows |= np.fromiter((len(b) > 0 for b in self.banned_token_ids), bool, len(self))
        if self.bias_rows is not None:
            rows[self.bias_rows] = True
        if self.mask_rows is not None:
            rows[self.mask_rows] = True
        return rows

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        eos_token_ids: Union[int, Iterable[int], Sequence[Optional[Iterable[int]]], None],
    ) -> "SamplingBatch":
        """Build a step's batch from each row's params and tokens.

        eos_token_ids: one id or one set shared by every row, or a list with one set per row.
        Rows that have generated fewer than min_tokens get EOS and stop_token_ids banned
        (regardless of ignore_eos, as in vLLM). Token lists are copied only for rows with
        penalties, and only when some row has them.
        """
        b = len(params)
        if len(prompt_ids) != b or len(output_ids) != b:
            raise ValueError(f"from_params: {b} params but {len(prompt_ids)} prompts and "
                             f"{len(output_ids)} outputs")
        # one array per kind of field, then a row per field (a decode step builds this batch)
        floats = np.array([(p.temperature, p.top_p, p.min_p, p.presence_penalty,
                            p.frequency_penalty, p.repetition_penalty) for p in params],
                          np.float32).reshape(b, 6).T.copy()
        lens = [len(o) for o in output_ids]
        ints = np.array([(p.top_k, -1 if p.seed is None else p.seed & _SEED_MASK,
                          p.num_logprobs, n)
                         for p, n in zip(params, lens)], np.int64).reshape(b, 4).T.copy()
        batch = cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2],
            presence_penalty=floats[3], frequency_penalty=floats[4],
            repetition_penalty=floats[5], top_k=ints[0].astype(np.int32), seeds=ints[1],
            num_logprobs=ints[2].astype(np.int32), output_lens=ints[3],
        )
        pen = batch.penalized_rows
        if pen.any():
            batch.prompt_token_ids = [np.asarray(prompt_ids[i], np.int64) if pen[i] else _EMPTY_IDS
                                      for i in range(b)]
            batch.output_token_ids = [np.asarray(output_ids[i], np.int64) if pen[i] else _EMPTY_IDS
                                      for i in range(b)]
        banned = [_EMPTY_IDS] * b
        any_banned = False
        eos_rows = None
        for i, p in enumerate(params):
            if lens[i] < p.min_tokens:
                if eos_rows is None:
                    eos_rows = _eos_per_row(eos_token_ids, b)
                ids = set(eos_rows[i]) | set(p.stop_token_ids)
                if ids:
                    banned[i] = np.fromiter(sorted(ids), np.int64, len(ids))
                    any_banned = True
        if any_banned:
            batch.banned_token_ids = banned
        # (rows with logprob_token_ids ask for logprobs: the usual step skips the pass)
        if (batch.num_logprobs >= 0).any() and any(p.logprob_token_ids is not None
                                                   for p in params):
            batch.logprob_token_ids = [_EMPTY_IDS if p.logprob_token_ids is None else
                                       np.asarray(p.logprob_token_ids, np.int64) for p in params]
        return batch


def _eos_per_row(eos, b: int) -> List[Set[int]]:
    if eos is None:
        return [set()] * b
    if isinstance(eos, (int, np.integer)):
        return [{int(eos)}] * b
    eos = list(eos)
    if all(isinstance(e, (int, np.integer)) for e in eos):
        return [set(int(e) for e in eos)] * b
    if len(eos) != b:
        raise ValueError(f"eos_token_ids: expected one set per row ({b}), got {len(eos)}")
    out = []
    for e in eos:
        if e is None:
            out.append(set())
        elif isinstance(e, (int, np.integer)):
            out.append({int(e)})
        else:
            out.append(set(int(t) for t in e))
    return out


@dataclass
class SamplerOutput:
    """What the sampler chose for each of the B rows.

    token_ids: int64 [B].
    logprobs: float32 [B], raw log-probability of the chosen token, for every row (unless
        the Sampler was built with always_chosen_logprob=False: then NaN in rows with
        num_logprobs == -1).
    top_token_ids, top_logprobs: [B, K], K = the largest num_logprobs in the batch, sorted by
        logprob descending; rows that asked for fewer should read their first num_logprobs
        columns; rows that asked for none hold -1 / -inf. None when no row asked for logprobs.
    ranks: int64 [B], 1-based rank of the chosen token (vLLM's: the number of tokens whose
        logit is >= the chosen one's); 0 for rows that did not ask. None when no row asked.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_token_ids: Optional[np.ndarray] = None
    top_logprobs: Optional[np.ndarray] = None
    ranks: Optional[np.ndarray] = None
    # float32 [K, V]: raw logits of the rows the step asked to dump (StepInput.dump_rows).
    dump_logits: Optional[np.ndarray] = None
    # Prompt logprobs, one row per StepInput.prompt_lp_rows entry (R rows; None when the step
    # has none): the next prompt token's raw logprob (float32 [R]) and rank (int64 [R]), and
    # the top-K (int64 / float32 [R, K], K = the largest prompt_lp_k, sorted descending).
    prompt_logprobs: Optional[np.ndarray] = None
    prompt_ranks: Optional[np.ndarray] = None
    prompt_top_token_ids: Optional[np.ndarray] = None
    prompt_top_logprobs: Optional[np.ndarray] = None
    # Pooling runner: float32 [P, H], the sum of the hidden states of each of the step's
    # StepInput.pool_starts/pool_ends row ranges (None when the step pools nothing).
    pooled: Optional[np.ndarray] = None


@dataclass
class StepInput:
    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]
    block_tables: np.ndarray     # int32 [S, max_blocks]
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray         # int32 [S]
    sample_seqs: np.ndarray      # int32 [S']: sequences whose last row is sampled this step
    sampling: Optional["SamplingBatch"] = None  # (a sequence may appear more than once: n > 1)
    # Speculative decoding: sampled row i is sample_offsets[i] rows before the last row of
    # sequence sample_seqs[i] (a draft's verification row); empty: every offset is 0.
    sample_offsets: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    # KV block moves done before the forward pass, in this order.
    swap_out: np.ndarray = field(default_factory=lambda: _NO_PAIRS)   # [K, 2] device, host
    swap_in: np.ndarray = field(default_factory=lambda: _NO_PAIRS)    # [K, 2] host, device
    copies: np.ndarray = field(default_factory=lambda: _NO_PAIRS)     # [K, 2] src, dst
    # Sampled rows whose raw logits are returned too (the accuracy harness, --dump-logits).
    dump_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    # Async scheduling: input_ids[pending_pos[i]] is not known to the master yet; it is the
    # token the previous step sampled in row pending_src[i].
    pending_pos: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    pending_src: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    # Prompt logprobs (SamplingParams.prompt_logprobs): token rows whose logits score the next
    # prompt token, that token, and how many top alternatives its request asked for.
    prompt_lp_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)       # int32 [R]
    prompt_lp_token_ids: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # int32 [R]
    prompt_lp_k: np.ndarray = field(default_factory=lambda: _NO_ROWS)          # int32 [R]
    # Multi-stream: the first sequence of the second micro-batch, 0 = run unsplit. Decided
    # once on the master (multistream/split.py) so that every rank splits alike.
    ms_split: int = 0
    # KV transfer (PD disaggregation): the step's connector metadata, uint8 JSON bytes
    # (KVConnectorMetadata.to_array; empty when there is none), at most MAX_METADATA_BYTES.
    kv_meta: np.ndarray = field(default_factory=lambda: _NO_BYTES)
    # Async scheduling with grammar rows: 1 when the sampling batch's token_bitmask depends on
    # the previous step's samples. The master computes it while this step's forward runs and
    # sends it after ``submit`` (``send_mask``); the runner waits for it before sampling.
    mask_after_forward: int = 0
    # LoRA: each sequence's adapter id (int32 [S], 0 = the base model; empty when no sequence
    # has one), and the step's adapters' directories, uint8 JSON {id: path} (at most
    # max_loras entries), for the WorkAgent to load an adapter it does not hold.
    lora_ids: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    lora_paths: np.ndarray = field(default_factory=lambda: _NO_BYTES)
    # Pooling runner (layers/pooler.py): row ranges [pool_starts[i], pool_ends[i]) whose
    # final hidden states are summed into SamplerOutput.pooled; no logits, no sampling.
    pool_starts: np.ndarray = field(default_factory=lambda: _NO_ROWS)    # int32 [P]
    pool_ends: np.ndarray = field(default_factory=lambda: _NO_ROWS)      # int32 [P]
    # Prompt embeddings (vLLM's prompt_embeds, enable_prompt_embeds): token row
    # embed_rows[i] takes embeds[i] as its input embedding instead of its (placeholder) id's.
    embed_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)     # int32 [E]
    embeds: np.ndarray = field(default_factory=lambda: _NO_EMBEDS)       # float32 [E, H]


def array_fields(cls) -> tuple[str, ...]:
    """The fields of ``cls`` sent as one array each (or None), in declaration order."""
    return tuple(f.name for f in fields(cls)
                 if not f.metadata.get("ragged") and f.name != "sampling")


def ragged_fields(cls) -> tuple[str, ...]:
    """The fields of ``cls`` sent as a list of per-row arrays (flattened + offsets)."""
    return tuple(f.name for f in fields(cls) if f.metadata.get("ragged"))
