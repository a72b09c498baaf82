"""The model in a WorkAgent process, fed through shared memory: same outputs as in-process,
a dead agent is reported, and nothing is left in /dev/shm."""
from __future__ import annotations

import os
import signal
import time

import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import LLMServingError
from llm_serving.executor.multiproc_executor import AgentDiedError
from llm_serving.executor.shm_channel import ShmSegment, segments_of

PROMPTS = ["Give three tips for staying healthy.", "What is the capital of France?",
           "Write a haiku about the sea.", "Explain paged attention in one sentence, then "
           "explain it again for a child, and once more for an expert."] * 3


def our_segments() -> set[str]:
    return segments_of(os.getpid())


def workload():
    # Every part of a step crosses the channel: penalties (token lists), min_tokens (banned
    # ids), logprobs (top-k results), prompt logprobs (the largest k, and k = 0), seeds,
    # n > 1, and swap preemption (block moves).
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3,
                           prompt_logprobs=20),
            SamplingParams(temperature=0.9, seed=5, max_tokens=24, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.2),
            SamplingParams(temperature=0.7, seed=9, n=2, max_tokens=24, min_tokens=10,
                           prompt_logprobs=0),
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3


def run(llm):
    outs = llm.generate(PROMPTS, workload())
    return [([(c.token_ids, c.cumulative_logprob) for c in o.outputs], o.prompt_logprobs)
            for o in outs]


def test_agent_process_gives_the_same_outputs_and_cleans_up(tiny_model_dir):
    kw = dict(num_blocks=24, block_size=8, max_num_seqs=8, preemption_mode="swap",
              swap_space=0.01)
    before = our_segments()
    ref = run(LLM(tiny_model_dir, **kw))
    llm = LLM(tiny_model_dir, distributed_executor_backend="mp", **kw)
    runner = llm.engine.runner
    agent = runner.proc
    assert agent.poll() is None and agent.pid != os.getpid()
    mine = {seg.name for seg in runner.shm_in + runner.shm_out}
    assert len(mine) == 4 and mine <= our_segments() - before   # in, out; two steps in flight
    assert llm.engine.async_scheduling
    got = run(llm)
    assert llm.engine.get_stats().num_swap_preemptions > 0
    assert got == ref
    assert len(ref[0][1]) == len(llm.get_tokenizer().encode(PROMPTS[0])) and ref[0][1][0] is None
    assert all(len(e) >= 20 for e in ref[0][1][1:]) and all(len(e) == 1 for e in ref[2][1][1:])
    llm.engine.shutdown()
    assert agent.wait(10) == 0
    assert not mine & our_segments()


def test_a_server_start_removes_segments_left_by_a_killed_server(tiny_model_dir):
    """A server killed with its whole process group (its resource tracker too) leaves its
    segments in /dev/shm; the next server's start unlinks those of masters that no longer run,
    and no one else's."""
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = f"llm_serving_{dead.pid}_0123456789ab"
    with open(f"/dev/shm/{left}", "wb") as f:
        f.write(b"\0" * 4096)
    live = ShmSegment(4096)                         # this (running) process's: kept
    try:
        llm = LLM(tiny_model_dir, distributed_executor_backend="mp", num_blocks=16,
                  block_size=8, max_num_seqs=2)
        llm.engine.shutdown()
        assert not os.path.exists(f"/dev/shm/{left}")
        assert live.name in segments_of()
    finally:
        live.close()
        if os.path.exists(f"/dev/shm/{left}"):
            os.unlink(f"/dev/shm/{left}")


