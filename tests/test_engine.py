"""The engine end to end on the built-in tiny model: continuous batching must not change what
a request generates. 64 concurrent requests of mixed lengths, under each scheduler setting,
must give greedy outputs token-identical to running each request alone.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.engine.llm_engine import LLMEngine
from llm_serving.config import EngineArgs
from llm_serving.errors import QueueFullError

ROOT = Path(__file__).resolve().parents[1]
SHARED_PREFIX = ("Below is an instruction that describes a task. Write a response that "
                 "appropriately completes the request, thinking step by step and checking "
                 "each fact twice before answering. ")


def _workload():
    rows = json.loads((ROOT / "clients" / "data" / "alpaca_521.json").read_text())
    rng = random.Random(7)
    prompts = []
    for i, row in enumerate(rows[:64]):
        text = row["instruction"] + ":" + row["input"]
        if i % 3 == 0:                       # a third share a long prefix
            text = SHARED_PREFIX + text
        if i % 16 == 5:                      # a few long prompts, to be chunked
            text = text + " " + rows[100 + i]["output"] + " " + rows[200 + i]["output"]
        prompts.append(text)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
              for _ in prompts]
    return prompts, params


PROMPTS, PARAMS = _workload()


@pytest.fixture(scope="module")
def alone(tiny_llm):
    """Each request run by itself: the reference."""
    return [tiny_llm.generate(p, s)[0].outputs[0].token_ids for p, s in zip(PROMPTS, PARAMS)]


SETTINGS = {
    "default": dict(),
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=2048),
    "chunk-smaller-than-block": dict(max_num_batched_tokens=8, block_size=16),
    "chunked+prefix, block 4": dict(max_num_batched_tokens=48, block_size=4,
                                     enable_prefix_caching=True),
    "preempt-recompute": dict(num_blocks=40, block_size=8, max_num_seqs=64,
                              preemption_mode="recompute"),
    "preempt-swap": dict(num_blocks=40, block_size=8, max_num_seqs=64,
                         preemption_mode="swap", swap_space=0.01),
    "preempt-swap+prefix": dict(num_blocks=40, block_size=8, max_num_seqs=64,
                                preemption_mode="swap", swap_space=0.01,
                                enable_prefix_caching=True),
    # vLLM's caps below the buffers: 24 tokens and 5 sequences a step of 256 and 64
    "scheduled-tokens+active-seqs caps": dict(max_num_batched_tokens=256, max_num_seqs=64,
                                              max_num_scheduled_tokens=24,
                                              max_num_active_seqs=5, async_scheduling=True),
}
# Async scheduling (step N+1 planned while step N runs) must not change outputs either.
for _name in ("default", "prefix-caching", "chunk-smaller-than-block", "preempt-recompute",
              "preempt-swap+prefix"):
    SETTINGS[f"async, {_name}"] = dict(SETTINGS[_name], async_scheduling=True)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_64_concurrent_requests_match_each_run_alone(tiny_model_dir, alone, name):
    kw = dict(num_blocks=512, block_size=16, max_model_len=320)
    kw.update(SETTINGS[name])
    llm = LLM(tiny_model_dir, **kw)
    outs = llm.generate(PROMPTS, PARAMS)
    got = [o.outputs[0].token_ids for o in outs]
    mismatched = [i for i, (a, b) in enumerate(zip(got, alone)) if a != b]
    assert not mismatched, f"{len(mismatched)} requests differ, first {mismatched[:5]}"
    stats = llm.engine.get_stats()
    assert stats.num_finished_requests == len(PROMPTS)
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    if "preempt" in name:
        assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
        if "swap" in name:
            assert stats.num_swap_preemptions > 0
            assert stats.cpu_cache_usage == 0.0
    if "prefix" in name:
        assert stats.prefix_cache_hits > 0
    # vLLM's inter-token latency, counted per step: one gap per token after a sequence's
    # first, each from that sequence's previous token (preempted ones' too), so they add up
    # to each request's decode time.
    itl = stats.inter_token_latency
    assert itl.count == sum(len(t) - 1 for t in got)
    assert itl.sum == pytest.approx(sum(o.metrics.decode_time for o in outs), abs=1e-6)
    # Tokens per step: every step, every token it ran (without preemption, each prompt token
    # once and each output token but the last once).
    assert stats.iteration_tokens.count == stats.num_steps
    if "preempt" not in name:
        assert stats.iteration_tokens.sum == (stats.num_prefill_tokens
                                              + stats.num_generation_tokens - len(PROMPTS))


def test_prefix_caching_skips_the_shared_prefix(tiny_model_dir):
    prompts = [SHARED_PREFIX * 3 + f"Question {i}: name a colour." for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    computed = {}
    results = {}
    for caching in (False, True):
        llm = LLM(tiny_model_dir, num_blocks=256, block_size=16, enable_prefix_caching=caching)
        first = llm.generate(prompts[:1], params)     # fills the cache
        rest = llm.generate(prompts[1:], params)
        stats = llm.engine.get_stats()
        computed[caching] = stats.num_prefill_tokens
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        if caching:
            assert stats.prefix_cache_hit_rate > 0.5
            assert all(o.num_cached_tokens > 0 for o in rest)
            shared = rest[0].num_cached_tokens
            # Each later prompt skipped its cached blocks: that much less prefill work.
            assert computed[False] - computed[True] == pytest.approx(
                sum(o.num_cached_tokens for o in rest), abs=0)
            assert shared >= len(llm.get_tokenizer().encode(SHARED_PREFIX * 3)) - 16
    assert results[True] == results[False]


def test_n_greater_than_one_shares_the_prompt_and_copies_on_write(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=64, block_size=16)
    prompt = PROMPTS[1]
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    assert n_prompt % 16 != 0         # the last prompt block is shared and partly filled
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12)
    out = llm.generate(prompt, params)[0]
    stats = llm.engine.get_stats()
    # The prompt was computed once for the four completions.
    assert stats.num_prefill_tokens == n_prompt
    # Each completion equals that seed's completion generated on its own.
    for i, comp in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, seed=3 + i, max_tokens=12)
        assert comp.token_ids == llm.generate(prompt, single)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_split_across_tokens_stops_and_is_trimmed(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    prompt = PROMPTS[2]
    free = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True))[0].outputs[0]
    ids = free.token_ids
    # A stop string made of the end of token 5's text and the start of token 6's.
    texts = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    k = next(k for k in range(4, len(ids) - 1)
             if len(texts[k]) - len(texts[k - 1]) >= 2 and len(texts[k + 1]) - len(texts[k]) >= 2)
    stop = texts[k][-2:] + texts[k + 1][len(texts[k]):len(texts[k]) + 2]
    first_hit = free.text.find(stop)
    assert first_hit != -1
    out = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:first_hit]
    assert len(out.token_ids) < len(ids)


def _unpredictable_workload(llm):
    """Requests that end where the engine cannot know in advance (a stop token id, a stop
    string, EOS), mixed with n > 1, penalties, logprobs and seeds."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    free = [o.outputs[0] for o in llm.generate(PROMPTS[:16], greedy)]
    prompts, params = [], []
    for i, out in enumerate(free):
        k = 3 + i % 7
        kinds = [
            SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[out.token_ids[k]]),
            SamplingParams(temperature=0.0, max_tokens=20,
                           stop=[tok.decode(out.token_ids[k:k + 2], skip_special_tokens=True)]),
            SamplingParams(temperature=0.8, seed=i, max_tokens=20, n=2, logprobs=2),
            SamplingParams(temperature=0.8, seed=i, max_tokens=20, repetition_penalty=1.2,
                           stop_token_ids=[out.token_ids[k]]),
        ]
        prompts.append(PROMPTS[i])
        params.append(kinds[i % 4])
    return prompts, params


