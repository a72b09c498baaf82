"""The async engine as the HTTP layer uses it: streams of incremental outputs, aborts on
disconnect, refusals, and an engine loop that never holds up the event loop."""
from __future__ import annotations

import asyncio
import time

import pytest

from llm_serving import SamplingParams
from llm_serving.config import VLLM_NO_EFFECT_ARGS, EngineArgs
from llm_serving.engine.async_engine import AsyncLLMEngine
from llm_serving.errors import QueueFullError
from llm_serving.sampling_params import RequestOutputKind

PROMPTS = ["Give three tips for staying healthy.", "What is the capital of France?",
           "Write a haiku about the sea.", "Explain paged attention in one sentence.",
           "List five prime numbers:", "Translate 'good morning' to Chinese.",
           "Describe a sunset, in detail, with colours.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncLLMEngine(EngineArgs(tiny_model_dir, num_blocks=128, block_size=16,
                                    max_waiting_requests=64))
    yield eng
    eng.shutdown()


def delta(**kw):
    return SamplingParams(temperature=0.0, output_kind=RequestOutputKind.DELTA, **kw)


async def collect(engine, rid, prompt, params):
    texts, ids, outs = [], [], []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
        texts.append(out.outputs[0].text)
        ids.extend(out.outputs[0].token_ids)
    return "".join(texts), ids, outs


def test_concurrent_streams_of_deltas_add_up_to_the_offline_result(engine, tiny_llm):
    params = delta(max_tokens=20, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, f"s{i}", p, params)
                                      for i, p in enumerate(PROMPTS)))
    results = asyncio.run_coroutine_threadsafe(main(), _loop(engine)).result(120)
    ref = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20,
                                                    ignore_eos=True))
    for (text, ids, outs), r in zip(results, ref):
        assert ids == r.outputs[0].token_ids
        assert text == r.outputs[0].text
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert len(outs) > 1                      # it streamed, not one final blob


def test_event_loop_keeps_running_during_steps(engine):
    long_prompt = " ".join(PROMPTS * 8)           # a prefill of several hundred tokens
    step_spans = []
    runner = engine.engine.runner
    original = runner.execute

    def timed(step):
        t0 = time.perf_counter()
        try:
            return original(step)
        finally:
            step_spans.append((t0, time.perf_counter()))
    runner.execute = timed

    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.001)
        task = asyncio.ensure_future(ticker())
        await collect(engine, "long", {"prompt_token_ids": list(range(3, 900))},
                      delta(max_tokens=4, ignore_eos=True))
        await collect(engine, "long2", long_prompt, delta(max_tokens=2))
        task.cancel()
        return ticks
    try:
        ticks = asyncio.run_coroutine_threadsafe(main(), _loop(engine)).result(120)
    finally:
        runner.execute = original
    longest = max(step_spans, key=lambda s: s[1] - s[0])
    inside = [t for t in ticks if longest[0] < t < longest[1]]
    assert len(inside) >= 2, (f"the event loop ran {len(inside)} times during a "
                              f"{1000 * (longest[1] - longest[0]):.0f} ms step")


def test_leaving_the_stream_early_aborts_and_frees_blocks(engine):
    async def main():
        got = 0
        async for out in engine.generate(PROMPTS[0], delta(max_tokens=200, ignore_eos=True),
                                         "leaver"):
            got += len(out.outputs[0].token_ids)
            if got >= 3:
                break                                 # like a client disconnecting
        for _ in range(200):
            stats = await engine.get_stats()
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return got, stats
    got, stats = asyncio.run_coroutine_threadsafe(main(), _loop(engine)).result(60)
    assert got >= 3
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.num_aborted_requests >= 1


def test_abort_ends_the_stream_with_abort(engine):
    async def main():
        stream = await engine.add_request("ab", PROMPTS[1],
                                          delta(max_tokens=500, ignore_eos=True))
        first = await stream.__anext__()
        engine.abort("ab")
        rest = [o async for o in stream]
        return first, rest
    first, rest = asyncio.run_coroutine_threadsafe(main(), _loop(engine)).result(60)
    assert not first.finished
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


def test_bad_input_and_a_full_queue_are_refused_at_once(tiny_model_dir):
    eng = AsyncLLMEngine(EngineArgs(tiny_model_dir, num_blocks=64, max_num_seqs=1,
                                    max_waiting_requests=2))

    async def main():
        with pytest.raises(ValueError, match="empty"):
            await eng.add_request("bad", {"prompt_token_ids": []})
        with pytest.raises(ValueError, match="already in use"):
            # (long enough not to end before the loop below sees it run, on a busy machine)
            await eng.add_request("dup", "hi", delta(max_tokens=500, ignore_eos=True))
            await eng.add_request("dup", "hi")
        while (await eng.get_stats()).num_running == 0:     # "dup" holds the only slot
            await asyncio.sleep(0.01)
        streams = [await eng.add_request(f"q{i}", "hello", delta(max_tokens=50,
                                                                ignore_eos=True))
                   for i in range(2)]
        with pytest.raises(QueueFullError, match="max_waiting_requests"):
            await eng.add_request("q2", "hello")
        for s in streams:
            eng.abort(s.request_id)
        eng.abort("dup")
    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
    assert not eng.engine.has_unfinished_requests()


