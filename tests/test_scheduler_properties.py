"""Property tests of the scheduler and block manager under random load, with no model.

A simulated KV cache stands in for the model: every computed position writes a fingerprint
of the sequence's tokens up to that position, and block moves (swap out/in, copy-on-write)
move fingerprints like the runner moves KV. Before each step, every scheduled sequence's
cached context must hold exactly its own fingerprints, which catches a wrong prefix-cache
hit, a missing copy-on-write, a lost swap or two sequences sharing a slot.
"""
from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_serving.config import CacheConfig, SchedulerConfig
from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.scheduler import Scheduler
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.errors import QueueFullError
from llm_serving.sampling_params import SamplingParams

MAX_STEPS = 4000


def fingerprints(tokens: list[int]) -> list[int]:
    out, h = [], 17
    for t in tokens:
        h = hash((h, t)) & 0x7FFFFFFF
        out.append(h)
    return out


class Sim:
    def __init__(self, cfg: dict, requests: list[dict], seed: int):
        self.cfg = cfg
        bs = cfg["block_size"]
        self.capacity = cfg["num_blocks"] * bs
        self.bm = BlockManager(CacheConfig(bs, cfg["num_blocks"], cfg["num_cpu_blocks"],
                                           cfg["prefix_caching"], cfg["watermark"]))
        self.clock = 0.0
        self.sch = Scheduler(SchedulerConfig(
            cfg["max_num_seqs"], cfg["budget"], cfg["chunked"], cfg["policy"],
            cfg["preemption_mode"], cfg["max_waiting"], cfg["queue_timeout"],
            async_scheduling=False, long_prefill_cap=cfg.get("long_prefill_cap", 0),
            long_prefill_adaptive=cfg.get("adaptive", False),
            reserve_full_prompt=cfg.get("full_isl", True),
            max_num_scheduled_tokens=cfg.get("scheduled"), max_num_active_seqs=cfg.get("active")),
            self.bm, clock=lambda: self.clock)
        self.kv = np.full((cfg["num_blocks"], bs), -1, np.int64)
        self.host = np.full((max(cfg["num_cpu_blocks"], 1), bs), -1, np.int64)
        self.requests = requests
        self.rng = random.Random(seed)
        self.groups: dict[int, list[Sequence]] = {}
        self.ended: dict[int, str] = {}       # request -> how it ended
        self.refused = 0
        self.order = 0

    def live(self) -> list[Sequence]:
        return [s for seqs in self.groups.values() for s in seqs if not s.status.finished]

    def add(self, i: int, r: dict) -> None:
        prompt = r["prompt"][: self.capacity - 1]
        max_tokens = min(r["max_tokens"], self.capacity - len(prompt))
        params = SamplingParams(n=r["n"], max_tokens=max_tokens)
        seqs = [Sequence(str(i), k, None, prompt, params, max_tokens, r["priority"], self.order,
                         arrival_time=self.clock) for k in range(r["n"])]
        self.order += 1
        seqs[0].pending_children = seqs[1:]
        try:
            self.sch.add(seqs[0])
        except QueueFullError:
            self.refused += 1
            self.ended[i] = "refused"
            return
        self.groups[i] = seqs

    def finish_group(self, i: int, status: SequenceStatus) -> None:
        for s in self.groups[i]:
            if not s.status.finished:
                self.sch.finish(s, status)
        self.ended[i] = status.value

    def check_context(self, seq: Sequence) -> None:
        bs = self.cfg["block_size"]
        fp = fingerprints(seq.token_ids(0, seq.num_computed_tokens))
        for p, want in enumerate(fp):
            got = self.kv[seq.block_table[p // bs], p % bs]
            assert got == want, f"seq {seq.request_id}.{seq.index} reads wrong KV at {p}"

    def step(self) -> None:
        cfg, bs = self.cfg, self.cfg["block_size"]
        sch = self.sch
        queued = len(sch.running) + len(sch.waiting) + len(sch.swapped)
        out = self.sch.schedule()
        # the only request (after this step's timeouts) is not capped; adaptive: the cap is at
        # least the step's budget shared among the queued requests
        queued -= len(out.timed_out)
        cap = cfg.get("long_prefill_cap", 0) if queued >= 2 else 0
        if cap and cfg.get("adaptive"):
            cap = max(cap, (cfg.get("scheduled") or cfg["budget"]) // queued)
        for seq in out.timed_out:
            assert seq.first_scheduled_time is None
            self.finish_group(int(seq.request_id), SequenceStatus.FINISHED_TIMEOUT)
        # The step plan respects the budget, the cap, and each sequence's tokens.
        assert out.total_tokens <= (cfg.get("scheduled") or cfg["budget"])
        assert len(self.sch.running) + self.sch.num_reserved <= (cfg.get("active")
                                                                 or cfg["max_num_seqs"])
        assert len(set(map(id, out.seqs))) == len(out.seqs)
        for seq, n in zip(out.seqs, out.num_tokens):
            assert seq.status is SequenceStatus.RUNNING
            assert 1 <= n <= seq.num_uncomputed_tokens
            assert not cap or n <= cap, "a prefill chunk above long_prefill_token_threshold"
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + n
            if not cfg["chunked"] and seq.num_computed_tokens == 0:
                assert n == seq.num_tokens        # whole prompts at once
        # The "runner": move blocks, check contexts, write this step's KV.
        for dev, host in out.swap_out:
            self.host[host] = self.kv[dev]
        for host, dev in out.swap_in:
            self.kv[dev] = self.host[host]
        for src, dst in out.copies:
            self.kv[dst] = self.kv[src]
        written = set()
        for seq, n in zip(out.seqs, out.num_tokens):
            self.check_context(seq)
            start = seq.num_computed_tokens
            fp = fingerprints(seq.token_ids(0, start + n))
            for p in range(start, start + n):
                slot = (seq.block_table[p // bs], p % bs)
                assert slot not in written, "two sequences write one KV slot"
                written.add(slot)
                self.kv[slot] = fp[p]
        self.sch.after_step(out)
        # Sampling, forks and stops, as the engine does them.
        for seq in list(out.seqs):
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            group = [seq, *seq.pending_children]
            if seq.pending_children:
                self.sch.fork(seq)
            for s in group:
                s.output_token_ids.append(self.rng.randrange(3))
                if len(s.output_token_ids) >= s.max_tokens:
                    self.sch.finish(s, SequenceStatus.FINISHED_LENGTH)
            i = int(seq.request_id)
            if all(s.status.finished for s in self.groups[i]):
                self.ended[i] = "done"
        self.bm.check_invariants(self.live())

    def run(self, start: int = 0) -> None:
        for step in range(start, MAX_STEPS):
            self.clock = float(step)
            for i, r in enumerate(self.requests):
                if r["arrival"] == step:
                    self.add(i, r)
                if r["abort_at"] == step and i in self.groups and i not in self.ended:
                    self.finish_group(i, SequenceStatus.FINISHED_ABORTED)
                    self.bm.check_invariants(self.live())
            arrivals_left = any(r["arrival"] > step for r in self.requests)
            if not self.sch.has_unfinished() and not arrivals_left:
                return
            self.step()
        raise AssertionError(f"not finished after {MAX_STEPS} steps")


# Prompts are one of three shared stems plus a tail, so prefix-cache hits are likely.
stems = st.lists(st.integers(0, 3), min_size=0, max_size=12)
request = st.fixed_dictionaries({
    "arrival": st.integers(0, 30),
    "stem": st.integers(0, 2),
    "tail": st.lists(st.integers(0, 3), min_size=0, max_size=10),
    "max_tokens": st.integers(1, 8),
    "n": st.integers(1, 3),
    "priority": st.integers(0, 3),
    "abort_at": st.one_of(st.none(), st.integers(0, 40)),
})
config = st.fixed_dictionaries({
    "num_blocks": st.integers(4, 24),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_num_seqs": st.integers(3, 8),
    "budget": st.integers(1, 40),
    "chunked": st.booleans(),
    "prefix_caching": st.booleans(),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "num_cpu_blocks": st.integers(0, 24),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "watermark": st.sampled_from([0.0, 0.1]),
    "max_waiting": st.integers(1, 40),
    "queue_timeout": st.sampled_from([None, 5.0, 30.0]),
    "long_prefill_cap": st.sampled_from([0, 0, 1, 3, 8]),
    "adaptive": st.booleans(),          # vLLM's long_prefill_token_threshold_adaptive
    "full_isl": st.booleans(),          # vLLM's scheduler_reserve_full_isl
    # vLLM's max_num_scheduled_tokens and max_num_active_seqs (None: off)
    "scheduled": st.one_of(st.none(), st.integers(1, 40)),
    "active": st.one_of(st.none(), st.integers(1, 8)),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config, stem_list=st.lists(stems, min_size=3, max_size=3),
       reqs=st.lists(request, min_size=1, max_size=24), seed=st.integers(0, 2**16))
def test_random_load_keeps_invariants_and_every_request_ends(cfg, stem_list, reqs, seed):
    capacity = cfg["num_blocks"] * cfg["block_size"]
    if not cfg["chunked"]:
        cfg["budget"] = max(cfg["budget"], capacity)   # a whole prompt fits in one step
        cfg["long_prefill_cap"] = 0                    # a cap needs chunked prefill
        cfg["scheduled"] = None
    if cfg["scheduled"] is not None:       # the config refuses more than the budget
        cfg["scheduled"] = min(cfg["scheduled"], cfg["budget"])
    if cfg["active"] is not None:          # ... and more than max_num_seqs
        cfg["active"] = min(cfg["active"], cfg["max_num_seqs"])
    for r in reqs:
        r["n"] = min(r["n"], cfg["active"] or r["n"])   # a larger n is refused at once
        r["prompt"] = (stem_list[r["stem"]] + r["tail"]) or [1]
    sim = Sim(cfg, reqs, seed)
    sim.run()
    # Every request was refused, finished, aborted or timed out; nothing leaked.
    assert set(sim.ended) == set(range(len(reqs)))
    assert sim.live() == []
    assert sim.bm.num_free_blocks == cfg["num_blocks"]
    assert sim.bm.num_free_cpu_blocks == cfg["num_cpu_blocks"]
    assert all(c == 0 for c in sim.bm.ref_counts)
    if cfg["queue_timeout"] is None:
        assert "timeout" not in sim.ended.values()


def test_timeouts_only_hit_requests_that_never_started():
    cfg = dict(num_blocks=4, block_size=4, max_num_seqs=1, budget=64, chunked=True,
               prefix_caching=False, preemption_mode="recompute", num_cpu_blocks=0,
               policy="fcfs", watermark=0.0, max_waiting=10, queue_timeout=5.0)
    reqs = [dict(arrival=0, prompt=[1, 2, 3], max_tokens=8, n=1, priority=0, abort_at=None)
            for _ in range(3)]
    sim = Sim(cfg, reqs, 0)
    sim.run()
    # One sequence at a time, 8 steps each: the first runs, the others wait > 5 steps.
    assert sim.ended == {0: "done", 1: "timeout", 2: "timeout"}


def test_long_prefill_threshold_lets_short_prompts_in_beside_a_long_one():
    """vLLM's long_prefill_token_threshold: a 40-token prompt prefills 8 tokens a step while
    others are queued, so the two short prompts behind it start (and get their first token)
    in the first step instead of after it; the long prompt alone gets the whole budget."""
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=4, budget=32, chunked=True,
               prefix_caching=False, preemption_mode="recompute", num_cpu_blocks=0,
               policy="fcfs", watermark=0.0, max_waiting=10, queue_timeout=None,
               long_prefill_cap=8)
    reqs = [dict(arrival=0, prompt=list(range(1, 41)), max_tokens=2, n=1, priority=0,
                 abort_at=None)] + [
            dict(arrival=0, prompt=[5, 6, 7], max_tokens=2, n=1, priority=0, abort_at=None)
            for _ in range(2)]
    sim = Sim(cfg, reqs, 0)
    for i, r in enumerate(reqs):
        sim.add(i, r)
    out = sim.sch.schedule()
    assert [(int(s.request_id), n) for s, n in zip(out.seqs, out.num_tokens)] == \
        [(0, 8), (1, 3), (2, 3)]
    sim.sch.after_step(out)
    alone = Sim({**cfg, "long_prefill_cap": 8}, reqs[:1], 0)
    alone.add(0, reqs[0])
    out = alone.sch.schedule()
    assert out.num_tokens == [32]
    without = Sim({**cfg, "long_prefill_cap": 0}, reqs, 0)
    for i, r in enumerate(reqs):
        without.add(i, r)
    assert without.sch.schedule().num_tokens == [32]   # the long prompt took the budget



def test_adaptive_long_prefill_threshold_is_at_least_the_budgets_fair_share():
    """vLLM 0.32's long_prefill_token_threshold_adaptive: with a threshold of 4, three long
    prompts queued and a budget of 32, each prefills 32 // 3 = 10 tokens a step, not 4."""
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=4, budget=32, chunked=True,
               prefix_caching=False, preemption_mode="recompute", num_cpu_blocks=0,
               policy="fcfs", watermark=0.0, max_waiting=10, queue_timeout=None,
               long_prefill_cap=4)
    reqs = [dict(arrival=0, prompt=list(range(1, 41)), max_tokens=2, n=1, priority=0,
                 abort_at=None) for _ in range(3)]
    for adaptive, chunks in ((True, [10, 10, 10]), (False, [4, 4, 4])):
        sim = Sim({**cfg, "adaptive": adaptive}, reqs, 0)
        for i, r in enumerate(reqs):
            sim.add(i, r)
        assert sim.sch.schedule().num_tokens == chunks


def test_full_prompt_reservation_admits_a_chunked_prompt_only_when_all_of_it_fits():
    """vLLM 0.32's scheduler_reserve_full_isl (on by default): in a pool of 8 blocks of 4,
    a 28-token prompt waits while an 8-token request decodes in 3 blocks (its first 7-token
    chunk would fit, the whole prompt would not), and starts once that one is done: no
    preemption. Admitted on its first chunk instead, it is preempted and prefilled again."""
    cfg = dict(num_blocks=8, block_size=4, max_num_seqs=4, budget=8, chunked=True,
               prefix_caching=False, preemption_mode="recompute", num_cpu_blocks=0,
               policy="fcfs", watermark=0.0, max_waiting=10, queue_timeout=None)
    reqs = [dict(arrival=0, prompt=list(range(1, 9)), max_tokens=4, n=1, priority=0,
                 abort_at=None),
            dict(arrival=0, prompt=list(range(1, 29)), max_tokens=2, n=1, priority=0,
                 abort_at=None)]
    for full_isl, preempted in ((True, False), (False, True)):
        sim = Sim({**cfg, "full_isl": full_isl}, reqs, 0)
        started = {}
        for i, r in enumerate(reqs):
            sim.add(i, r)
        steps = 0
        while sim.sch.has_unfinished():
            sim.step()
            steps += 1
            for i, seqs in sim.groups.items():
                if seqs[0].first_scheduled_time is not None:
                    started.setdefault(i, steps)
        assert sorted(sim.ended.values()) == ["done", "done"]
        assert bool(sim.sch.num_preemptions) is preempted
        if full_isl:        # the long prompt started after the short request's 4 tokens
            assert started[1] > started[0] + 3

def test_full_waiting_queue_refuses_new_requests_at_once():
    cfg = dict(num_blocks=8, block_size=4, max_num_seqs=1, budget=64, chunked=True,
               prefix_caching=False, preemption_mode="recompute", num_cpu_blocks=0,
               policy="fcfs", watermark=0.0, max_waiting=2, queue_timeout=None)
    reqs = [dict(arrival=0, prompt=[1, 2], max_tokens=2, n=1, priority=0, abort_at=None)
            for _ in range(4)]
    sim = Sim(cfg, reqs, 0)
    sim.run()
    assert sim.refused == 2
    assert sorted(sim.ended.values()) == ["done", "done", "refused", "refused"]


def test_priority_request_preempts_a_worse_running_one():
    cfg = dict(num_blocks=4, block_size=4, max_num_seqs=1, budget=64, chunked=True,
               prefix_caching=False, preemption_mode="swap", num_cpu_blocks=4,
               policy="priority", watermark=0.0, max_waiting=10, queue_timeout=None)
    reqs = [dict(arrival=0, prompt=[1, 2, 3], max_tokens=6, n=1, priority=5, abort_at=None),
            dict(arrival=2, prompt=[3, 2, 1], max_tokens=2, n=1, priority=0, abort_at=None)]
    sim = Sim(cfg, reqs, 0)
    for step in range(3):            # the low-priority request is decoding when the other comes
        sim.clock = float(step)
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                sim.add(i, r)
        sim.step()
    low, high = sim.groups[0][0], sim.groups[1][0]
    assert low.status is SequenceStatus.SWAPPED and high.status is SequenceStatus.RUNNING
    assert sim.sch.num_swap_preemptions == 1
    sim.run(start=3)
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    assert len(low.output_token_ids) == 6 and len(high.output_token_ids) == 2


def test_prefix_cache_reuses_full_blocks_and_checks_tokens():
    bm = BlockManager(CacheConfig(block_size=4, num_blocks=8, num_cpu_blocks=0,
                                  enable_prefix_caching=True, watermark=0.01))
    params = SamplingParams(max_tokens=1)
    a = Sequence("a", 0, None, list(range(10)), params, 1)
    bm.admit(a, bm.match_prefix(a), a.num_tokens, [])
    a.num_computed_tokens = 10
    bm.register_computed(a)
    b = Sequence("b", 0, None, list(range(9)) + [99], params, 1)
    assert bm.match_prefix(b) == a.block_table[:2]          # two full blocks shared
    # A forged cache entry with the right hash but other tokens is not a hit.
    c = Sequence("c", 0, None, [7, 7, 7, 7, 1], params, 1)
    bm._ensure_hashes(c, 1)
    forged = a.block_table[0]
    bm.cache[c.block_hashes[0]] = forged
    bm.block_hash[forged] = c.block_hashes[0]
    assert bm.match_prefix(c) == []


def test_scheduled_tokens_and_active_seqs_cap_each_step_below_the_buffers():
    """vLLM's max_num_scheduled_tokens and max_num_active_seqs: with a budget of 64 tokens
    and 8 sequences, a step issues at most 10 tokens and runs at most 2 sequences; the
    others wait (no preemption) and every request still finishes."""
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, chunked=True,
               prefix_caching=False, preemption_mode="recompute", num_cpu_blocks=0,
               policy="fcfs", watermark=0.0, max_waiting=10, queue_timeout=None,
               scheduled=10, active=2)
    reqs = [dict(arrival=0, prompt=list(range(1, 13)), max_tokens=4, n=1, priority=0,
                 abort_at=None) for _ in range(4)] + [
            dict(arrival=0, prompt=[5, 6, 7], max_tokens=3, n=2, priority=0, abort_at=None)]
    sim = Sim(cfg, reqs, 0)
    for i, r in enumerate(reqs):
        sim.add(i, r)
    plans, schedule = [], sim.sch.schedule
    sim.sch.schedule = lambda: plans.append(schedule()) or plans[-1]
    most_running = 0
    while sim.sch.has_unfinished():
        sim.step()          # asserts each step's tokens <= 10 and running <= 2
        most_running = max(most_running, len(sim.sch.running) + sim.sch.num_reserved)
    assert plans[0].num_tokens == [10]     # the first prompt's chunk: the step's 10 tokens
    assert max(p.total_tokens for p in plans) == 10
    assert most_running == 2 and not sim.sch.num_preemptions
    assert sorted(sim.ended.values()) == ["done"] * 5
    uncapped = Sim({**cfg, "scheduled": None, "active": None}, reqs, 0)
    for i, r in enumerate(reqs):
        uncapped.add(i, r)
    out = uncapped.sch.schedule()
    assert out.total_tokens == 12 * 4 + 3 and len(uncapped.sch.running) == 5
