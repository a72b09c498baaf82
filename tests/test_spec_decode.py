"""Speculative decoding with n-gram drafts (--speculative-config '{"method": "ngram", ...}'):
the output must be what decoding without drafts gives, token for token (greedy, and seeded
random sampling, whose per-position draws do not depend on the drafts), while drafts are
actually proposed and accepted; and the KV blocks of rejected drafts never leak or enter the
prefix cache.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import hf_causal_lm
from llm_serving import LLM, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.engine.llm_engine import LLMEngine
from llm_serving.errors import ConfigError

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2}


def _repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, of different lengths (the tiny random model
    tends to continue such a pattern, so drafts get accepted)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        phrase = rng.integers(3, 1000, 6 + i % 7).tolist()
        out.append(phrase * (2 + i % 4) + phrase[:i % 5])
    return out


def _run(model_dir, prompts, params, staggered=True, **engine_args):
    """Run requests through an LLMEngine (one more arriving each step when staggered, so
    prefills run beside decodes); the outputs by request, the engine, and per step whether it
    mixed a prefill chunk with a decode that has drafts."""
    engine = LLMEngine(EngineArgs(model=model_dir, **engine_args))
    params = params if isinstance(params, list) else [params] * len(prompts)
    pending = list(enumerate(zip(prompts, params)))
    outs, mixed = {}, []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        drafting = any(s.draft_token_ids for s in plan.seqs)
        prefill = any(s.num_computed_tokens < len(s.prompt_token_ids) for s in plan.seqs)
        mixed.append(drafting and prefill)
        return plan

    engine.scheduler.schedule = recording_schedule
    while pending or engine.has_unfinished_requests():
        for _ in range(1 if staggered else len(pending)):
            if pending:
                i, (p, sp) = pending.pop(0)
                engine.add_request({"prompt_token_ids": p}, sp, request_id=str(i))
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id)] = o.outputs[0]
        engine.block_manager.check_invariants(
            [s for r in engine.requests.values() for s in r.seqs if not s.status.finished])
    return [outs[i] for i in range(len(prompts))], engine, mixed


def _check_cache_holds_only_known_tokens(engine, prompts, outs):
    """Every block in the prefix cache holds block-aligned tokens of some request's prompt
    and output (never a rejected draft)."""
    bs = engine.block_manager.block_size
    known = set()
    for p, o in zip(prompts, outs):
        toks = p + list(o.token_ids)
        known.update(tuple(toks[i:i + bs]) for i in range(0, len(toks) - bs + 1, bs))
    bm = engine.block_manager
    for block in bm.cache.values():
        assert bm.block_tokens[block] in known


SETTINGS = {
    "default": dict(num_blocks=256, block_size=16),
    "chunked, prefix cache, block 4": dict(num_blocks=512, block_size=4,
                                           max_num_batched_tokens=24,
                                           enable_prefix_caching=True),
    "preempt-recompute": dict(num_blocks=36, block_size=4, preemption_mode="recompute"),
    "preempt-swap": dict(num_blocks=36, block_size=4, preemption_mode="swap",
                         swap_space=0.01),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_output_is_unchanged_and_drafts_are_accepted(tiny_model_dir, setting):
    prompts = _repetitive_prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref, _, _ = _run(tiny_model_dir, prompts, params, **SETTINGS[setting])
    got, engine, mixed = _run(tiny_model_dir, prompts, params, speculative_config=SPEC,
                              **SETTINGS[setting])
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]
    st = engine.get_stats()
    assert st.spec_decode_num_accepted_tokens > 0
    assert st.spec_decode_num_draft_tokens > st.spec_decode_num_accepted_tokens  # some rejected
    if "preempt" not in setting:     # (with a pool this small, drafts mostly give way)
        assert any(mixed), "no step mixed a prefill chunk with a decode that has drafts"
    assert st.num_generation_tokens == 40 * len(prompts)
    assert all(b == 0 for b in engine.block_manager.ref_counts)    # nothing leaked
    if engine.block_manager.enable_prefix_caching:
        _check_cache_holds_only_known_tokens(engine, prompts, got)
    if "preempt" in setting:
        assert st.num_preemptions > 0


def test_n_and_tensor_parallel(tiny_model_dir):
    """n > 1 (greedy and seeded), and two tensor-parallel WorkAgents: the same outputs."""
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(6)]
    params = [SamplingParams(n=2, temperature=0.0 if i % 2 else 0.4, top_k=4, seed=i,
                             max_tokens=30, ignore_eos=True) for i in range(6)]
    kw = dict(num_blocks=256, block_size=4)

    def run(**extra):
        llm = LLM(tiny_model_dir, **kw, **extra)
        outs = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        return outs, llm.engine.get_stats()

    ref, _ = run()
    got, st = run(speculative_config=SPEC)
    assert got == ref and st.spec_decode_num_accepted_tokens > 0
    got, st = run(speculative_config=SPEC, tensor_parallel_size=2)
    assert got == ref and st.spec_decode_num_accepted_tokens > 0


def test_greedy_matches_transformers_generate(tiny_model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32).eval()
    prompts = _repetitive_prompts(6)
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                 min_new_tokens=24, pad_token_id=0)
            want.append(ids[0, len(p):].tolist())
    got, engine, _ = _run(tiny_model_dir, prompts,
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                          staggered=False, num_blocks=256, speculative_config=SPEC)
    assert [list(o.token_ids) for o in got] == want
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_seeded_sampling_is_unchanged(tiny_model_dir):
    """A seeded row draws the same uniform at the same output position with or without
    drafts, so the target's sample at each draft's row is the token decoding would sample
    there: verification by exact match is vLLM's rejection sampling for one-hot drafts
    (accept with probability p(draft), else a sample of p without the draft), and here it
    reproduces the output without drafts exactly, penalties and top-k/top-p included."""
    prompts = _repetitive_prompts(8, seed=5)
    params = [SamplingParams(temperature=0.3, top_p=0.95, top_k=5, seed=100 + i,
                             repetition_penalty=1.05, frequency_penalty=0.1, max_tokens=32,
                             ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    ref, _, _ = _run(tiny_model_dir, prompts, params, num_blocks=256)
    got, engine, _ = _run(tiny_model_dir, prompts, params, num_blocks=256,
                          speculative_config=SPEC)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):          # each token's logprobs from its own row
        assert [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs]
        np.testing.assert_allclose([d[t].logprob for d, t in zip(a.logprobs, a.token_ids)],
                                   [d[t].logprob for d, t in zip(b.logprobs, b.token_ids)],
                                   rtol=1e-4, atol=1e-5)
    st = engine.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens


def test_accepted_drafts_follow_the_target_distribution(tiny_model_dir):
    """Many seeded three-token requests on one prompt (top-k 8). The prompt holds the likeliest
    first token t1 once, followed by x, the likeliest token after the prompt and t1: so after
    t1, x is drafted (prompt_lookup_min 1) and is accepted about a quarter of the time. The
    second tokens of the requests that began with t1 are distributed as the target's top-8
    distribution (chi-square against transformers' probabilities), the draft's share too."""
    probs = _target_probs(tiny_model_dir)
    rng = np.random.default_rng(11)
    rest = rng.permutation(np.arange(3, 1000))[:400].tolist()
    t1 = int(np.argmax(probs(rest)))
    rest.remove(t1) if t1 in rest else None
    x = None
    for _ in range(4):          # x: the likeliest token after the prompt (holding t1, x) + t1
        prompt = rest[:50] + [t1] + ([x] if x is not None else []) + rest[50:]
        best = int(np.argmax(probs(prompt + [t1])))
        if best == x:
            break
        x = best
    assert best == x and t1 not in prompt[52:]
    target = probs(prompt + [t1])
    assert 0.05 < target[x] < 0.95 and probs(prompt)[t1] > 0.2

    llm = LLM(tiny_model_dir, num_blocks=512, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1,
        "prompt_lookup_min": 1})
    n = 3000
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(temperature=1.0, top_k=8, max_tokens=3, seed=i,
                                        ignore_eos=True) for i in range(n)])
    seconds = np.asarray([o.outputs[0].token_ids[1] for o in outs
                          if o.outputs[0].token_ids[0] == t1])
    assert len(seconds) > 500
    st = llm.engine.get_stats()
    assert st.spec_decode_num_drafts >= len(seconds)
    assert st.spec_decode_num_accepted_tokens >= 0.15 * len(seconds)
    counts = np.bincount(seconds, minlength=len(target))
    share, m = counts[x] / len(seconds), len(seconds)
    assert abs(share - target[x]) < 4 * np.sqrt(target[x] * (1 - target[x]) / m)
    _chi_square_ok(counts, target)


def _target_probs(model_dir, top_k=8):
    """ctx -> transformers' top-k distribution of the token after ctx (float64 [V])."""
    model = hf_causal_lm(model_dir)
    import torch

    def probs(ctx):
        with torch.no_grad():
            logits = model(torch.tensor([ctx])).logits[0, -1].double()
        keep = torch.topk(logits, top_k).indices
        prob = torch.zeros_like(logits)
        prob[keep] = torch.softmax(logits[keep], -1)
        return prob.numpy()
    return probs


def _chi_square_ok(counts, prob):
    """Pearson's chi-square over the tokens with an expected count >= 5 (the rest pooled),
    below the 99.9% quantile (Wilson-Hilferty approximation)."""
    n = counts.sum()
    expected = prob * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit, dof)


