"""The Ascend attention backend (model_executor/attention/ascend.py) run on CPU with numpy
stand-ins for its fused ops (tests/ascend_ops.py), compared with the CPU backend.

The stand-ins replace the primitives in ``mindspore.ops.operations.nn_ops``, where the backend
looks them up, so the product code runs unchanged: its ``prepare()``, row bookkeeping, dtype
casts, cache layout and block moves are what is tested; the stand-ins check each call against
the op's documented contract and compute it in numpy. The reference is the CPU backend's C++
paged-attention kernels (float32 cache), so agreement is within float16 rounding.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import ascend_ops
from llm_serving import LLM, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.executor.protocol import StepInput
from llm_serving.model_executor.attention import selector

# float16 KV and attention inputs: measured within 1e-3 of the largest logit (2026-11-23).
RTOL = 5e-3


@contextlib.contextmanager
def ascend_backend_with_standins():
    """The Ascend backend (with the numpy stand-ins for its ops) serves the CPU device while
    the context is open: models built inside it get Ascend attention backends, and their
    other layers take the MindSpore-op path (``forward_native``) they take on Ascend."""
    from mindspore.ops.operations import nn_ops
    mp = pytest.MonkeyPatch()
    try:
        for name, cls in ascend_ops.STANDINS.items():
            mp.setattr(nn_ops, name, cls)
        mp.setitem(selector.BACKENDS, "CPU", selector.BACKENDS["Ascend"])
        mp.setenv("LLM_SERVING_NATIVE_OPS", "1")
        ascend_ops.reset_calls()
        yield
    finally:
        mp.undo()


def _runners(model_dir, block_size, num_blocks):
    from llm_serving.model_executor.model_runner import ModelRunner
    config = EngineArgs(model=model_dir, block_size=block_size, num_blocks=num_blocks,
                        preemption_mode="swap", swap_space=0.002).create_engine_config()
    cpu = ModelRunner(config)
    with ascend_backend_with_standins():
        asc = ModelRunner(config)
    assert asc.backend.name == "ascend" and cpu.backend.name == "cpu"
    assert not asc.model.lm_head._use_cpu and cpu.model.lm_head._use_cpu
    return cpu, asc


class Script:
    """Hand-made steps over a paged cache: sequences own blocks from a shuffled pool, steps
    are ragged batches of (sequence, number of new tokens)."""

    def __init__(self, block_size, num_blocks, vocab, seed):
        self.bs, self.vocab = block_size, vocab
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(num_blocks))
        self.tokens: dict = {}    # seq -> token ids so far (computed ones)
        self.blocks: dict = {}    # seq -> block ids

    def ensure_blocks(self, s, n_tokens):
        need = -(-n_tokens // self.bs) - len(self.blocks[s])
        self.blocks[s] += [int(self.free.pop()) for _ in range(max(0, need))]

    def step(self, work, **moves) -> StepInput:
        """work: [(seq, new token ids)]; returns the step (block tables padded with 0)."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for s, new in work:
            self.tokens.setdefault(s, [])
            self.blocks.setdefault(s, [])
            before = len(self.tokens[s])
            self.tokens[s] += list(new)
            self.ensure_blocks(s, len(self.tokens[s]))
            p = np.arange(before, len(self.tokens[s]))
            table = np.asarray(self.blocks[s])
            ids += list(new)
            pos += list(p)
            slots += list(table[p // self.bs] * self.bs + p % self.bs)
            starts.append(starts[-1] + len(new))
            lens.append(len(self.tokens[s]))
        width = max(len(self.blocks[s]) for s, _ in work)
        tables = np.zeros((len(work), width), np.int32)
        for i, (s, _) in enumerate(work):
            tables[i, :len(self.blocks[s])] = self.blocks[s]
        i32 = lambda x: np.asarray(x, np.int32)   # noqa: E731
        return StepInput(i32(ids), i32(pos), i32(slots), tables, i32(starts), i32(lens),
                         sample_seqs=np.zeros(0, np.int32), **moves)

    def new_ids(self, n):
        return self.rng.integers(3, self.vocab, n).tolist()


def _compare(cpu, asc, step):
    rows = np.arange(len(step.input_ids))
    for runner in (cpu, asc):       # as ModelRunner.execute does, without sampling
        runner.move_blocks(step.swap_out, step.swap_in, step.copies)
    ref = cpu.forward(step, rows)
    got = asc.forward(step, rows)
    assert got.dtype == np.float32 and got.shape == ref.shape
    scale = float(np.abs(ref).max())
    err = float(np.abs(got - ref).max())
    assert err <= RTOL * scale, f"max |ascend - cpu| = {err:.3g} (logits up to {scale:.3g})"
    return err / scale


@pytest.mark.parametrize("variant,block_size", [("llama3-gqa", 16), ("llama3-gqa", 128),
                                                ("qwen2-mqa-tied", 16)])
def test_random_ragged_batches_match_the_cpu_backend(model_dirs, variant, block_size):
    """Fresh prefills, prefill chunks continuing from cache, decodes and mixes of all three,
    on random ragged batches: every token row's logits match the CPU backend's."""
    num_blocks = 64 if block_size == 16 else 12
    cpu, asc = _runners(model_dirs[variant], block_size, num_blocks)
    sc = Script(block_size, num_blocks, cpu.config.vocab_size, seed=block_size)
    rng = sc.rng
    target = {s: int(rng.integers(20, 150)) for s in range(6)}
    ascend_ops.reset_calls()
    seen = set()
    for _ in range(12):
        work = []
        for s in rng.permutation(6):
            done = len(sc.tokens.get(s, []))
            if done >= target[s] or rng.random() < 0.3:
                continue
            if done == 0:                      # a new prefill: whole, or its first chunk
                n = target[s] if rng.random() < 0.5 else int(rng.integers(1, target[s]))
            elif rng.random() < 0.5:           # a decode
                n = 1
            else:                              # a chunk continuing from the cache
                n = int(rng.integers(1, target[s] - done + 1))
            n = min(n, target[s] - done) or 1
            seen.add("fresh" if done == 0 else "decode" if n == 1 else "chunk")
            work.append((int(s), sc.new_ids(n)))
        if work:
            _compare(cpu, asc, sc.step(work))
    assert seen == {"fresh", "decode", "chunk"}
    # Both fused attention paths ran, on batches of several sequences / rows.
    assert max(len(c) for c in ascend_ops.FlashAttentionScore.calls) > 1
    assert max(ascend_ops.PagedAttention.calls) > 1


def test_prefix_hit_copy_on_write_and_swap_keep_the_float16_layout(model_dirs):
    """Block moves on the float16 [num_blocks, block_size, KVH, D] cache: a prefix-cache hit
    reading another sequence's blocks, a copy-on-write fork of a partly filled block, and a
    swap out to the host pool and back into other device blocks (whose old contents are
    overwritten in between) all give the CPU backend's logits."""
    bs = 16
    cpu, asc = _runners(model_dirs["llama3-gqa"], bs, 32)
    assert asc.host_caches and asc.host_caches[0][0].dtype == np.float16
    assert asc.host_caches[0][0].shape[1:] == (bs, asc.backend.num_kv_heads,
                                               asc.backend.head_dim)
    sc = Script(bs, 32, cpu.config.vocab_size, seed=7)
    prompt = sc.new_ids(40)                                  # 2 full blocks + 8 tokens
    _compare(cpu, asc, sc.step([(0, prompt)]))
    # Prefix-cache hit: sequence 1 starts with sequence 0's two full blocks and computes
    # only the rest of its prompt (a chunk continuing from cached tokens).
    sc.tokens[1], sc.blocks[1] = list(prompt[:32]), list(sc.blocks[0][:2])
    _compare(cpu, asc, sc.step([(1, sc.new_ids(11)), (0, sc.new_ids(1))]))
    # Copy-on-write: sequence 2 forks sequence 0; the shared partial block is copied.
    fresh = int(sc.free.pop())
    sc.tokens[2] = list(sc.tokens[0])
    sc.blocks[2] = sc.blocks[0][:-1] + [fresh]
    copies = np.array([[sc.blocks[0][-1], fresh]], np.int32)
    _compare(cpu, asc, sc.step([(0, sc.new_ids(1)), (2, sc.new_ids(1))], copies=copies))
    # Swap sequence 0 out (host blocks 3..5), let sequence 3 take its device blocks, then
    # swap it back into other blocks and keep decoding.
    own = [b for b in sc.blocks[0] if b not in sc.blocks[1] and b not in sc.blocks[2]]
    out_pairs = np.array([[b, 3 + i] for i, b in enumerate(sc.blocks[0])], np.int32)
    _compare(cpu, asc, sc.step([(2, sc.new_ids(1))], swap_out=out_pairs))
    for dev, host in zip(asc.kv_caches, asc.host_caches):
        for d, h in ((dev[0], host[0]), (dev[1], host[1])):
            moved = h[3:3 + len(out_pairs)]
            assert moved.any() and np.array_equal(moved, d.asnumpy()[out_pairs[:, 0]])
    sc.blocks[3], sc.tokens[3] = list(own), []               # sequence 3 takes them
    _compare(cpu, asc, sc.step([(3, sc.new_ids(len(own) * bs))]))
    new_home = [int(sc.free.pop(0)) for _ in sc.blocks[0]]
    assert not set(new_home) & set(sc.blocks[3])
    in_pairs = np.array([[3 + i, b] for i, b in enumerate(new_home)], np.int32)
    sc.blocks[0] = new_home
    _compare(cpu, asc, sc.step([(0, sc.new_ids(1)), (2, sc.new_ids(2))], swap_in=in_pairs))
    _compare(cpu, asc, sc.step([(0, sc.new_ids(3)), (1, sc.new_ids(1))]))


def test_the_engine_serves_the_same_tokens_with_the_ascend_backend(tiny_model_dir):
    """The real engine (scheduler, block manager, in-process runner) with the Ascend backend:
    chunked prefill under a small token budget, prefix-cache hits, n=2 forks (copy-on-write)
    and swap preemption in a pool too small for every request at once. Greedy tokens equal
    the CPU backend's, and their logprobs agree within float16 rounding."""
    shared = "Below is an instruction that describes a task. Write a response. " * 2
    prompts = [shared + f"Instruction {i}: list {i + 2} colours." for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, n=2, logprobs=1)
    kw = dict(num_blocks=24, block_size=16, enable_prefix_caching=True,
              max_num_batched_tokens=48, preemption_mode="swap", swap_space=0.01)
    runs = {}
    for name in ("cpu", "ascend"):
        ctx = ascend_backend_with_standins() if name == "ascend" else contextlib.nullcontext()
        with ctx:
            llm = LLM(tiny_model_dir, **kw)
        assert llm.engine.runner.backend.name == name
        runs[name] = llm.generate(prompts, params)
        stats = llm.engine.get_stats()
        assert stats.prefix_cache_hit_rate > 0
        assert stats.num_preemptions > 0, "the pool was meant to force a swap"
    for ref, got in zip(runs["cpu"], runs["ascend"]):
        for r, g in zip(ref.outputs, got.outputs):
            assert g.token_ids == r.token_ids
            lp_r = [d[t].logprob for t, d in zip(r.token_ids, r.logprobs)]
            lp_g = [d[t].logprob for t, d in zip(g.token_ids, g.logprobs)]
            np.testing.assert_allclose(lp_g, lp_r, atol=2e-2)
