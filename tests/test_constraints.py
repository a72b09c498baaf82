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