def test_stops_are_exact(tiny_model_dir):
    """Stop strings, stop ids, max_tokens and min_tokens cut the accepted tokens where
    decoding without drafts stops."""
    prompts = _repetitive_prompts(6, seed=9)
    base, _, _ = _run(tiny_model_dir, prompts,
                      SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                      num_blocks=256)
    params = []
    for i, o in enumerate(base):
        toks = list(o.token_ids)
        if i % 3 == 0:          # a stop string out of the middle of the output
            params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                         stop=[o.text[len(o.text) // 2:][:3]]))
        elif i % 3 == 1:        # a stop id, after min_tokens
            params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                         stop_token_ids=[toks[10]], min_tokens=5))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True))
    ref, _, _ = _run(tiny_model_dir, prompts, params, num_blocks=256)
    got, engine, _ = _run(tiny_model_dir, prompts, params, num_blocks=256,
                          speculative_config=SPEC)
    for a, b in zip(got, ref):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason)
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert [len(o.token_ids) for o in got[2::3]] == [13, 13]


@pytest.mark.parametrize("spec, key", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"model": "some/draft", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
])
def test_other_methods_and_bad_keys_are_refused(tiny_model_dir, spec, key):
    with pytest.raises(ConfigError) as e:
        EngineArgs(model=tiny_model_dir, speculative_config=spec)
    assert e.value.key == key
    if spec.get("method") == "eagle":
        assert "'eagle'" in str(e.value)


