"""Beam search (vLLM's LLM.beam_search and use_beam_search on the OpenAI routes) against
transformers' beam search on the same weights, the end-of-sequence rules against vLLM's
definition, and what a request may not combine with it."""
from __future__ import annotations

import numpy as np
import pytest
import requests

from llm_serving import BeamSearchParams
from llm_serving.entrypoints.beam_search import BeamSearch
from llm_serving.outputs import Logprob
from test_http_server import start_server, stop_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WIDTH, NEW = 3, 6


@pytest.fixture(scope="module")
def hf_beams(tiny_model_dir):
    """Prompts and transformers' WIDTH best beams of NEW tokens for each (no EOS stop)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32).eval()
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (4, 19, 40)]
    beams = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, num_beams=WIDTH, num_return_sequences=WIDTH,
                                 max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0,
                                 eos_token_id=None, length_penalty=1.0,
                                 output_scores=True, return_dict_in_generate=True)
            beams.append(([s[len(p):].tolist() for s in out.sequences],
                          (out.sequences_scores * NEW).tolist()))
    return prompts, beams


def test_llm_beam_search_gives_transformers_beams(tiny_llm, hf_beams):
    prompts, ref = hf_beams
    outs = tiny_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                BeamSearchParams(beam_width=WIDTH, max_tokens=NEW,
                                                 ignore_eos=True))
    for p, out, (ref_ids, ref_sums) in zip(prompts, outs, ref):
        assert [b.tokens[len(p):] for b in out.sequences] == ref_ids
        assert all(b.tokens[:len(p)] == p for b in out.sequences)
        np.testing.assert_allclose([b.cum_logprob for b in out.sequences], ref_sums,
                                   atol=1e-3, rtol=0)
        assert all(b.text == tiny_llm.tokenizer.decode(b.tokens, skip_special_tokens=True)
                   for b in out.sequences)
    # grouped two prompts at a time, the same answer
    again = tiny_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                 BeamSearchParams(beam_width=WIDTH, max_tokens=NEW,
                                                  ignore_eos=True), concurrency_limit=2)
    assert [[b.tokens for b in o.sequences] for o in again] == \
        [[b.tokens for b in o.sequences] for o in outs]


def _lps(**by_token) -> dict:
    return {int(t[1:]): Logprob(v) for t, v in by_token.items()}


def test_end_of_sequence_finishes_a_hypothesis_scored_without_it():
    """vLLM's rules: an EOS candidate is a finished hypothesis ("stop"); the rest continue;
    at the end all are ranked by cum_logprob / length ** length_penalty, the length counting
    the prompt and not a final EOS; returned text leaves the EOS out unless
    include_stop_str_in_output."""
    eos = 2
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    s = BeamSearch([7, 8], params, eos, max_model_len=100)
    s.advance([_lps(t2=-0.5, t5=-1.0, t6=-2.0)])        # EOS is the best first token
    assert [b.tokens for b in s.beams] == [[7, 8, 5], [7, 8, 6]]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in s.finished] == \
        [([7, 8, 2], "stop", eos)]
    s.advance([_lps(t9=-0.2, t2=-0.1), _lps(t9=-0.1)])
    assert s.done and [b.tokens for b in s.beams] == [[7, 8, 5, 9], [7, 8, 6, 9]]
    best = s.best()
    # scores: [7,8,2] -0.5/2, [7,8,5,2] -1.1/3, [7,8,5,9] -1.2/4, [7,8,6,9] -2.1/4
    assert [b.tokens for b in best] == [[7, 8, 2], [7, 8, 5, 9]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert s.generated(best[0]) == [] and s.generated(best[1]) == [5, 9]
    # a length penalty of 0 ranks by cum_logprob alone: the longer one now loses less
    flat = BeamSearch([7, 8], BeamSearchParams(2, 2, length_penalty=0.0), eos, 100)
    flat.finished, flat.beams = s.finished, s.beams
    assert [b.tokens for b in flat.best()] == [[7, 8, 2], [7, 8, 5, 2]]
    assert s.text_tokens(best[0]) == [] and s.text_tokens(best[1]) == [5, 9]
    keep = BeamSearch([7, 8], BeamSearchParams(2, 2, include_stop_str_in_output=True), eos, 100)
    keep.advance([_lps(t2=-0.5, t5=-1.0)])
    assert keep.generated(keep.finished[0]) == [eos]
    assert keep.text_tokens(keep.finished[0]) == []       # in the ids, never in the text
    # ignore_eos: EOS is a token like any other, but (vLLM) not counted in the length
    free = BeamSearch([7], BeamSearchParams(2, 1, ignore_eos=True), eos, 100)
    free.advance([_lps(t2=-0.5, t5=-0.45)])
    assert not free.finished and [b.tokens for b in free.best()] == [[7, 5], [7, 2]]
    # a prompt that leaves only 3 tokens of the model's length: 3 steps at most
    assert BeamSearch(list(range(97)), params, eos, 100).max_tokens == 2
    assert BeamSearch(list(range(98)), BeamSearchParams(2, None), eos, 100).max_tokens == 2


@pytest.mark.parametrize("kw, name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, structured_outputs={"regex": "a+"}), "structured_outputs"),
    (dict(beam_width=2, max_tokens=4, watermarking=True), "watermarking")])
def test_bad_beam_search_params_name_the_field(kw, name):
    """vLLM's BeamSearchParams keywords are all taken (a script passing watermarking=False
    runs); what is not supported here is a ValueError naming it, not a TypeError."""
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**kw)
    BeamSearchParams(beam_width=2, max_tokens=4, watermarking=False, structured_outputs=None)


def test_use_beam_search_on_the_server_gives_transformers_beams(tmp_path, tiny_model_dir,
                                                                hf_beams):
    prompts, ref = hf_beams
    proc, url, _ = start_server(tmp_path, tiny_model_dir)
    try:
        r = requests.post(url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": prompts, "max_tokens": NEW, "n": WIDTH,
            "use_beam_search": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
        texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        assert texts == [tok.decode(ids, skip_special_tokens=True)
                         for ref_ids, _ in ref for ids in ref_ids]
        assert {c["finish_reason"] for c in body["choices"]} == {"length"}
        prompt_tokens, new_tokens = sum(map(len, prompts)), len(prompts) * WIDTH * NEW
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                                 "total_tokens": prompt_tokens + new_tokens}
        r = requests.post(url + "/v1/chat/completions", timeout=300, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": 2,
            "max_tokens": 4, "use_beam_search": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        for extra, field in (({"stream": True}, "stream"), ({"top_p": 0.5}, "top_p"),
                             ({"logprobs": 1}, "logprobs"), ({"n": 11}, "n"),
                             ({"stop": ["a"]}, "stop"),
                             ({"response_format": {"type": "json_object"}},
                              "response_format")):
            r = requests.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 3,
                "use_beam_search": True, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        # a normal request after all that is served as before
        r = requests.post(url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        assert stop_server(proc) == 0
