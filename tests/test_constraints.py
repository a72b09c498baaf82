"""Constraints in the engine and the sampler: grammar state per sequence under n > 1,
preemption (recompute and swap) and async scheduling, freed on abort and finish; logit_bias,
bans and token bitmasks in the sampler's batched path against a plain numpy reference."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.engine.llm_engine import LLMEngine
from llm_serving.executor.protocol import SamplingBatch
from llm_serving.sample.sampler import Sampler

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "n"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["a", "bb", "ccc"]}},
                         "n": {"type": "integer", "minimum": -5, "maximum": 500}}}
PROMPTS = ["Give three tips for staying healthy.", "What is the capital of France?",
           "Write a haiku about the sea.", "List five prime numbers:", "Hello", "Tell me"]


def _requests():
    params = []
    for i, _ in enumerate(PROMPTS):
        so = {"json": SCHEMA} if i % 2 == 0 else {"regex": "[a-z]{2,6}( [0-9]{1,3}){3}"}
        params.append(SamplingParams(temperature=1.0, seed=i, n=2 if i % 3 == 0 else 1,
                                     max_tokens=80, structured_outputs=so))
    return params


def _check(outs, params):
    for o, p in zip(outs, params):
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            if p.structured_outputs.json is not None:
                jsonschema.validate(json.loads(c.text), SCHEMA)
            else:
                assert len(c.text.split()) == 4


@pytest.mark.parametrize("kw", [
    dict(num_blocks=20, block_size=8, max_num_seqs=8, async_scheduling=True),
    dict(num_blocks=20, block_size=8, max_num_seqs=8, preemption_mode="swap",
         swap_space=0.01, async_scheduling=True),
], ids=["recompute", "swap"])
def test_grammar_state_survives_preemption_forks_and_async_scheduling(tiny_model_dir, kw):
    """Under a KV pool too small for the batch, constrained requests (n = 2 included) are
    preempted and resumed; each output still matches its grammar and is the same as with a
    large pool and no async scheduling (seeded rows do not depend on the batch)."""
    results = []
    for args in (kw, dict(num_blocks=256, block_size=16)):
        llm = LLM(tiny_model_dir, **args)
        params = _requests()
        outs = llm.generate(PROMPTS, params)
        _check(outs, params)
        results.append([[c.token_ids for c in o.outputs] for o in outs])
        if args is kw:
            assert llm.engine.get_stats().num_preemptions > 0
        assert llm.engine.constraints.num_matchers == 0
    assert results[0] == results[1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_the_grammar_state(tiny_model_dir, async_scheduling):
    engine = LLMEngine(EngineArgs(tiny_model_dir, num_blocks=64, block_size=8,
                                  async_scheduling=async_scheduling))
    ids = [engine.add_request(p, SamplingParams(n=2, max_tokens=200, ignore_eos=True,
                                                structured_outputs={"regex": "[a-z ]*"}))
           for p in PROMPTS[:3]]
    for _ in range(5):
        engine.step()
    assert engine.constraints.num_matchers == 6
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    assert engine.constraints.num_matchers == 0 and not engine.has_unfinished_requests()


def _reference(logits, bias, banned, allowed):
    """What a constrained row's logits are, written plainly."""
    x = logits.astype(np.float64).copy()
    for r, row in enumerate(x):
        for t, v in bias.get(r, {}).items():
            row[t] += v
        row[list(banned.get(r, ()))] = -np.inf
        if r in allowed:
            keep = np.zeros(row.size, bool)
            keep[list(allowed[r])] = True
            row[~keep] = -np.inf
    return x


def test_sampler_applies_bias_bans_and_bitmask_like_the_reference():
    rng = np.random.default_rng(0)
    b, v = 12, 333
    logits = rng.normal(size=(b, v)).astype(np.float32)
    bias = {r: {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(v, 5, replace=False)}
            for r in range(0, b, 2)}
    banned = {r: set(rng.choice(v, 20, replace=False).tolist()) for r in range(0, b, 3)}
    allowed = {r: set(rng.choice(v, 7, replace=False).tolist()) for r in (1, 4, 5, 9)}
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=r) for r in range(b)]
        batch = SamplingBatch.from_params(params, [[1]] * b, [[]] * b, None)
        batch.bias_rows = np.array([r for r in bias for _ in bias[r]], np.int32)
        batch.bias_ids = np.array([t for r in bias for t in bias[r]], np.int32)
        batch.bias_values = np.array([x for r in bias for x in bias[r].values()], np.float32)
        batch.banned_token_ids = [np.array(sorted(banned.get(r, ())), np.int64)
                                  for r in range(b)]
        rows = sorted(allowed)
        bits = np.zeros((len(rows), -(-v // 32) * 32), np.uint8)
        for i, r in enumerate(rows):
            bits[i, list(allowed[r])] = 1
        batch.mask_rows = np.array(rows, np.int32)
        batch.token_bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
        ref = _reference(logits, bias, banned, allowed)
        out = Sampler(0)(logits, batch)
        if temperature == 0.0:
            assert out.token_ids.tolist() == ref.argmax(axis=1).tolist()
        else:
            assert all(np.isfinite(ref[r, t]) for r, t in enumerate(out.token_ids))
        # logprobs stay the model's raw ones (vLLM's default).
        lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
        np.testing.assert_allclose(out.logprobs, logits[np.arange(b), out.token_ids] - lse,
                                   rtol=1e-5, atol=1e-5)


# ---- async scheduling: the mask of step N+1 is sent while its forward runs ------------------

def _mixed_requests():
    """Constrained and unconstrained requests in one batch: JSON schema (n = 2), regex,
    choice, bad words whose bans depend on the previous token (with allowed_token_ids, and
    with logit_bias only), plain seeded and greedy rows, and one long request to abort. Token
    85 is "q" in the tiny tokenizer: the bad word "qq" bans 85 right after 85."""
    so = dict
    return [
        SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=80,
                       structured_outputs=so(json=SCHEMA)),
        SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                       structured_outputs=so(regex="[a-z]{2,6}( [0-9]{1,3}){3}")),
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=so(choice=["red", "green", "blue"])),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True,
                       allowed_token_ids=[85, 86], bad_words=["qq"]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True,
                       logit_bias={85: 100, 86: 100}, bad_words=["qq"]),
        SamplingParams(temperature=1.0, seed=6, max_tokens=200, ignore_eos=True,
                       structured_outputs=so(regex="[a-z ]*")),
    ]


