"""Multi-stream (issue 17): the split decision, the per-micro-batch metadata, and the model
giving the same logits and tokens with it on as off (TP 1 and 2, sequential and overlapped),
through chunked prefill, prefix caching and preemption; its knobs and its counters."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_serving import LLM, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.engine.input_builder import build_step_input
from llm_serving.engine.scheduler import SchedulerOutput
from llm_serving.errors import ConfigError
from llm_serving.executor.shm_channel import segments_of
from llm_serving.model_executor.attention.backend import AttentionMetadata
from llm_serving.model_executor.multistream.config import MultiStreamConfig
from llm_serving.model_executor.multistream.metadata import split_attention_metadata
from llm_serving.model_executor.multistream.split import (IMBALANCE, KIND_EXCLUDED, ONE_REQUEST,
                                                          SPLIT, TOO_FEW_PREFILL_TOKENS,
                                                          TOO_FEW_TOKENS, plan_split)
from test_input_builder import EOS, batches
from conftest import metric

# Split every step that has two requests: the tests exercise the split, not the thresholds.
ALWAYS = dict(min_total_tokens=2, min_prefill_tokens=0, max_imbalance=1.0)


# ---- the split decision ----------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.booleans()), min_size=1, max_size=40),
       st.integers(2, 400), st.integers(0, 600), st.floats(0, 1),
       st.sampled_from(["prefill", "decode", "both"]))
def test_split_is_at_the_balanced_request_boundary_or_names_why_not(reqs, min_total,
                                                                   min_prefill, imbalance,
                                                                   apply_to):
    n = np.array([k for k, _ in reqs])
    prefill = np.array([p or k > 1 for k, p in reqs])
    cfg = MultiStreamConfig(min_total_tokens=min_total, min_prefill_tokens=min_prefill,
                            max_imbalance=imbalance, apply_to=apply_to)
    split, reason = plan_split(n, prefill, cfg)
    total, pre = int(n.sum()), int(n[prefill].sum())
    gaps = [abs(total - 2 * int(n[:k].sum())) for k in range(1, len(n))]
    if reason == SPLIT:
        assert 0 < split < len(n) and total >= min_total
        # the boundary nearest the midpoint, within the allowed imbalance
        assert gaps[split - 1] == min(gaps) <= imbalance * total
        assert pre == 0 or pre >= min_prefill
        assert apply_to == "both" or (apply_to == "prefill") == (pre > 0)
        return
    assert split == 0
    if reason == ONE_REQUEST:
        assert len(n) == 1
    elif reason == TOO_FEW_TOKENS:
        assert total < min_total
    elif reason == KIND_EXCLUDED:
        assert (apply_to == "prefill" and pre == 0) or (apply_to == "decode" and pre > 0)
    elif reason == TOO_FEW_PREFILL_TOKENS:
        assert 0 < pre < min_prefill
    else:
        assert reason == IMBALANCE and min(gaps) > imbalance * total


def _metadata(step, block_size):
    return AttentionMetadata(step.slot_mapping, step.block_tables, step.query_start_loc,
                             step.seq_lens, block_size)


@settings(max_examples=200, deadline=None)
@given(batches(), st.data())
def test_each_micro_batch_gets_the_metadata_of_its_requests_alone(batch_bs, data):
    batch, block_size = batch_bs
    if len(batch.seqs) < 2:
        return
    split = data.draw(st.integers(1, len(batch.seqs) - 1))
    full = build_step_input(batch, block_size, EOS).step
    a, b, t = split_attention_metadata(_metadata(full, block_size), split)
    # Concatenated, the micro-batches are the input.
    assert t == full.query_start_loc[split]
    np.testing.assert_array_equal(np.concatenate([a.slot_mapping, b.slot_mapping]),
                                  full.slot_mapping)
    np.testing.assert_array_equal(np.concatenate([a.seq_lens, b.seq_lens]), full.seq_lens)
    np.testing.assert_array_equal(
        np.concatenate([a.query_start_loc, b.query_start_loc[1:] + t]), full.query_start_loc)
    # Each is what the input builder makes of its requests alone.
    for part, rows in ((a, slice(0, split)), (b, slice(split, None))):
        alone = SchedulerOutput()
        for seq, n in zip(batch.seqs[rows], batch.num_tokens[rows]):
            alone.add(seq, n)
        own = build_step_input(alone, block_size, EOS).step
        for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
            np.testing.assert_array_equal(getattr(part, name), getattr(own, name), name)


def test_knobs_are_checked_naming_the_key(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="multi_stream.max_imbalance"):
        EngineArgs(tiny_model_dir, multi_stream={"max_imbalance": 2})
    with pytest.raises(ConfigError, match="multi_stream.splits"):
        EngineArgs(tiny_model_dir, multi_stream={"splits": 3})
    with pytest.raises(ConfigError, match="multi_stream.overlap"):
        EngineArgs(tiny_model_dir, enable_multi_stream=True, multi_stream={
            "overlap": "overlapped"}).create_engine_config().multi_stream.mode(1, "cpu")
    # What runs where: nothing to overlap at TP 1, nothing overlaps under mccl on CPU.
    auto = MultiStreamConfig()
    assert [auto.mode(1, "cpu")[0], auto.mode(2, "cpu")[0], auto.mode(2, "cpu", "mccl")[0],
            auto.mode(2, "ascend", "mccl")[0]] == ["off", "overlapped", "off", "overlapped"]
    assert MultiStreamConfig(overlap="sequential").mode(1, "cpu")[0] == "sequential"
    with pytest.raises(ConfigError, match="cpu_allreduce=shm"):
        MultiStreamConfig(overlap="overlapped").mode(2, "cpu", "mccl")
    from llm_serving.serving_config import load_config
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n"
                   "multi_stream:\n  enabled: true\n  min_total_tokens: 64\n  apply_to: decode\n")
    kw = load_config(cfg).engine_kwargs
    ms = EngineArgs(**kw).create_engine_config().multi_stream
    assert (ms.min_total_tokens, ms.apply_to) == (64, "decode")
    assert EngineArgs(tiny_model_dir).create_engine_config().multi_stream is None   # off


# ---- the model, on and off -------------------------------------------------------------------

def _workload(seed=0, n=10):
    """Prompts of mixed lengths sharing a prefix (prefix-cache hits), with logprobs."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 1000, 24).tolist()
    prompts = [{"prompt_token_ids": (shared if i % 2 else []) +
                rng.integers(3, 1000, int(rng.integers(2, 50))).tolist()} for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4,
                            prompt_logprobs=2)
    return prompts, params


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = np.array([lp.logprob for o in outs for step in o.outputs[0].logprobs
                    for lp in step.values()]
                   + [lp.logprob for o in outs for step in o.prompt_logprobs[1:]
                      for lp in step.values()])
    return tokens, lps