_LOOPS = {}


def _loop(engine):
    """One event loop per engine, on its own thread, as a server would have."""
    import threading
    if engine not in _LOOPS:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        _LOOPS[engine] = loop
    return _LOOPS[engine]


def test_a_failing_step_fails_its_requests_but_not_the_engine(tiny_model_dir):
    eng = AsyncLLMEngine(EngineArgs(tiny_model_dir, num_blocks=64))
    runner = eng.engine.runner
    original = runner.execute
    calls = []

    def broken(step):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated kernel failure")
        return original(step)
    runner.execute = broken

    async def main():
        _, _, outs = await collect(eng, "a", PROMPTS[0], delta(max_tokens=10, ignore_eos=True))
        assert outs[-1].finished and "simulated kernel failure" in outs[-1].error
        text, ids, outs = await collect(eng, "b", PROMPTS[1],
                                        delta(max_tokens=5, ignore_eos=True))
        return ids, (await eng.get_stats())
    try:
        ids, stats = asyncio.run(main())
    finally:
        eng.shutdown()
    assert len(ids) == 5 and stats.kv_cache_usage == 0.0      # served on after the failure


def test_stream_interval_sends_tokens_in_chunks_of_n(tiny_model_dir, tiny_llm):
    """vLLM's --stream-interval: a read (an SSE chunk) every N tokens, the first token and the
    end at once; the tokens and text are those of a token-by-token stream."""
    eng = AsyncLLMEngine(EngineArgs(tiny_model_dir, num_blocks=64, stream_interval=4))
    params = delta(max_tokens=18, ignore_eos=True)

    async def main():
        merged = await asyncio.gather(*(collect(eng, f"m{i}", p, params)
                                        for i, p in enumerate(PROMPTS[:3])))
        stream = await eng.add_request("steps", PROMPTS[0], params)
        reads = [len(outs) async for outs in stream.steps()]
        # a request's own interval raises the server's (6) and never lowers it (2 -> 4)
        own = await asyncio.gather(*(collect(eng, f"own{n}", PROMPTS[1],
                                             delta(max_tokens=18, ignore_eos=True,
                                                   stream_interval=n)) for n in (2, 6)))
        return merged, reads, own
    try:
        merged, reads, own = asyncio.run_coroutine_threadsafe(main(), _loop(eng)).result(300)
    finally:
        eng.shutdown()
    ref = tiny_llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=18,
                                                        ignore_eos=True))
    for (text, ids, outs), r in zip(merged, ref):
        assert ids == r.outputs[0].token_ids and text == r.outputs[0].text
        sizes = [len(o.outputs[0].token_ids) for o in outs]
        assert sizes[0] >= 1 and all(n >= 4 for n in sizes[1:-1]) and 1 < len(sizes) <= 6
    assert sum(reads) == 18 and all(n >= 4 for n in reads[1:-1]) and 1 < len(reads) <= 6
    for (_, ids, outs), least in zip(own, (4, 6)):
        sizes = [len(o.outputs[0].token_ids) for o in outs]
        assert len(ids) == 18 and all(n >= least for n in sizes[1:-1]), (least, sizes)


def _delta_output(n_tokens: int, finished: bool):
    from llm_serving.outputs import CompletionOutput, RequestOutput
    tokens = CompletionOutput(0, "x" * n_tokens, [7] * n_tokens, None, None)
    return RequestOutput("r", "p", [1], [tokens], finished)


def test_a_stream_interval_counts_tokens_not_steps():
    """A step that brings 3 tokens (accepted drafts) counts 3 towards stream_interval 4: after
    the first output, a read every second step (6 tokens), not every fourth."""
    from llm_serving.engine.async_engine import RequestStream

    async def main():
        stream = RequestStream("r", RequestOutputKind.DELTA, interval=4)
        sizes = []

        async def read():
            async for out in stream:
                sizes.append(len(out.outputs[0].token_ids))
        reader = asyncio.ensure_future(read())
        for i in range(7):
            stream.put(_delta_output(3, finished=i == 6))
            for _ in range(3):
                await asyncio.sleep(0)        # the reader takes what is ready
        await reader
        return sizes
    assert asyncio.run(main()) == [3, 6, 6, 6]