def test_async_scheduling_is_refused_with_it(tiny_model_dir):
    with pytest.raises(ConfigError) as e:
        EngineArgs(model=tiny_model_dir, speculative_config=SPEC, async_scheduling=True)
    assert e.value.key == "async_scheduling" and "speculative_config" in str(e.value)
    config = EngineArgs(model=tiny_model_dir, speculative_config=SPEC,
                        distributed_executor_backend="mp").create_engine_config()
    assert not config.scheduler.async_scheduling       # off by default with it, as vLLM
    assert config.speculative.prompt_lookup_max == 3


def test_proposer_takes_the_latest_longest_match():
    from llm_serving.engine.sequence import Sequence
    from llm_serving.spec_decode.config import SpeculativeConfig
    from llm_serving.spec_decode.ngram_proposer import NgramProposer
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3,
                                           prompt_lookup_min=1))
    seq = Sequence("r", 0, None, [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3], SamplingParams(), 10)
    # [2, 3] recurs at 1 and 6; [4, 2, 3] nowhere; the latest [2, 3] is followed by 7, 8, 4
    assert prop.propose(seq, 5) == [7, 8, 4]
    assert prop.propose(seq, 2) == [7, 8]
    seq.output_token_ids = [9]      # now ends [..., 3, 9]: [3, 9] recurs once, then 9, 1, 2
    assert prop.propose(seq, 5) == [9, 1, 2]
    seq.output_token_ids = [9, 6]   # 6 never seen before: no drafts
    assert prop.propose(seq, 5) == []


def test_yaml_key_and_cli_flag(tmp_path, tiny_model_dir):
    import argparse
    import json

    from llm_serving.cli_args import add_engine_arguments, cli_engine_overrides
    from llm_serving.serving_config import load_config
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  speculative_config:\n"
                   "    method: ngram\n    num_speculative_tokens: 3\n")
    kw = load_config(cfg).engine_kwargs
    spec = EngineArgs(**kw).create_engine_config().speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        (3, 5, 5)                                   # vLLM's defaults for the lookup
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(SPEC)])
    assert cli_engine_overrides(args)["speculative_config"] == SPEC