# Chunked prefill (a 48-token budget), prefix caching, and preemption (a small KV pool).
ENGINE = dict(block_size=8, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=48,
              enable_chunked_prefill=True, enable_prefix_caching=True)


def _check_same(llm, ref, prompts, params):
    tokens, lps = _run(llm, prompts, params)
    assert tokens == ref[0]
    np.testing.assert_allclose(lps, ref[1], rtol=0, atol=1e-5)
    stats = llm.engine.get_stats()
    assert stats.multistream_steps.get(SPLIT, 0) > 0
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return stats


@pytest.mark.parametrize("variant", ["llama3-gqa", "qwen2-mqa-tied"])
def test_tp1_sequential_gives_the_same_logits_and_tokens(model_dirs, variant):
    prompts, params = _workload(seed=1)
    ref = _run(LLM(model_dirs[variant], **ENGINE), prompts, params)
    on = LLM(model_dirs[variant], enable_multi_stream=True,
             multi_stream=dict(ALWAYS, overlap="sequential"), **ENGINE)
    _check_same(on, ref, prompts, params)


def test_tp1_auto_runs_unsplit(tiny_model_dir, caplog):
    caplog.set_level("INFO", "llm_serving.multistream")
    llm = LLM(tiny_model_dir, num_blocks=64, enable_multi_stream=True, multi_stream=ALWAYS)
    assert llm.engine.multi_stream is None
    assert "no communication to overlap" in caplog.text
    llm.generate(["a b c", "d e f g"], SamplingParams(max_tokens=2))
    assert llm.engine.get_stats().multistream_steps == {}


