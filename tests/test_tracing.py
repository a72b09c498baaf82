"""vLLM's OpenTelemetry request tracing (--otlp-traces-endpoint): the real server sends one
llm_request span per request to an OTLP collector (tests/otlp_receiver.py, over http/protobuf),
parented to the client's traceparent, with vLLM's gen_ai.* attributes checked against what
the openai client was answered; a collector that is down costs the requests nothing; the
flags' checks; and LLM(...)'s spans."""
from __future__ import annotations

import json
import sys
import time

import openai
import pytest
import requests

from llm_serving.cli import build_parser, server_settings
from llm_serving.errors import ConfigError
from otlp_receiver import Receiver
from test_http_server import free_port, start_server, stop_server, wait_until

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVER_KIND = 2             # opentelemetry-proto's Span.SPAN_KIND_SERVER
ERROR_STATUS = 2            # Status.STATUS_CODE_ERROR
HTTP = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50"}      # the processor exports every 50 ms


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_model_dir, receiver):
    """A server tracing to ``receiver``, set in its YAML (the flags are checked below)."""
    proc, url, _ = start_server(
        tmp_path_factory.mktemp("traced"), tiny_model_dir, agent_ports=(free_port(),),
        env=HTTP, section=f"  otlp_traces_endpoint: {receiver.url}\n"
                          f"  collect_detailed_traces: [all]\n")
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


def span_of(receiver, request_id: str) -> dict:
    wait_until(lambda: any(s["attributes"]["gen_ai.request.id"] == request_id
                           for s in receiver.spans), 10, f"no span of {request_id}")
    found = [s for s in receiver.spans if s["attributes"]["gen_ai.request.id"] == request_id]
    assert len(found) == 1, found
    return found[0]


def check_timings(span: dict) -> None:
    a = span["attributes"]
    ttft, e2e = a["gen_ai.latency.time_to_first_token"], a["gen_ai.latency.e2e"]
    assert 0 < ttft <= e2e
    assert 0 <= a["gen_ai.latency.time_in_queue"] < ttft
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] \
        == pytest.approx(a["gen_ai.latency.time_in_model_inference"])
    # the span runs from the request's arrival to its end
    assert e2e <= span["end"] - span["start"] < e2e + 1.0


def test_a_span_per_request_parented_to_the_client_trace(traced, receiver):
    client = openai.OpenAI(base_url=traced + "/v1", api_key="none")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Trace me, please."}],
        max_tokens=4, temperature=0,
        extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    span = span_of(receiver, chat.id)            # vLLM's: a chat span names the response
    assert span["name"] == "llm_request" and span["kind"] == SERVER_KIND
    assert (span["trace_id"], span["parent_span_id"], span["trace_state"]) == (
        TRACE_ID, PARENT_ID, "vendor=1")
    a = span["attributes"]
    assert a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == chat.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [chat.choices[0].finish_reason]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.top_p"], a["gen_ai.request.n"]
            ) == (4, 1.0, 1)
    assert "gen_ai.request.temperature" not in a      # 0 is left out, as vLLM does
    check_timings(span)

    # no traceparent: a trace of its own; n answers: their tokens, each one's reason
    cmpl = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, n=2,
                                     temperature=0.5, top_p=0.9, extra_body={"ignore_eos": True})
    span = span_of(receiver, f"{cmpl.id}-0")     # vLLM's: a completion's prompt i
    assert span["parent_span_id"] == "" and span["trace_id"] != TRACE_ID
    a = span["attributes"]
    assert a["gen_ai.usage.completion_tokens"] == cmpl.usage.completion_tokens == 6
    assert sorted(a["gen_ai.response.finish_reasons"]) == sorted(
        c.finish_reason for c in cmpl.choices)
    assert (a["gen_ai.request.n"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]
            ) == (2, 0.5, pytest.approx(0.9))
    check_timings(span)