@pytest.mark.parametrize("kw", [dict(), dict(num_blocks=40, block_size=8, preemption_mode="swap",
                                            swap_space=0.01, enable_prefix_caching=True)],
                         ids=["plenty-of-kv", "preempting"])
def test_async_scheduling_keeps_outputs_when_requests_stop_unpredictably(tiny_model_dir,
                                                                         tiny_llm, kw):
    prompts, params = _unpredictable_workload(tiny_llm)
    results = {}
    for mode in (False, True):
        llm = LLM(tiny_model_dir, **{"num_blocks": 256, "block_size": 16, **kw},
                  async_scheduling=mode)
        outs = llm.generate(prompts, params)
        results[mode] = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                           c.cumulative_logprob) for c in o.outputs] for o in outs]
        stats = llm.engine.get_stats()
        assert stats.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()
        assert all(-1 not in c.token_ids for o in outs for c in o.outputs)
        if kw:
            assert stats.num_preemptions > 0
    stopped = [c for r in results[True] for c in r if c[2] == "stop"]
    assert len(stopped) >= 6          # the workload really stops mid-stream
    assert results[True] == results[False]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_blocks_in_every_state(tiny_model_dir, async_scheduling):
    engine = LLMEngine(EngineArgs(tiny_model_dir, num_blocks=24, block_size=8, max_num_seqs=3,
                                  preemption_mode="swap", swap_space=0.01,
                                  async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:4]]
    ids.append(engine.add_request(PROMPTS[6], SamplingParams(n=2, max_tokens=60)))
    states = set()
    for _ in range(40):
        engine.step()
        states |= {s.status.value for r in engine.requests.values() for s in r.seqs}
    assert {"running", "waiting", "swapped"} <= states
    for rid in ids:
        out = engine.abort_request(rid)
        if out is not None:
            assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.cpu_cache_usage == 0.0
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert engine.block_manager.ref_counts == [0] * 24
    # A step still running when everything was aborted is collected, and nothing comes of it.
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.block_manager.ref_counts == [0] * 24


