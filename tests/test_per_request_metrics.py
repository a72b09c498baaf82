"""vLLM 0.32's per-request ``metrics`` in completion and chat answers, over a real server and
the openai client: --enable-per-request-metrics' timings, checked against the client's own
clock and the answer's usage, and --per-request-spec-decode-metrics' draft acceptance,
checked against /metrics' spec_decode counters; only for one prompt's one sequence, as vLLM.
"""
from __future__ import annotations

import json
import time

import numpy as np
import openai
import pytest
import requests

from conftest import metric
from llm_serving import cli
from llm_serving.cli import build_parser, server_settings
from llm_serving.errors import ConfigError
from test_http_server import free_port, start_server, stop_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
TIMINGS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
           "tokens_per_second")


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_model_dir):
    proc, url, _ = start_server(
        tmp_path_factory.mktemp("prm"), tiny_model_dir, "--enable-per-request-metrics",
        "--speculative-config", json.dumps(SPEC), "--per-request-spec-decode-metrics",
        "detailed", agent_ports=(free_port(),))
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def _prompt(seed: int) -> list[int]:
    """A random phrase repeated: the tiny random model tends to continue it, so some drafts
    are accepted."""
    phrase = np.random.default_rng(seed).integers(3, 1000, 7).tolist()
    return phrase * 3


def check_timings(m: dict, tokens: int, elapsed_ms: float) -> None:
    """vLLM's definitions, against each other, the answer's token count and the time the
    client waited for the whole answer."""
    assert all(m[k] >= 0 for k in TIMINGS), m
    assert m["mean_itl_ms"] * (tokens - 1) == pytest.approx(m["generation_time_ms"])
    assert m["tokens_per_second"] == pytest.approx(
        tokens * 1000 / (m["time_to_first_token_ms"] + m["generation_time_ms"]))
    assert m["queue_time_ms"] + m["time_to_first_token_ms"] + m["generation_time_ms"] \
        <= elapsed_ms
    assert m["time_to_first_token_ms"] > 0 and m["generation_time_ms"] > 0


def check_spec(spec: dict, tokens: int, drafted: bool = True) -> None:
    """The draft acceptance's fields agree with each other and with the tokens generated:
    each verify step gave its accepted drafts and one token more, every other step one.
    ``drafted``: the request had drafts (a random model's output rarely repeats a token, and
    then has none)."""
    steps, accepted = spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
    hist = spec["acceptance_histogram"]
    assert spec["num_spec_tokens"] == SPEC["num_speculative_tokens"] == len(hist) - 1
    if not drafted and not steps:
        assert spec == {"mean_acceptance_length": 1.0, "draft_acceptance_rate": 0.0,
                        "acceptance_histogram": [0] * len(hist), "num_spec_steps": 0,
                        "num_accepted_draft_tokens": 0, "num_draft_tokens": 0,
                        "num_spec_tokens": SPEC["num_speculative_tokens"]}
        return
    assert sum(hist) == steps == len(spec["per_step_accepted"]) > 0
    assert hist == [spec["per_step_accepted"].count(j) for j in range(len(hist))]
    assert sum(spec["per_step_accepted"]) == accepted
    assert sum(spec["per_step_drafted"]) == spec["num_draft_tokens"] >= accepted
    assert all(a <= d <= SPEC["num_speculative_tokens"]
               for a, d in zip(spec["per_step_accepted"], spec["per_step_drafted"]))
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
    assert 1 + steps + accepted <= tokens


def spec_counters(url: str) -> tuple:
    return tuple(metric(url, f"spec_decode_{name}_total")
                 for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))