def test_tp2_sequential_and_overlapped_give_the_same_logits_and_tokens(model_dirs):
    """Two ranks, the multi-stream schedule with blocking all-reduces, then with them on the
    communication thread (shared-memory all-reduce), against two ranks without it."""
    import os
    model = model_dirs["qwen2-mqa-tied"]          # q/k/v bias, replicated KV head, tied head
    prompts, params = _workload(seed=2)
    pin = "0|1" if len(os.sched_getaffinity(0)) >= 2 else None
    before = segments_of()
    off = LLM(model, tensor_parallel_size=2, cpu_affinity=pin, **ENGINE)
    ref = _run(off, prompts, params)
    off.engine.shutdown()
    for overlap in ("sequential", "overlapped"):
        llm = LLM(model, tensor_parallel_size=2, cpu_affinity=pin, enable_multi_stream=True,
                  multi_stream=dict(ALWAYS, overlap=overlap) if overlap == "sequential"
                  else ALWAYS, **ENGINE)
        assert len(segments_of() - before) == 5    # in, out x 2, and the all-reduce segment
        _check_same(llm, ref, prompts, params)
        llm.engine.shutdown()
    assert not segments_of() - before, "shared memory left behind"


def test_shm_allreduce_matches_mccl(model_dirs):
    """The shared-memory all-reduce (the CPU default) against MindSpore's mccl, two ranks."""
    model = model_dirs["llama3-gqa"]
    prompts, params = _workload(seed=3, n=6)
    runs = {}
    for how in ("mccl", "shm"):
        llm = LLM(model, tensor_parallel_size=2, cpu_allreduce=how, **ENGINE)
        runs[how] = _run(llm, prompts, params)
        llm.engine.shutdown()
    assert runs["shm"][0] == runs["mccl"][0]
    np.testing.assert_allclose(runs["shm"][1], runs["mccl"][1], rtol=0, atol=1e-5)


def test_server_with_multi_stream_gives_greedy_outputs_and_counts_steps(tmp_path,
                                                                        tiny_model_dir,
                                                                        tiny_llm):
    """start.py --enable-multi-stream with a multi_stream: YAML section: completions equal
    the offline engine's (multi-stream off), and /metrics counts split and unsplit steps."""
    import openai
    from test_http_server import start_server, stop_server
    section = ("multi_stream:\n  overlap: sequential\n  min_total_tokens: 2\n"
               "  min_prefill_tokens: 0\n  max_imbalance: 1.0\n")
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--enable-multi-stream",
                                section=section)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompts = ["The quick brown fox", "Once upon a time there was", "1 2 3"]
        got = client.completions.create(model="tiny", prompt=prompts, max_tokens=12,
                                        temperature=0)
        want = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        assert sorted(c.text for c in got.choices) == sorted(o.outputs[0].text for o in want)
        assert metric(url, 'multistream_steps_total{outcome="split",reason="split"}') > 0
    finally:
        assert stop_server(proc) == 0


# ---- the shared-memory all-reduce ------------------------------------------------------------

def test_shm_allreduce_sums_across_ranks_in_chunks_and_gives_up_on_a_missing_peer():
    """Three ranks (threads here) all-reduce arrays larger than a slot, many rounds in a row:
    every rank gets numpy's sum, bit-identical across ranks; alone, a rank gives up within
    its timeout instead of hanging."""
    import threading
    from llm_serving.distributed.shm_allreduce import ShmAllReduce, segment_bytes
    from llm_serving.executor.shm_channel import ShmSegment
    size, slot = 3, 4096
    seg = ShmSegment(segment_bytes(size, slot))
    try:
        rng = np.random.default_rng(0)
        data = [[rng.standard_normal(n).astype(np.float32) for n in (5, 3000, 1024, 7)]
                for _ in range(size)]
        out = [[None] * 4 for _ in range(size)]

        def rank(r):
            ar = ShmAllReduce(seg.name, r, size, slot, timeout=30)
            for i, x in enumerate(data[r]):
                out[r][i] = ar.all_reduce(x.copy())
            ar.close()
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(4):
            want = data[0][i] + data[1][i] + data[2][i]
            np.testing.assert_allclose(out[0][i], want, rtol=1e-6)
            assert all(np.array_equal(out[0][i], out[r][i]) for r in range(size))
        lonely = ShmAllReduce(seg.name, 0, size, slot, timeout=0.3)
        with pytest.raises(RuntimeError, match="did not arrive"):
            lonely.all_reduce(np.ones(4, np.float32))
        lonely.close()
    finally:
        seg.close()