def test_a_killed_agent_is_reported_at_once(tiny_model_dir):
    before = our_segments()
    llm = LLM(tiny_model_dir, num_blocks=64, distributed_executor_backend="mp")
    agent = llm.engine.runner.proc
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(10)
    t0 = time.monotonic()
    with pytest.raises(AgentDiedError, match="exited|closed|gone"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    assert time.monotonic() - t0 < 5
    assert not llm.engine.has_unfinished_requests()      # the failed request was dropped
    llm.engine.shutdown()
    assert our_segments() == before


def test_an_agent_that_cannot_load_names_the_reason(tiny_model_dir, tmp_path):
    before = our_segments()
    with pytest.raises(LLMServingError, match="WorkAgent failed to start.*nothing.ckpt"):
        LLM(tiny_model_dir, num_blocks=64, distributed_executor_backend="mp",
            checkpoint=str(tmp_path / "nothing.ckpt"))
    assert our_segments() == before


def test_result_channel_holds_a_step_of_prompt_logprobs_at_the_largest_k():
    """The result segment is sized from max_num_batched_tokens and the largest k: a step
    whose every row scores a prompt token with 20 alternatives fits; far more rows do not."""
    import numpy as np
    from llm_serving.executor import shm_channel as ch
    from llm_serving.executor.protocol import SamplerOutput
    seqs, tokens, k = 16, 512, 20

    def result(rows):
        return SamplerOutput(
            np.zeros(seqs, np.int64), np.zeros(seqs, np.float32), np.zeros((seqs, k), np.int64),
            np.zeros((seqs, k), np.float32), np.zeros(seqs, np.int64),
            prompt_logprobs=np.zeros(rows, np.float32), prompt_ranks=np.zeros(rows, np.int64),
            prompt_top_token_ids=np.zeros((rows, k), np.int64),
            prompt_top_logprobs=np.zeros((rows, k), np.float32))
    buf = bytearray(ch.result_channel_bytes(seqs, max_tokens=tokens))
    ch.pack(buf, ch.result_to_arrays(result(tokens)))
    back = ch.result_from_arrays(ch.unpack(buf))
    assert back.prompt_top_token_ids.shape == (tokens, k)
    with pytest.raises(ch.ChannelFullError):
        ch.pack(buf, ch.result_to_arrays(result(tokens + 400)))


def cpus_allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


def test_tensor_parallel_agents_match_one_process_and_fall_together(model_dirs):
    """Two ranks over the MQA / tied / q-k-v-bias variant (its one KV head replicated, the tied
    embedding and LM head vocab-parallel) give the in-process tokens through swap preemption,
    penalties, seeds, n > 1 and logprobs, each rank pinned to its core. Then a killed rank
    fails the next step at once, and shutdown leaves no process and no segment behind."""
    model = model_dirs["qwen2-mqa-tied"]
    kw = dict(num_blocks=24, block_size=8, max_num_seqs=8, preemption_mode="swap",
              swap_space=0.01)
    ref = run(LLM(model, **kw))
    pinned = len(os.sched_getaffinity(0)) >= 2
    llm = LLM(model, tensor_parallel_size=2, cpu_affinity="0|1" if pinned else None, **kw)
    runner = llm.engine.runner
    ranks, scheduler = runner.procs, runner.scheduler_proc
    segments = {seg.name for seg in runner.shm_in + runner.shm_out}
    assert len(ranks) == 2 and scheduler.poll() is None and segments <= our_segments()
    if pinned:
        assert [cpus_allowed(p.pid) for p in ranks] == ["0", "1"]
    got = run(llm)
    assert llm.engine.get_stats().num_swap_preemptions > 0
    # Same tokens; log-probabilities equal up to the float summation order of the shards.
    assert [[c[0] for c in o[0]] for o in got] == [[c[0] for c in o[0]] for o in ref]
    lp, lp_ref = ([c[1] for o in outs for c in o[0]] for outs in (got, ref))
    assert [x is None for x in lp] == [x is None for x in lp_ref]
    assert [x for x in lp if x is not None] == pytest.approx(
        [x for x in lp_ref if x is not None], abs=1e-3)
    # Prompt logprobs come from the gathered vocabulary shards too: the prompt token's value.
    plp, plp_ref = ([next(iter(e.values())).logprob for o in outs if o[1] for e in o[1][1:]]
                    for outs in (got, ref))
    assert plp and plp == pytest.approx(plp_ref, abs=1e-3)

    os.kill(ranks[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(AgentDiedError, match="rank 1"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    assert time.monotonic() - t0 < 5
    assert not runner.is_alive()
    llm.engine.shutdown()
    assert all(p.poll() is not None for p in ranks + [scheduler])
    assert not segments & our_segments()