def test_the_prefill_backlog_bound_refuses_while_prompts_wait(tiny_model_dir):
    """vLLM's max_num_queued_tokens: prompt tokens of requests without a first token yet. One
    sequence runs at a time (max_num_seqs=1), so the requests behind it wait with their
    prompts; at the bound a new request is refused at once naming the flag, and once the
    waiting ones have their first token the backlog is empty again."""
    eng = AsyncLLMEngine(EngineArgs(tiny_model_dir, num_blocks=64, max_num_seqs=1,
                                    max_num_queued_tokens=20))
    prompt = {"prompt_token_ids": list(range(5, 17))}          # 12 tokens

    async def main():
        hog = await eng.add_request("hog", "hi", delta(max_tokens=500, ignore_eos=True))
        await hog.__anext__()                       # its prefill is done: it no longer counts
        first = await eng.add_request("w1", prompt, delta(max_tokens=2))     # backlog 12
        second = await eng.add_request("w2", prompt, delta(max_tokens=2))    # 12 < 20: taken
        with pytest.raises(QueueFullError, match=r"24 prompt tokens.*max_num_queued_tokens=20"):
            await eng.add_request("w3", prompt, delta(max_tokens=2))
        eng.abort("hog")
        for s in (first, second):
            async for _ in s:
                pass
        third = await eng.add_request("w3", prompt, delta(max_tokens=2))
        return [o async for o in third]
    try:
        outs = asyncio.run(main())
    finally:
        eng.shutdown()
    assert len(outs[-1].outputs[0].token_ids) == 2 or sum(
        len(o.outputs[0].token_ids) for o in outs) == 2


def test_vllm_async_engine_args_build_the_engine_and_log_requests(tiny_model_dir, caplog):
    """A vLLM script's ``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))``: vLLM's
    no-effect arguments are taken with one warning (a TypeError before), and
    enable_log_requests logs each arrival and abort as vLLM's engine does."""
    import logging
    from llm_serving import AsyncEngineArgs
    with caplog.at_level(logging.WARNING, logger="llm_serving.config"):
        args = AsyncEngineArgs(model=tiny_model_dir, num_blocks=64, enable_log_requests=True,
                               gpu_memory_utilization=0.9, trust_remote_code=True)
    assert [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()] == [
        "AsyncEngineArgs: these vLLM arguments have no effect here: gpu_memory_utilization "
        f"({VLLM_NO_EFFECT_ARGS['gpu_memory_utilization'].why}); trust_remote_code "
        f"({VLLM_NO_EFFECT_ARGS['trust_remote_code'].why})"]
    with pytest.raises(TypeError, match="frobnicate"):      # an unknown one is still refused
        EngineArgs(model=tiny_model_dir, frobnicate=1)
    eng = AsyncLLMEngine.from_engine_args(args)

    async def main():
        _, ids, _ = await collect(eng, "kept", PROMPTS[0], delta(max_tokens=3, ignore_eos=True))
        async for _ in eng.generate(PROMPTS[1], delta(max_tokens=50, ignore_eos=True), "left"):
            break                       # the caller leaves after its first output: aborted
        await asyncio.sleep(0.5)
        return ids
    try:
        with caplog.at_level(logging.INFO, logger="llm_serving.engine.async_engine"):
            ids = asyncio.run(main())
    finally:
        eng.shutdown()
    logged = [r.getMessage() for r in caplog.records if r.name.endswith("async_engine")]
    assert len(ids) == 3
    assert ["Added request kept.", "Added request left.", "Aborted request left."] == [
        m for m in logged if m.split()[0] in ("Added", "Aborted")]


def test_collective_rpc_runs_between_steps_of_running_streams(engine, tiny_llm):
    """vLLM's AsyncLLM.collective_rpc while streams run: each call (a failing one included)
    runs between two steps, and the streams still give the offline result."""
    from llm_serving.executor.collective_rpc import CollectiveRPCError
    params = delta(max_tokens=20, ignore_eos=True)

    async def calls():
        got = []
        for i in range(4):
            got.append(await engine.collective_rpc(lambda w, i: (w.rank, i), args=(i,)))
            with pytest.raises(CollectiveRPCError, match="ZeroDivisionError"):
                await engine.collective_rpc(lambda w: 1 / 0)
        return got

    async def main():
        return await asyncio.gather(calls(), *(collect(engine, f"rpc{i}", p, params)
                                               for i, p in enumerate(PROMPTS[:4])))
    got, *streams = asyncio.run_coroutine_threadsafe(main(), _loop(engine)).result(120)
    assert got == [[(0, i)] for i in range(4)]
    ref = tiny_llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=20,
                                                        ignore_eos=True), use_tqdm=False)
    assert [ids for _, ids, _ in streams] == [list(r.outputs[0].token_ids) for r in ref]