def test_full_queue_refuses_and_timeout_fails_with_a_reason(tiny_model_dir):
    engine = LLMEngine(EngineArgs(tiny_model_dir, num_blocks=64, max_num_seqs=1,
                                  max_waiting_requests=2, queue_timeout=0.05))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="a")
    engine.add_request(PROMPTS[1], params, request_id="b")
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        engine.add_request(PROMPTS[2], params, request_id="c")
    engine.step()                                  # "a" starts; "b" waits behind it
    import time
    time.sleep(0.1)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["b"].finished and outs["b"].outputs[0].finish_reason == "abort"
    assert "queue_timeout" in outs["b"].error
    while engine.has_unfinished_requests():
        outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].error is None and len(outs["a"].outputs[0].token_ids) == 30
    assert engine.get_stats().num_timed_out_requests == 1


def test_priority_runs_first(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=3)
    outs = llm.generate(PROMPTS[:3], params, priority=[5, 0, 1])
    # All three are queued before the first step; one runs at a time, lowest value first.
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_model_dir, num_blocks=64).generate(PROMPTS[:1], params, priority=[1])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_better_priority_preempts_a_running_request_without_changing_outputs(
        tiny_model_dir, tiny_llm, async_scheduling):
    """A request arriving with a better priority preempts the running one (recompute), also
    while that one's step is still running under async scheduling; both outputs equal each
    request run alone."""
    engine = LLMEngine(EngineArgs(tiny_model_dir, num_blocks=64, max_num_seqs=1,
                                  scheduling_policy="priority",
                                  async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="low", priority=5)
    outs = {}
    for _ in range(4):
        outs.update((o.request_id, o) for o in engine.step())
    engine.add_request(PROMPTS[1], params, request_id="high", priority=0)
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert engine.get_stats().num_preemptions >= 1
    assert outs["high"].metrics.first_token_time < outs["low"].metrics.finished_time
    for rid, prompt in (("low", PROMPTS[0]), ("high", PROMPTS[1])):
        assert outs[rid].outputs[0].token_ids == \
            tiny_llm.generate(prompt, params)[0].outputs[0].token_ids
    assert engine.block_manager.ref_counts == [0] * 64


def test_request_metrics_are_filled(tiny_llm):
    out = tiny_llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))[0]
    m = out.metrics
    assert m.time_in_queue >= 0 and m.ttft >= m.time_in_queue and m.tpot > 0
    assert m.num_generation_tokens == 8 and m.finished_time >= m.last_token_time


