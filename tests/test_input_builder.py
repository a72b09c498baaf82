"""build_step_input: the scheduler's plan -> the model runner's StepInput, checked against a
naive per-token construction on random ragged batches (new prefills, chunks continuing from
cache, decodes, tokens in flight, n > 1 children, prompt logprobs)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_serving.engine.input_builder import build_step_input
from llm_serving.engine.scheduler import SchedulerOutput
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.sampling_params import SamplingParams

EOS = {2}


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_seqs = draw(st.integers(1, 6))
    free_blocks = list(range(200))
    draw(st.randoms()).shuffle(free_blocks)
    out = SchedulerOutput()
    for i in range(num_seqs):
        prompt = draw(st.lists(st.integers(3, 999), min_size=1, max_size=40))
        generated = draw(st.lists(st.integers(3, 999), max_size=5))
        in_flight = draw(st.integers(0, 1)) if generated or draw(st.booleans()) else 0
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.7])), max_tokens=64,
            n=draw(st.sampled_from([1, 1, 2])) if not generated else 1,
            repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
            prompt_logprobs=(draw(st.sampled_from([None, 0, 2])) if not generated and not in_flight
                             else None))
        seq = Sequence(f"r{i}", 0, None, prompt, params, 64)
        seq.output_token_ids = list(generated)
        if in_flight:
            seq.expect_token(draw(st.integers(0, 7)))
        total = seq.num_tokens
        # Computed so far: for a decode everything but the last token; for a prefill any
        # prefix of the prompt.
        if generated or in_flight:
            computed = total - 1
            n = 1
        else:
            computed = draw(st.integers(0, len(prompt) - 1))
            n = draw(st.integers(1, len(prompt) - computed))
        seq.num_computed_tokens = computed
        need = -(-(computed + n) // block_size)
        seq.block_table = [free_blocks.pop() for _ in range(need)]
        seq.status = SequenceStatus.RUNNING
        if params.n > 1:
            child = Sequence(f"r{i}", 1, None, prompt, params, 64)
            seq.pending_children = [child]
        if params.prompt_logprobs is not None:
            # rows scored before (more than computed: a recompute after preemption)
            extra = draw(st.integers(0, len(prompt) - 1 - computed))
            seq.prompt_logprobs = [None] + [{}] * (computed + extra)
        out.add(seq, n)
    return out, block_size


@settings(max_examples=150, deadline=None)
@given(batches())
def test_step_input_matches_a_per_token_construction(case):
    batch, bs = case
    built = build_step_input(batch, bs, EOS)
    step = built.step
    ids, pos, slots, rows_of, sampled, sample_rows = [], [], [], [], [], []
    pending_pos, pending_src, lp_rows, lp_ids = [], [], [], []
    row = 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        known = seq.prompt_token_ids + seq.output_token_ids
        start = seq.num_computed_tokens
        for p in range(start, start + n):
            ids.append(known[p] if p < len(known) else -1)
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p >= len(known):
                pending_pos.append(row)
                pending_src.append(seq.in_flight_row)
            if seq.prompt_logprobs is not None and p + 1 < len(seq.prompt_token_ids) \
                    and p + 1 >= len(seq.prompt_logprobs):
                lp_rows.append(row)
                lp_ids.append(seq.prompt_token_ids[p + 1])
            row += 1
        rows_of.append(row)
        if start + n == seq.num_tokens:             # reaches the end: it samples
            group = [seq] + (seq.pending_children if not seq.output_token_ids
                             and not seq.tokens_in_flight else [])
            sampled += group
            sample_rows += [i] * len(group)
    np.testing.assert_array_equal(step.input_ids, ids)
    np.testing.assert_array_equal(step.positions, pos)
    np.testing.assert_array_equal(step.slot_mapping, slots)
    np.testing.assert_array_equal(step.query_start_loc, [0] + rows_of)
    np.testing.assert_array_equal(step.seq_lens, [s.num_computed_tokens + n for s, n in
                                                  zip(batch.seqs, batch.num_tokens)])
    for r, seq in enumerate(batch.seqs):
        np.testing.assert_array_equal(step.block_tables[r, :len(seq.block_table)],
                                      seq.block_table)
    np.testing.assert_array_equal(step.pending_pos, pending_pos)
    np.testing.assert_array_equal(step.pending_src, pending_src)
    np.testing.assert_array_equal(step.prompt_lp_rows, lp_rows)
    np.testing.assert_array_equal(step.prompt_lp_token_ids, lp_ids)
    assert built.sampled == sampled
    np.testing.assert_array_equal(step.sample_seqs, sample_rows)
    if sampled:
        s = step.sampling
        np.testing.assert_array_equal(
            s.output_lens, [len(q.output_token_ids) + q.tokens_in_flight for q in sampled])
        np.testing.assert_allclose(s.temperature, [q.params.temperature for q in sampled])
        for q, out in zip(sampled, s.output_token_ids or []):
            if q.params.repetition_penalty != 1.0:      # in-flight tokens end as -1
                np.testing.assert_array_equal(
                    out, q.output_token_ids + [-1] * q.tokens_in_flight)
    else:
        assert step.sampling is None
    # Pure: nothing on the sequences changed.
    assert all(seq.status is SequenceStatus.RUNNING for seq in batch.seqs)


def test_in_flight_tokens_never_enter_the_output():
    seq = Sequence("r", 0, None, [5, 6, 7], SamplingParams(max_tokens=3), 3)
    seq.expect_token(4)
    assert seq.output_token_ids == [] and seq.num_tokens == 4
    assert seq.token_ids(0, 4) == [5, 6, 7, -1]
    seq.expect_token(0)
    assert seq.finishing is False and seq.num_tokens == 5
    seq.receive_token(11)
    assert seq.output_token_ids == [11] and seq.tokens_in_flight == 1
    seq.expect_token(1)                      # 1 known + 2 in flight reach max_tokens=3
    assert seq.finishing
    seq.forget_in_flight()
    assert seq.output_token_ids == [11] and seq.num_tokens == 4
