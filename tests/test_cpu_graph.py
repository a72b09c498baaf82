"""CPU graphs (model_executor/cpu_graph.py): decode steps replayed from a capture of their
kernel calls must give what running them op by op gives, and fall back to op by op whenever
a capture cannot be trusted."""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.executor.protocol import StepInput
from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.cpu_graph import STEADY_STEPS, CpuGraphs


def _generate(model_dir, enforce_eager, prompts, params):
    llm = LLM(model_dir, num_blocks=128, block_size=16, max_num_seqs=6,
              enforce_eager=enforce_eager)
    outs = llm.generate(prompts, params)
    return outs, llm.engine.runner.graphs


def _prompts(vocab, n=9, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, int(rng.integers(3, 40))).tolist()}
            for _ in range(n)]


@pytest.mark.parametrize("variant", ["llama3-gqa", "qwen2-mqa-tied"])
def test_replayed_decode_steps_give_the_eager_tokens_and_logprobs(model_dirs, variant):
    # Outputs of different lengths: the decode batch shrinks from 6 to 1 as requests end, so
    # several batch sizes are captured, verified and replayed; seeded sampling and logprobs
    # read the logits themselves.
    prompts = _prompts(1024)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2,
                             ignore_eos=True, max_tokens=12 + 5 * i) for i in range(len(prompts))]
    replayed, graphs = _generate(model_dirs[variant], False, prompts, params)
    eager, no_graphs = _generate(model_dirs[variant], True, prompts, params)
    assert no_graphs is None
    assert graphs.stats.replayed_steps > 20 and len(graphs.stats.captured) >= 3
    assert not graphs.stats.failed
    # every kernel is called from C; only the embedding's NumPy gather from Python
    assert {tuple(graphs.graphs[b].program.python_calls) for b in graphs.stats.captured} == {
        ("_take_rows",)}
    for r, e in zip(replayed, eager):
        assert r.outputs[0].token_ids == e.outputs[0].token_ids
        assert r.outputs[0].logprobs == e.outputs[0].logprobs


def test_a_computation_outside_the_recorded_kernels_is_caught(model_dirs, monkeypatch):
    # SiLU-and-mul computed by NumPy instead of a launched kernel: the values are right when it
    # runs, but a replay would keep the captured step's. The verification step must see it,
    # and the steps run op by op, still right.
    from llm_serving.model_executor.layers.activation import SiluAndMul
    from mindspore import Tensor

    def numpy_silu(self, x):
        a = x.asnumpy()
        f = a.shape[1] // 2
        g = a[:, :f].astype(np.float64)
        return Tensor.from_numpy((g / (1 + np.exp(-g)) * a[:, f:]).astype(np.float32))

    prompts = _prompts(1024, n=4, seed=1)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    monkeypatch.setattr(SiluAndMul, "forward_cpu", numpy_silu)
    caught, graphs = _generate(model_dirs["llama3-gqa"], False, prompts, params)
    eager, _ = _generate(model_dirs["llama3-gqa"], True, prompts, params)
    assert graphs.stats.replayed_steps == 0 and not graphs.stats.captured
    assert "did not reproduce" in graphs.stats.failed[4]
    assert [o.outputs[0].token_ids for o in caught] == [o.outputs[0].token_ids for o in eager]


# ---- CpuGraphs alone, on a stand-in forward ------------------------------------------------

def _fill(ids, positions, out):
    out[...] = ids[:, None] * 100.0 + positions[:, None] + np.arange(out.shape[1])


def _step(ids, positions):
    b = len(ids)
    return StepInput(np.array(ids, np.int32), np.array(positions, np.int32),
                     np.arange(b, dtype=np.int32), np.zeros((b, 2), np.int32),
                     np.arange(b + 1, dtype=np.int32), np.ones(b, np.int32),
                     np.arange(b, dtype=np.int32))