def _port() -> int:
    import os
    import socket
    if os.environ.get("LLM_SERVING_TEST_PORT"):
        return int(os.environ["LLM_SERVING_TEST_PORT"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_answers_the_openai_client_and_counts_drafts(tmp_path, tiny_model_dir):
    """A real server started with --speculative-config (WorkAgent through shared memory):
    greedy completions, streamed and not, are the offline engine's without drafts, and
    /metrics shows vLLM's spec_decode counters."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import openai
    import requests
    from conftest import metric
    from prometheus_client.parser import text_string_to_metric_families

    from llm_serving.cli_args import STOP_WITH_PARENT_ENV
    llm = LLM(tiny_model_dir, num_blocks=256)
    prompts = [llm.get_tokenizer().decode(p) for p in _repetitive_prompts(4)]
    ref = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32,
                                               ignore_eos=True))
    port = _port()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(root / "start.py"), "--model", tiny_model_dir, "--port",
         str(port), "--num-blocks", "256", "--speculative-config", json.dumps(SPEC)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, STOP_WITH_PARENT_ENV: str(os.getpid())})
    try:
        lines = []
        while True:
            line = proc.stdout.readline()
            lines.append(line)
            if "ready" in line or not line:
                break
        assert "ready" in line, "".join(lines[-20:])
        url = f"http://127.0.0.1:{port}"
        # vLLM's per-position series exist from the start, one per draft position, at 0 (a
        # dashboard's rate() over them, or their ratio to num_drafts, then reads 0, not
        # "no data", and counts the first acceptances)
        scrape = requests.get(url + "/metrics", timeout=10).text
        per_pos = {s.labels["position"]: s.value
                   for f in text_string_to_metric_families(scrape)
                   if f.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
                   for s in f.samples if s.name.endswith("_total")}
        assert per_pos == {str(p): 0.0 for p in range(SPEC["num_speculative_tokens"])}
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for p, want in zip(prompts, ref):
            kw = dict(model=model, prompt=p, max_tokens=32, temperature=0.0,
                      extra_body={"ignore_eos": True})
            got = client.completions.create(**kw).choices[0]
            assert got.text == want.outputs[0].text and got.finish_reason == "length"
            chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw)
                      if c.choices]
            assert "".join(chunks) == want.outputs[0].text
            # llm-serving's stream: a line per token, whatever a step accepted
            body = {"inputs": p, "parameters": {"max_new_tokens": 32, "ignore_eos": True,
                                                "return_full_text": True}}
            r = requests.post(url + "/models/llama2/generate_stream", json=body, timeout=120)
            *steps, full = [json.loads(line)["data"][0] for line in r.text.splitlines()]
            assert [s["tokens"]["id"] for s in steps] == list(want.outputs[0].token_ids)
            assert "".join(s["generated_text"] for s in steps) == want.outputs[0].text
            assert full["generated_tokens"] == len(steps) == 32
            assert full["generated_text"] == want.outputs[0].text
        assert metric(url, "spec_decode_num_accepted_tokens_total") > 0
        assert metric(url, "spec_decode_num_draft_tokens_total") >= \
            metric(url, "spec_decode_num_accepted_tokens_total")
        assert metric(url, "spec_decode_num_drafts_total") > 0
        # by position: the first draft is accepted at least as often as any later one
        per_pos = [metric(url, f'spec_decode_num_accepted_tokens_per_pos_total'
                          f'{{position="{p}"}}') for p in range(SPEC["num_speculative_tokens"])]
        assert per_pos[0] > 0 and per_pos == sorted(per_pos, reverse=True)
        assert sum(per_pos) == metric(url, "spec_decode_num_accepted_tokens_total")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_drafts_follow_vllms_batch_size_schedule(tiny_model_dir):
    """vLLM 0.32's num_speculative_tokens_per_batch_size: [first, last, k] batch-size ranges
    (a gap or the tail takes the range before it, k never above num_speculative_tokens); a
    schedule of no drafts beyond one running sequence drafts for a request alone and not for
    several, the outputs the same either way."""
    from llm_serving.spec_decode.config import SpeculativeConfig
    cfg = SpeculativeConfig.from_value({**SPEC, "num_speculative_tokens": 2,
                                        "num_speculative_tokens_per_batch_size":
                                            [[8, 16, 1], [1, 4, 3], [32, 64, 0]]})
    assert [cfg.drafts_for_batch(b) for b in (1, 4, 5, 8, 20, 32, 100)] == [2, 2, 2, 1, 1, 0, 0]
    for bad, said in (([[2, 8, 1]], "start at batch size 1"),
                      ([[1, 8, 1], [8, 9, 1]], "overlap"), ([[1, 8, -1]], "k >= 0"),
                      ([[1, 8]], "[first, last, k]"), ([], "non-empty")):
        with pytest.raises(ConfigError, match=r"per_batch_size.*" + re.escape(said)):
            SpeculativeConfig.from_value({**SPEC, "num_speculative_tokens_per_batch_size": bad})
    alone_only = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 1024, 0]]}
    prompts = _repetitive_prompts(4)
    # a bias makes every output one token over and over, which n-grams always match
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            logit_bias={7: 100.0})
    ref, _, _ = _run(tiny_model_dir, prompts, params, staggered=False)
    several, engine, _ = _run(tiny_model_dir, prompts, params, staggered=False,
                              speculative_config=alone_only, max_num_seqs=4)
    # the four run together to the end (same lengths): never alone, never a draft
    assert [o.token_ids for o in several] == [o.token_ids for o in ref]
    assert engine.get_stats().spec_decode_num_draft_tokens == 0
    alone, engine, _ = _run(tiny_model_dir, prompts[:1], params, speculative_config=alone_only)
    assert alone[0].token_ids == ref[0].token_ids
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0