def test_cli_flags_override_the_yaml_with_the_same_knobs(tiny_model_dir, tmp_path, capsys):
    from llm_serving import cli
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  enable_prefix_caching: false\n"
                   "  preemption_mode: recompute\n  num_blocks: 64\n")
    args = cli.build_parser().parse_args(
        ["serve", "--config", str(cfg), "--enable-prefix-caching", "--preemption-mode", "swap",
         "--swap-space", "0.01", "--max-num-seqs", "3", "--port", "9001"])
    engine_args, name, host, port = cli.server_settings(args)
    assert engine_args.enable_prefix_caching is True and engine_args.preemption_mode == "swap"
    assert engine_args.max_num_seqs == 3 and engine_args.num_blocks == 64
    assert (name, host, port) == ("tiny-llama", "127.0.0.1", 9001)
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--config", str(cfg), "--preemption-mode", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: preemption_mode: expected one of recompute, swap, got 'bogus'"]


def test_n_children_of_a_parent_swapped_out_before_their_fork_see_its_prompt(tiny_model_dir,
                                                                            tiny_llm):
    """n > 1 under swap preemption and async scheduling: a parent can be swapped out while
    the step that sampled its first token still runs; its children, forked when that sample
    is collected, took the parent's computed length without any of its blocks and attended
    to whatever the new blocks held, so from their second token on they answered wrongly.
    Greedy children must all give the answer the request gets alone."""
    llm = LLM(tiny_model_dir, num_blocks=40, block_size=8, max_num_seqs=64, max_model_len=320,
              preemption_mode="swap", swap_space=0.01, async_scheduling=True)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS[:32], params)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS[:32], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True))]
    wrong = [(i, c.index) for i, o in enumerate(outs) for c in o.outputs
             if c.token_ids != alone[i]]
    assert not wrong, f"{len(wrong)} completions differ from the request alone: {wrong[:6]}"
    stats = llm.engine.get_stats()
    assert stats.num_swap_preemptions > 0
    assert stats.kv_cache_usage == 0.0 and stats.cpu_cache_usage == 0.0


def test_scheduler_caps_are_checked_and_an_n_above_the_active_cap_is_refused(tiny_model_dir):
    """vLLM's checks of max_num_scheduled_tokens and max_num_active_seqs name the key; a
    request whose n sequences could never all run under max_num_active_seqs is refused
    naming it, rather than waiting forever."""
    from llm_serving.errors import ConfigError
    bad = [(dict(max_num_active_seqs=9, max_num_seqs=8), "max_num_active_seqs"),
           (dict(max_num_active_seqs=0), "max_num_active_seqs"),
           (dict(max_num_scheduled_tokens=0), "max_num_scheduled_tokens"),
           (dict(max_num_scheduled_tokens=600, max_num_batched_tokens=512),
            "max_num_scheduled_tokens"),
           (dict(max_num_scheduled_tokens=64, enable_chunked_prefill=False,
                 max_num_batched_tokens=4096), "max_num_scheduled_tokens")]
    for kwargs, key in bad:
        with pytest.raises(ConfigError) as e:
            EngineArgs(model=tiny_model_dir, **kwargs).create_engine_config()
        assert e.value.key == key, kwargs
    llm = LLM(tiny_model_dir, max_num_seqs=8, max_num_active_seqs=2,
              max_num_scheduled_tokens=100)
    # what llm-serving's /serving/get_serverd_model_info reports: the caps, not the buffers
    from llm_serving.engine.engine_client import EngineLimits
    limits = EngineLimits.of(llm.engine.config)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (2, 100)
    with pytest.raises(ValueError, match=r"n: 3 is more than max_num_active_seqs \(2\)"):
        llm.generate("Hello", SamplingParams(n=3, max_tokens=2))
    outs = llm.generate(["Hello", "Tell me"], SamplingParams(n=2, max_tokens=3, seed=1))
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [3] * 4