def _expected(step, rows):
    out = np.empty((len(step.input_ids), 3), np.float32)
    _fill(step.input_ids, step.positions, out)
    return out[rows]


class _Forward:
    """Writes ids * 100 + position + column through a launched kernel; ``extra`` allocates
    b * b more floats (outputs that grow faster than the rows), ``mode`` misbehaves."""

    def __init__(self, extra=False, mode=None):
        self.extra, self.mode, self.calls, self.rc = extra, mode, 0, 0

    def __call__(self, ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens):
        self.calls += 1
        b = len(ids)
        if self.extra:
            cpu_graph.empty(b * b * 64, np.float32)
        out = cpu_graph.empty((b, 3), np.float32)
        if self.mode == "unlaunched":
            _fill(ids, positions, out)
        elif self.mode == "list-arg":        # the layout could not move a pointer in a list
            cpu_graph.launch(lambda args: _fill(*args), [ids, positions, out])
        elif self.mode == "rc":              # returns self.rc (this stand-in ignores it)
            cpu_graph.launch(self._fill_rc, ids, positions, out)
        else:
            cpu_graph.launch(_fill, ids, positions, out)
        if self.mode == "unsupported":
            cpu_graph.unsupported("a stand-in collective")
        return out

    def _fill_rc(self, ids, positions, out):
        _fill(ids, positions, out)
        return self.rc


def _run(graphs, b, start, rows=None):
    step = _step(list(range(start, start + b)), list(range(7, 7 + b)))
    rows = np.arange(b) if rows is None else rows
    assert graphs.replayable(step)
    got = graphs.logits(step, rows)
    assert got is None or np.array_equal(got, _expected(step, rows))
    return got


def test_a_batch_size_is_eager_then_captured_then_verified_then_replayed():
    fwd = _Forward()
    graphs = CpuGraphs(fwd, max_batch=8, max_blocks_per_seq=4)
    assert _run(graphs, 3, 10) is None                      # first sight: the caller runs it
    assert _run(graphs, 3, 20) is not None and fwd.calls == 1      # captured while run
    assert _run(graphs, 3, 30) is not None and fwd.calls == 2      # replayed and run: equal
    assert graphs.stats.captured == [3]
    for start in (40, 50, 60):                              # replayed: new inputs each time
        got = _run(graphs, 3, start, rows=np.array([2, 0]))
        assert got is not None and got.shape == (2, 3)
    assert fwd.calls == 2 and graphs.stats.replayed_steps == 3
    # A returned array is the caller's: the next replay does not change it.
    kept = _run(graphs, 3, 70)
    before = kept.copy()
    _run(graphs, 3, 80)
    assert np.array_equal(kept, before)


def test_a_size_above_max_batch_is_captured_only_once_steady():
    """Above --max-capture-batch, a batch that changes size every step (one draining as its
    requests finish) is never captured; a size that runs STEADY_STEPS decode steps in a row is
    captured, checked and replayed, up to max_steady_batch (--max-num-seqs)."""
    fwd = _Forward()
    graphs = CpuGraphs(fwd, max_batch=2, max_blocks_per_seq=4, max_steady_batch=8)
    for i in range(3 * STEADY_STEPS):
        assert _run(graphs, 3 + i % 2, 10 * i) is None
    assert fwd.calls == 0 and graphs.stats.captured == []
    for i in range(STEADY_STEPS):                           # steady: eager until the last
        assert _run(graphs, 5, 10 * i) is None
    assert _run(graphs, 5, 100) is not None and fwd.calls == 1     # captured while run
    assert _run(graphs, 5, 110) is not None and fwd.calls == 2     # replayed and run: equal
    assert graphs.stats.captured == [5]
    assert _run(graphs, 5, 120) is not None and fwd.calls == 2
    assert graphs.stats.replayed_steps == 1
    assert _run(graphs, 2, 130) is None                     # at or below max_batch: at once
    assert _run(graphs, 2, 140) is not None and fwd.calls == 3
    assert not graphs.replayable(_step(range(9), range(9)))        # above max_steady_batch