def test_an_answer_carries_its_timings_and_draft_acceptance(url, client):
    model = client.models.list().data[0].id
    before = spec_counters(url)
    t0 = time.perf_counter()
    r = client.completions.create(model=model, prompt=_prompt(0), max_tokens=40,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    elapsed = (time.perf_counter() - t0) * 1000
    m = r.model_extra["metrics"]
    check_timings(m, r.usage.completion_tokens, elapsed)
    spec = m["speculative_decoding"]
    check_spec(spec, r.usage.completion_tokens)
    assert spec["num_accepted_draft_tokens"] > 0
    # the engine's own counters moved by this request's acceptance, no more, no less
    after = spec_counters(url)
    assert [a - b for a, b in zip(after, before)] == [
        spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]]

    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, max_tokens=12, temperature=0.0,
                                       messages=[{"role": "user", "content": "Hello there"}],
                                       extra_body={"ignore_eos": True})
    elapsed = (time.perf_counter() - t0) * 1000
    m = r.model_extra["metrics"]
    check_timings(m, r.usage.completion_tokens, elapsed)
    assert set(m) == {*TIMINGS, "speculative_decoding"}
    # one token: no inter-token latency, null as vLLM's
    r = client.completions.create(model=model, prompt="Hi", max_tokens=1)
    m = r.model_extra["metrics"]
    assert m["mean_itl_ms"] is None and m["generation_time_ms"] == 0
    assert m["tokens_per_second"] == pytest.approx(1000 / m["time_to_first_token_ms"])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_carries_them_on_its_final_usage_chunk(url, client, route):
    model = client.models.list().data[0].id
    kw = dict(model=model, max_tokens=24, temperature=0.0, stream=True,
              extra_body={"ignore_eos": True})
    if route == "chat":
        create = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": "Hello there"}]
    else:
        create, kw["prompt"] = client.completions.create, _prompt(0)
    t0 = time.perf_counter()
    first_token, chunks = None, []
    for c in create(stream_options={"include_usage": True}, **kw):
        if first_token is None and c.choices and (
                getattr(c.choices[0], "text", None) or
                getattr(getattr(c.choices[0], "delta", None), "content", None)):
            first_token = (time.perf_counter() - t0) * 1000
        chunks.append(c)
    elapsed = (time.perf_counter() - t0) * 1000
    *body, last = chunks
    assert not last.choices and all((c.model_extra or {}).get("metrics") is None for c in body)
    m = last.model_extra["metrics"]
    tokens = last.usage.completion_tokens
    check_timings(m, tokens, elapsed)
    # the client saw the first token after the engine made it
    assert m["queue_time_ms"] + m["time_to_first_token_ms"] <= first_token
    check_spec(m["speculative_decoding"], tokens, drafted=route == "completions")
    # no usage asked for: no usage chunk, so no metrics (as vLLM)
    assert all((c.model_extra or {}).get("metrics") is None for c in create(**kw))


def test_no_metrics_for_several_sequences_or_prompts(url, client):
    """Timings of n > 1 sequences or of several prompts are no one stream's: null in the
    answer and left out of a stream's usage chunk, as vLLM."""
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, n=2)
    assert len(r.choices) == 2 and r.model_extra["metrics"] is None
    r = client.completions.create(model=model, prompt=["Hello", "Hi"], max_tokens=4)
    assert len(r.choices) == 2 and r.model_extra["metrics"] is None
    r = client.chat.completions.create(model=model, n=2, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert len(r.choices) == 2 and r.model_extra["metrics"] is None
    chunks = list(client.chat.completions.create(
        model=model, n=2, max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Hello"}]))
    assert chunks[-1].usage.completion_tokens == 8
    assert all((c.model_extra or {}).get("metrics") is None for c in chunks)
    # raw JSON: the key is there, null
    body = requests.post(url + "/v1/completions", json={"model": model, "prompt": "Hello",
                                                         "max_tokens": 2, "n": 2}).json()
    assert "metrics" in body and body["metrics"] is None


def _settings(model, *flags):
    return server_settings(build_parser().parse_args(["serve", "--model", model, *flags]))[0]


def test_the_flags_are_checked_as_vllm_checks_them(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", tiny_model_dir, "--port", str(free_port()),
                  "--enable-per-request-metrics", "--disable-log-stats"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--enable-per-request-metrics" in err and "--disable-log-stats" in err
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--per-request-spec-decode-metrics", "summary")
    assert e.value.key == "per_request_spec_decode_metrics" and "speculative" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--speculative-config", json.dumps(SPEC),
                  "--per-request-spec-decode-metrics", "all")
    assert e.value.key == "per_request_spec_decode_metrics" and "'all'" in str(e.value)
    args = _settings(tiny_model_dir, "--speculative-config", json.dumps(SPEC),
                     "--per-request-spec-decode-metrics", "summary")
    assert args.per_request_spec_decode_metrics == "summary"


def test_offline_outputs_carry_the_draft_acceptance(tiny_model_dir):
    """LLM(..., per_request_spec_decode_metrics=...): each finished sequence's
    CompletionOutput.spec_decode_metrics, as vLLM's, adding up to the engine's counters."""
    from llm_serving import LLM, SamplingParams
    llm = LLM(tiny_model_dir, num_blocks=256, speculative_config=SPEC,
              per_request_spec_decode_metrics="summary")
    outs = llm.generate([{"prompt_token_ids": _prompt(s)} for s in range(3)],
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    specs = [o.outputs[0].spec_decode_metrics.to_dict() for o in outs]
    for spec, o in zip(specs, outs):
        assert spec["per_step_accepted"] is None     # summary
        assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
        assert 1 + spec["num_spec_steps"] + spec["num_accepted_draft_tokens"] <= 40
    stats = llm.engine.get_stats()
    assert sum(s["num_spec_steps"] for s in specs) == stats.spec_decode_num_drafts > 0
    assert sum(s["num_draft_tokens"] for s in specs) == stats.spec_decode_num_draft_tokens
    assert sum(s["num_accepted_draft_tokens"] for s in specs) == \
        stats.spec_decode_num_accepted_tokens