def test_a_stream_its_client_left_has_an_aborted_span(traced, receiver):
    body = {"model": "tiny", "prompt": "Stream and leave", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    with requests.post(traced + "/v1/completions", json=body, stream=True,
                       headers={"traceparent": TRACEPARENT}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: "))
    rid = json.loads(first[len(b"data: "):])["id"]
    span = span_of(receiver, f"{rid}-0")
    a = span["attributes"]
    assert span["parent_span_id"] == PARENT_ID
    assert a["gen_ai.response.finish_reasons"] == ["abort"]
    assert 1 <= a["gen_ai.usage.completion_tokens"] < 1000


def test_a_collector_that_is_down_costs_the_requests_nothing(tmp_path, tiny_model_dir):
    """grpc (the default protocol) to a port nobody listens on: every request is answered,
    as fast as untraced, and the server still stops at once (the spans left are dropped)."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--otlp-traces-endpoint",
                                f"http://127.0.0.1:{free_port()}", agent_ports=(free_port(),),
                                env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        times = []
        for _ in range(6):
            t0 = time.monotonic()
            out = client.completions.create(model="tiny", prompt="Hi", max_tokens=8,
                                            extra_body={"ignore_eos": True})
            times.append(time.monotonic() - t0)
            assert out.usage.completion_tokens == 8
        assert max(times[1:]) < 1.0, times      # no export waits on a request
    finally:
        t0 = time.monotonic()
        assert stop_server(proc) == 0
    # the flush at exit is bounded (2 s; unbounded, the exporter's retries took 14 s)
    assert time.monotonic() - t0 < 8.0


def _settings(model, *flags):
    return server_settings(build_parser().parse_args(["serve", "--model", model, *flags]))[0]


def test_the_flags_are_checked_as_vllm_checks_them(tiny_model_dir, monkeypatch):
    url = "http://collector:4317"
    for given in (["all"], ["model", "worker"], ["model,worker"]):
        args = _settings(tiny_model_dir, "--otlp-traces-endpoint", url,
                         "--collect-detailed-traces", *given)
        assert args.otlp_traces_endpoint == url
        assert args.collect_detailed_traces == tuple(",".join(given).split(","))
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--collect-detailed-traces", "model")
    assert e.value.key == "collect_detailed_traces" and "otlp_traces_endpoint" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--otlp-traces-endpoint", url,
                  "--collect-detailed-traces", "layers")
    assert e.value.key == "collect_detailed_traces" and "'layers'" in str(e.value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--otlp-traces-endpoint", url)
    assert e.value.key == "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    # without the OpenTelemetry packages, the error names the one to install
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        None)
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--otlp-traces-endpoint", url)
    assert e.value.key == "otlp_traces_endpoint"
    assert "opentelemetry-exporter-otlp-proto-http" in str(e.value)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError, match="install opentelemetry-sdk"):
        _settings(tiny_model_dir, "--otlp-traces-endpoint", url)
    assert _settings(tiny_model_dir).otlp_traces_endpoint is None    # untraced: not needed


def test_offline_llm_traces_its_requests(tiny_model_dir, receiver, monkeypatch):
    from llm_serving import LLM, SamplingParams
    for key, value in HTTP.items():
        monkeypatch.setenv(key, value)
    traced = dict(num_blocks=64, otlp_traces_endpoint=receiver.url,
                  collect_detailed_traces=["model"])
    llm = LLM(tiny_model_dir, **traced)
    try:
        outs = llm.generate(["Hello", "Goodbye"], SamplingParams(max_tokens=3, temperature=0,
                                                                   ignore_eos=True))
        # vLLM's request loop through llm.llm_engine: a request that ends, one aborted
        loop = llm.llm_engine
        loop.add_request("looped", "Hello", SamplingParams(max_tokens=2, ignore_eos=True))
        loop.add_request("dropped", "Hello", SamplingParams(max_tokens=2))
        loop.abort_request("dropped")
        while loop.has_unfinished_requests():
            loop.step()
    finally:
        llm.engine.shutdown()           # exports what is left
    for out in outs:
        span = span_of(receiver, out.request_id)
        a = span["attributes"]
        assert a["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert a["gen_ai.usage.completion_tokens"] == len(out.outputs[0].token_ids) == 3
        assert a["gen_ai.response.model"] == tiny_model_dir
        assert span["status"] != ERROR_STATUS
    for rid, tokens, reasons in (("looped", 2, ["length"]), ("dropped", 0, ["abort"])):
        a = span_of(receiver, rid)["attributes"]
        assert (a["gen_ai.usage.completion_tokens"], a["gen_ai.response.finish_reasons"]) == (
            tokens, reasons)
    # a request that failed (it waited longer than its queue_timeout): the span says why
    llm = LLM(tiny_model_dir, queue_timeout=1e-9, **traced)
    try:
        failed, = llm.generate(["Hello"], SamplingParams(max_tokens=3))
    finally:
        llm.engine.shutdown()
    assert failed.error and "queue_timeout" in failed.error
    span = span_of(receiver, failed.request_id)
    assert span["status"] == ERROR_STATUS and span["status_message"] == failed.error
    assert span["attributes"]["gen_ai.usage.completion_tokens"] == 0