def test_a_steady_size_is_not_captured_past_the_capture_memory_bound(monkeypatch):
    """A capture keeps its step's outputs on fresh memory: a size above --max-capture-batch
    whose capture the earlier ones put above STEADY_CAPTURE_BYTES stays eager."""
    fwd = _Forward(extra=True)                  # b * b * 64 floats more per step
    graphs = CpuGraphs(fwd, max_batch=2, max_blocks_per_seq=4, max_steady_batch=8)
    assert _run(graphs, 2, 0) is None and _run(graphs, 2, 10) is not None      # captured
    per_row = graphs._row_bytes
    assert per_row >= 2 * 64 * 4
    monkeypatch.setattr(cpu_graph, "STEADY_CAPTURE_BYTES", int(per_row * 5) - 1)
    for i in range(3 * STEADY_STEPS):
        assert _run(graphs, 5, 100 + 10 * i) is None
    assert fwd.calls == 1 and 5 not in graphs.graphs
    monkeypatch.setattr(cpu_graph, "STEADY_CAPTURE_BYTES", int(per_row * 5))
    assert _run(graphs, 5, 500) is None and _run(graphs, 5, 510) is not None   # captured


def test_steps_it_cannot_replay_are_refused():
    graphs = CpuGraphs(_Forward(), max_batch=4, max_blocks_per_seq=2)
    assert not graphs.replayable(_step(range(5), range(5)))           # above max_batch
    wide = _step([1, 2], [3, 4])
    wide.block_tables = np.zeros((2, 3), np.int32)                    # more blocks than fit
    assert not graphs.replayable(wide)
    prefill = _step([1, 2, 3], [0, 1, 2])
    prefill.seq_lens = np.array([3], np.int32)                        # one sequence, 3 rows
    prefill.query_start_loc = np.array([0, 3], np.int32)
    assert not graphs.replayable(prefill)


def test_the_arena_grows_and_earlier_captures_move_with_it():
    graphs = CpuGraphs(_Forward(extra=True), max_batch=8, max_blocks_per_seq=4)
    for start in (0, 10, 20):
        _run(graphs, 2, start)
    assert graphs.stats.captured == [2]
    small = len(graphs.arena)
    for start in (30, 40, 50):
        _run(graphs, 8, start)
    assert len(graphs.arena) > small and sorted(graphs.stats.captured) == [2, 8]
    for start in (60, 70, 80, 90):              # the 2-row graph now runs on the new arena
        assert _run(graphs, 2, start) is not None and _run(graphs, 8, start) is not None
    assert graphs.stats.replayed_steps == 8


def _plus_one_at(src: int, dst: int, n: int) -> None:
    """dst[:n] = src[:n] + 1 on float32 memory at two addresses (a kernel called by pointer)."""
    a = np.ctypeslib.as_array((ctypes.c_float * n).from_address(src))
    np.ctypeslib.as_array((ctypes.c_float * n).from_address(dst))[:] = a + 1


def _copy_by_pointer_array(ptrs, nbytes: int) -> None:
    """ptrs[1][:nbytes] = ptrs[0][:nbytes] (pointers passed in a ctypes array, like the fused
    qkv projection's output parts)."""
    ctypes.memmove(ptrs[1], ptrs[0], nbytes)


class _Layers:
    """``depth`` layers, each writing a fresh [b, width] buffer from the previous one, by
    pointer, by a ctypes pointer array or as NumPy arrays: the logits are the ids' fill plus
    the number of +1 layers."""

    def __init__(self, depth=10, width=64):
        self.depth, self.width = depth, width

    def __call__(self, ids, positions, *rest):
        b, n = len(ids), len(ids) * self.width
        x = cpu_graph.empty((b, self.width), np.float32)
        cpu_graph.launch(_fill, ids, positions, x)
        for i in range(self.depth):
            y = cpu_graph.empty((b, self.width), np.float32)
            if i % 2:
                cpu_graph.launch(_plus_one_at, x.ctypes.data, y.ctypes.data, n)
            else:
                ptrs = (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data)
                cpu_graph.launch(_copy_by_pointer_array, ptrs, 4 * n)
            x = y
        return x