def _drive(engine, abort_at: int):
    """Run the mixed workload to the end, aborting the last request after ``abort_at``
    steps; the final outputs by request id."""
    prompts = PROMPTS + PROMPTS[:2]
    for i, p in enumerate(_mixed_requests()):
        engine.add_request(prompts[i], p, request_id=f"r{i}")
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == abort_at:
            finals["r7"] = engine.abort_request("r7")
    assert engine.constraints.num_matchers == 0
    assert engine.get_stats().kv_cache_usage == 0.0
    return {rid: [(c.token_ids, c.cumulative_logprob, c.finish_reason, c.text)
                  for c in o.outputs] for rid, o in finals.items()}


@pytest.mark.parametrize("backend, tp", [("uni", 1), ("mp", 1), ("mp", 2)],
                         ids=["in-process", "agent", "tp2"])
def test_async_masks_give_the_outputs_of_synchronous_scheduling(tiny_model_dir, backend, tp):
    """Under async scheduling, a step with grammar rows is no longer waited for: its mask
    follows after its forward. A mixed batch (n > 1, preemption, an abort) gives token for
    token what synchronous scheduling gives, in process, through the WorkAgent, and with two
    tensor-parallel agents (only rank 0 samples and waits for the mask)."""
    ref = _drive(LLMEngine(EngineArgs(tiny_model_dir, num_blocks=256, block_size=16,
                                      async_scheduling=False)), abort_at=12)
    engine = LLMEngine(EngineArgs(tiny_model_dir, num_blocks=24, block_size=8, max_num_seqs=8,
                                  async_scheduling=True, distributed_executor_backend=backend,
                                  tensor_parallel_size=tp))
    sent = []
    send_mask = engine.runner.send_mask
    engine.runner.send_mask = lambda mask: (sent.append(mask is not None), send_mask(mask))[1]
    try:
        got = _drive(engine, abort_at=12)
        assert engine.get_stats().num_preemptions > 0
        _mask_failure_is_recovered(engine)
    finally:
        engine.shutdown()
    assert sum(sent) > 20          # masks really went after the forward, most steps
    partial = got.pop("r7"), ref.pop("r7")
    # Token for token; logprobs to rounding (tensor parallelism sums in another order).
    assert {r: [(t, f, x) for t, _, f, x in c] for r, c in got.items()} == \
        {r: [(t, f, x) for t, _, f, x in c] for r, c in ref.items()}
    for r, c in ref.items():       # None where no logprob was asked for
        want, have = [lp for _, lp, _, _ in c], [lp for _, lp, _, _ in got[r]]
        assert [x is None for x in have] == [x is None for x in want], r
        assert [x for x in have if x is not None] == \
            pytest.approx([x for x in want if x is not None], rel=1e-5), r
    # The aborted request: what each run had generated is a prefix of the other's.
    (a, _, ra, _), (b, _, rb, _) = partial[0][0], partial[1][0]
    assert ra == rb == "abort" and a[:len(b)] == b[:len(a)]
    assert [len(got[r]) for r in ("r0", "r3")] == [2, 2]
    for _, _, reason, text in got["r0"]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert got["r1"][0][2] == "stop" and len(got["r1"][0][3].split()) == 4
    assert got["r2"][0][3] in ("red", "green", "blue")
    for rid in ("r5", "r6"):        # "qq" never generated, though 85 and 86 are all it picks
        toks = got[rid][0][0]
        assert set(toks) <= {85, 86} and 85 in toks
        assert all(not (x == 85 and y == 85) for x, y in zip(toks, toks[1:]))


def _mask_failure_is_recovered(engine):
    """A master that fails between a step's submit and its mask (here: the grammar raising)
    fails the requests; the step is collected unmasked rather than left waiting, and the
    runner serves the next request."""
    def broken():
        raise RuntimeError("grammar failed")
    p = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"regex": "[a-z]+"})
    engine.add_request("Hello", p, request_id="broken")
    engine.constraints.deferred_bitmask = broken
    with pytest.raises(RuntimeError, match="grammar failed"):
        for _ in range(10):
            engine.step()
    del engine.constraints.deferred_bitmask
    [out] = engine.fail_all("the step failed")
    assert out.finished and not engine.has_unfinished_requests()
    engine.add_request("Hello", p, request_id="after")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].text.isalpha()