def test_buffers_share_arena_bytes_once_their_last_reader_has_run():
    # A model step allocates every layer's outputs; the arena holds what is live at once (two
    # layers' buffers here), not all of them, and the replays stay right.
    b, width, depth = 4, 64, 10
    graphs = CpuGraphs(_Layers(depth, width), max_batch=4, max_blocks_per_seq=2)
    one = b * width * 4
    for start in range(0, 70, 10):
        step = _step(list(range(start, start + b)), list(range(b)))
        got = graphs.logits(step, np.arange(b))
        if got is not None:
            want = np.empty((b, width), np.float32)
            _fill(step.input_ids, step.positions, want)
            assert np.array_equal(got, want + depth // 2)
    assert graphs.stats.captured == [b] and graphs.stats.replayed_steps == 4
    assert len(graphs.arena) <= 2 * one < (depth + 1) * one


@pytest.mark.parametrize("mode, why", [("unlaunched", "did not reproduce"),
                                       ("unsupported", "a stand-in collective"),
                                       ("list-arg", "argument of type list")])
def test_a_capture_that_cannot_be_trusted_runs_eagerly_from_then_on(mode, why):
    fwd = _Forward(mode=mode)
    graphs = CpuGraphs(fwd, max_batch=4, max_blocks_per_seq=2)
    results = [_run(graphs, 2, start) for start in range(0, 60, 10)]
    assert why in graphs.stats.failed[2]
    assert graphs.stats.replayed_steps == 0 and not graphs.stats.captured
    assert results[-1] is None                  # the caller runs the step itself


def test_a_replayed_kernel_that_fails_sends_its_batch_size_back_to_eager():
    # A kernel error in a replay (the eager run of the same step succeeds): the step's logits
    # come from an eager run, right, and that size is not replayed again.
    fwd = _Forward(mode="rc")
    graphs = CpuGraphs(fwd, max_batch=4, max_blocks_per_seq=2)
    for start in (0, 10, 20, 30):
        _run(graphs, 2, start)
    assert graphs.stats.captured == [2] and graphs.stats.replayed_steps == 1
    fwd.rc, calls = 1, fwd.calls
    assert _run(graphs, 2, 40) is not None and fwd.calls == calls + 1     # (run eagerly)
    assert "replay failed" in graphs.stats.failed[2] and graphs.stats.captured == []
    fwd.rc = 0
    assert _run(graphs, 2, 50) is None and graphs.stats.replayed_steps == 1


def test_a_layout_that_breaks_leaves_the_step_right_and_the_size_eager(monkeypatch, caplog):
    def broken(self, first, last):
        raise IndexError("a layout bug")

    monkeypatch.setattr(cpu_graph._Layout, "_place", broken)
    graphs = CpuGraphs(_Forward(), max_batch=4, max_blocks_per_seq=2)
    with caplog.at_level(logging.WARNING, logger=cpu_graph.__name__):
        results = [_run(graphs, 2, start) for start in range(0, 40, 10)]
    assert results[1] is not None and results[2:] == [None, None]
    assert "a layout bug" in graphs.stats.failed[2] and graphs.stats.replayed_steps == 0
    # one record, an error with the traceback (a bug to report, not a size that fails alike)
    [rec] = caplog.records
    assert rec.levelno == logging.ERROR and rec.exc_info and "a layout bug" in rec.getMessage()


def test_a_capture_records_only_its_own_threads_kernels():
    # Two engines in one process (a PD pair, several LLMs) step at once: the kernels another
    # thread launches during a capture must not be replayed with it.
    import threading
    other_calls = []
    go, done = threading.Event(), threading.Event()

    def other_engine():
        go.wait(10)
        cpu_graph.launch(other_calls.append, cpu_graph.empty(4, np.float32))
        done.set()

    def forward(ids, positions, *rest):
        if cpu_graph._state.capture is not None and not go.is_set():
            go.set()
            assert done.wait(10)
        out = cpu_graph.empty((len(ids), 3), np.float32)
        cpu_graph.launch(_fill, ids, positions, out)
        return out

    thread = threading.Thread(target=other_engine)
    thread.start()
    graphs = CpuGraphs(forward, max_batch=4, max_blocks_per_seq=2)
    for start in range(0, 80, 10):
        _run(graphs, 2, start)
    thread.join(10)
    assert len(other_calls) == 1 and graphs.stats.replayed_steps == 5
    assert [fn for fn, _ in graphs.graphs[2].ops] == [_fill]


def test_a_program_calls_its_kernels_from_c_as_ctypes_would_and_names_the_one_that_fails():
    """Replays run their kernels through a ``Program``: runs of C kernels called from C, each
    through its own C type (pointer, int64, int and float arguments, ctypes arrays), Python
    callables in between from Python, in order. It must compute what the ctypes calls compute,
    and a kernel that returns an error must stop the run and be named."""
    from llm_serving.model_executor.layers.custom_op import cpu_layer_ops
    from llm_serving.model_executor.layers.gemm import pack_weight
    lib = cpu_layer_ops()
    rng = np.random.default_rng(0)
    x, r0, nw = (rng.standard_normal(s).astype(np.float32) for s in ((3, 40), (3, 40), 40))
    w = rng.standard_normal((24, 40)).astype(np.float32)
    wp = pack_weight(w, lib.lls_layer_ops_panel_width())

    def double(src, dst):
        np.multiply(src, 2.0, out=dst)
    results = []
    for program in (False, True):
        normed, res, y = np.empty_like(x), r0.copy(), np.full((3, 24), np.nan, np.float32)
        doubled = np.empty_like(x)
        split, ld = (ctypes.c_int64 * 2)(0, 24), (ctypes.c_int64 * 1)(24)
        out = (ctypes.c_void_p * 1)(y.ctypes.data)
        ops = [(lib.add_rms_norm_f32, (x.ctypes.data, res.ctypes.data, nw.ctypes.data,
                                       normed.ctypes.data, 3, 40, 1e-5)),
               (double, (normed, doubled)),          # Python, between two C runs
               (lib.lls_linear_f32, (doubled.ctypes.data, 40, wp.ctypes.data, None, 3, 24, 40,
                                     1, split, out, ld))]
        if program:
            prog = cpu_graph.Program(ops)
            assert prog.python_calls == ["double"]
            prog()
        else:
            for fn, args in ops:
                fn(*args)
        results.append((normed, res, y))
    for a, b in zip(*results):
        np.testing.assert_array_equal(b, a)
    normed, res, y = results[0]
    np.testing.assert_allclose(res, x + r0, rtol=1e-6)
    ref = res / np.sqrt((res.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * nw
    np.testing.assert_allclose(normed, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, 2 * normed @ w.T, rtol=1e-4, atol=1e-4)

    # a row stride shorter than a row: lls_linear_f32 returns -1, and the run stops there
    y[:] = np.nan
    after = np.zeros(4, np.float32)
    bad = cpu_graph.Program([
        (lib.lls_linear_f32, (x.ctypes.data, 39, wp.ctypes.data, None, 3, 24, 40, 1, split,
                              out, ld)),
        (lib.silu_and_mul_f32, (np.ones(8, np.float32).ctypes.data, after.ctypes.data, 1, 4))])
    with pytest.raises(RuntimeError, match="lls_linear_f32"):
        bad()
    assert np.isnan(y).all() and not after.any()

