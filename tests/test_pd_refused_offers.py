"""PD: a request that only the consumer refuses (``max_tokens: -1``, ``n: 0``: the producer
got 1 and no ``n``; a max_tokens beyond D's max_model_len) has been prefilled by P, which holds
its KV blocks for D. D's 4xx declines the offer, so P frees the blocks at once, not when the
offer expires (kv_transfer_timeout, 60 s here). Real start.py instances over
MooncakeConnector behind ``llm-serving proxy`` in both orders, real clients."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest
import requests

from test_http_server import agent_pids, start_server, stop_server, free_port, wait_until
from test_pd_mooncake import fresh, kv_section
from test_pd_proxy_routing import Procs, metric as proxy_metric
from conftest import metric

TIMEOUT_S = 60
LONG = " ".join(["Summarize the following notes about the history of the river valley."] * 6)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("pd-refused")
    started, procs = {}, Procs()
    try:
        for name, role in (("P", "kv_producer"), ("D", "kv_consumer")):
            started[name] = start_server(tmp, tiny_model_dir,
                                         section=kv_section(role, kv_transfer_timeout=TIMEOUT_S),
                                         agent_ports=(free_port(),))
        urls = {name: s[1] for name, s in started.items()}
        for order in ("p-first", "d-first"):
            urls[order] = procs.proxy([urls["P"]], [urls["D"]], "--order", order)[1]
            wait_until(lambda: requests.get(urls[order] + "/health", timeout=5).ok, timeout=30)
        yield {**urls, "P pid": started["P"][0].pid}
    finally:
        procs.close()
        codes = {name: stop_server(s[0]) for name, s in started.items()}
    assert codes == {"P": 0, "D": 0}


REFUSED = [
    ("/v1/completions", {"prompt": "max_tokens -1", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "n 0", "max_tokens": 4, "n": 0}, "n"),
    ("/v1/completions", {"prompt": "too long", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": ["two prompts a", "two prompts b"], "max_tokens": -1},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": "chat", "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/models/llama2/generate", {"inputs": "generate", "parameters": {"max_new_tokens": -1}},
     "parameters.max_new_tokens"),
]


def _body(route: str, body: dict, tag: str) -> dict:
    """``body`` with prompts of full blocks of their own (so P has blocks to offer)."""
    def text(s):
        return fresh(f"{s} {LONG}", tag)
    out = dict(body)
    if "prompt" in out:
        p = out["prompt"]
        out["prompt"] = [text(x) for x in p] if isinstance(p, list) else text(p)
    if "messages" in out:
        out["messages"] = [{"role": "user", "content": text(out["messages"])}]
    if "inputs" in out:
        out["inputs"] = text(out["inputs"])
    if route.startswith("/v1/"):
        out["model"] = "tiny"
    return out


@pytest.mark.parametrize("order", ["p-first", "d-first"])
@pytest.mark.parametrize("route,body,field", REFUSED)
def test_a_request_d_refuses_frees_ps_blocks_at_once(pd, order, route, body, field):
    offered0 = metric(pd["P"], "kv_transfers_offered_total")
    r = requests.post(pd[order] + route, json=_body(route, body, f"{order} {field}"), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    # P prefilled it and offered its blocks (first D: D checks it all before asking P) ...
    if order == "p-first":
        assert metric(pd["P"], "kv_transfers_offered_total") > offered0
    else:
        assert metric(pd["P"], "kv_transfers_offered_total") == offered0
    # ... and frees them now, not when the offer expires.
    wait_until(lambda: metric(pd["P"], "kv_blocks_held") == 0, timeout=TIMEOUT_S / 3,
               message="P still holds the blocks of an offer D refused")
    # D still serves the same prompt, and everything is back to idle.
    ok = dict(_body(route, body, f"{order} {field} again"))
    ok.pop("n", None)
    if route == "/models/llama2/generate":
        ok["parameters"] = {"max_new_tokens": 3}
    else:
        ok["max_tokens"] = 3
        ok.pop("max_completion_tokens", None)
    r = requests.post(pd[order] + route, json=ok, timeout=120)
    assert r.status_code == 200, r.text
    wait_until(lambda: all(metric(pd[x], "kv_blocks_held") == 0
                           and metric(pd[x], "kv_cache_usage_perc") == 0 for x in "PD"),
               timeout=TIMEOUT_S / 3)


TOO_LONG = "many words " * 700          # over 1024 tokens: more than max_model_len

# Requests D refuses only after its schema and field checks: its limits, SamplingParams'
# checks, the input processor's (prompt length, token ids), a chat's tools.
REFUSED_LATE = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2, 5000], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": "x", "max_completion_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": TOO_LONG, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": "x", "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ("/models/llama2/generate", {"inputs": TOO_LONG, "parameters": {"max_new_tokens": 4}},
     "inputs"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"top_n_tokens": 50,
                                                               "max_new_tokens": 4}},
     "parameters.top_n_tokens"),
]


@pytest.mark.parametrize("route,body,field", REFUSED_LATE)
def test_first_d_never_asks_p_for_a_request_d_refuses(pd, route, body, field):
    """First D: D asks P for the prefill only once every check of its own has passed, so a
    request it refuses costs P nothing (it used to be prefilled by P, and its offer declined
    or, where P refused it too, counted on D as a failed transfer)."""
    before = {(x, m): metric(pd[x], m) for x, m in (
        ("P", "kv_transfers_offered_total"), ("P", "request_success_total"),
        ("D", 'kv_transfers_total{outcome="failed"}'))}
    ids = isinstance(body.get("prompt"), list)
    r = requests.post(pd["d-first"] + route, timeout=60,
                      json={**body, "model": "tiny"} if ids else _body(route, body, field))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    assert {k: metric(pd[k[0]], k[1]) for k in before} == before
    # the same request within D's limits is served, P prefilling it
    ok = _body(route, {"prompt": "x", "max_tokens": 3} if route == "/v1/completions" else
               {"messages": "x", "max_tokens": 3} if route.startswith("/v1/") else
               {"inputs": "x", "parameters": {"max_new_tokens": 3}}, f"late ok {field}")
    r = requests.post(pd["d-first"] + route, json=ok, timeout=120)
    assert r.status_code == 200, r.text
    assert metric(pd["P"], "kv_transfers_offered_total") > before[
        ("P", "kv_transfers_offered_total")]


MALFORMED = [("remote_ranks", 5), ("remote_ranks", ["rank"]), ("ttl", "soon"),
             ("remote_block_ids", "all"), ("slot", "zero")]


@pytest.mark.parametrize("field,value", MALFORMED)
def test_a_malformed_offer_is_a_400_and_fails_no_other_request(pd, field, value):
    """An offer whose fields the consumer's workers cannot use (a hand-made or corrupted
    kv_transfer_params sent to D) used to fail the model step it reached, and with it every
    request in flight (503 "internal error in a model step"). It is now refused as it
    arrives, naming the field; a request streaming meanwhile ends normally."""
    from llm_serving.distributed.kv_transfer.base import num_transfer_blocks
    from llm_serving.distributed.kv_transfer.block_transfer import prefix_hash
    prompt = fresh(LONG, f"malformed {field} {value}")
    ids = requests.post(pd["D"] + "/tokenize", json={"model": "tiny", "prompt": prompt},
                        timeout=30).json()["tokens"]
    k = num_transfer_blocks(len(ids), 16)
    offer = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-1",
             "remote_engine_id": "p", "remote_block_ids": list(range(1, k + 1)), "tp_size": 1,
             "prefix_hash": prefix_hash(ids, 16, k), "ttl": 30.0, "remote_ranks": [{}],
             "slot": 0, "token": 1, field: value}
    bystander = requests.post(pd["D"] + "/v1/completions", stream=True, timeout=120, json={
        "model": "tiny", "prompt": fresh("bystander", field), "max_tokens": 600,
        "ignore_eos": True, "stream": True})
    lines = bystander.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: {")     # it runs
    for max_tokens in (3, -1):             # admitted by the route, and refused by it
        r = requests.post(pd["D"] + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
            "kv_transfer_params": offer})
        assert r.status_code == 400, r.text
        if max_tokens == 3:
            assert r.json()["error"]["param"] == f"kv_transfer_params.{field}"
    rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]" and not any(b'"error"' in line for line in rest)


def test_p_frees_an_offer_no_d_took(pd):
    """p-first: P has prefilled the prompt, then the D the proxy picks refuses the connection
    (it died or closed its port since the last health check). Another live D gets the same
    offer and reads it; with none, the client gets a 503 and the proxy tells P to decline the
    offer. Either way P frees the blocks at once, not when the offer expires (60 s here)."""
    procs = Procs()
    try:
        gone_proc, gone = procs.fake("Dgone")
        # checks every 60 s: the proxies still count the gone D as up when the requests come
        alone = procs.proxy([pd["P"]], [gone], "--health-interval", "60")[1]
        both = procs.proxy([pd["P"]], [gone, pd["D"]], "--health-interval", "60")[1]
        procs.stop(gone_proc)
        offered0 = metric(pd["P"], "kv_transfers_offered_total")
        for i in range(2):       # round-robin: one of the two is sent to the gone D first
            r = requests.post(both + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": fresh(LONG, f"gone D, another {i}"), "max_tokens": 3})
            assert r.status_code == 200, r.text
        assert metric(pd["P"], "kv_transfers_offered_total") == offered0 + 2
        wait_until(lambda: metric(pd["P"], "kv_blocks_held") == 0, timeout=TIMEOUT_S / 3)
        r = requests.post(alone + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": fresh(LONG, "gone D, alone"), "max_tokens": 3})
        assert r.status_code == 503 and "no decode instance is up" in r.text, r.text
        assert metric(pd["P"], "kv_transfers_offered_total") == offered0 + 3
        wait_until(lambda: metric(pd["P"], "kv_blocks_held") == 0, timeout=TIMEOUT_S / 3,
                   message="P still holds the blocks of an offer no D took")
        for body, field in (({"do_remote_prefill": True}, "kv_transfer_params"),
                            ("not json", "body")):
            r = requests.post(pd["P"] + "/kv_transfer/decline", timeout=30,
                              **({"json": body} if isinstance(body, dict) else {"data": body}))
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    finally:
        procs.close()


@pytest.mark.parametrize("order", ["p-first", "d-first"])
def test_a_client_gone_while_p_computes_frees_ps_blocks_at_once(pd, order):
    """A streaming client closes its connection while P's model step for its prompt runs
    (P's WorkAgent held with SIGSTOP, so that the step cannot end first): P cannot stop a
    step, so the prompt ends with an offer after the client has gone. That offer is declined
    (P frees the blocks in seconds, not when the offer expires, 60 s here) and D never starts
    the request."""
    agent = agent_pids(pd["P pid"])[0]
    offered0 = metric(pd["P"], "kv_transfers_offered_total")
    started0 = metric(pd["D"], "e2e_request_latency_seconds_count")
    raw = json.dumps({"model": "tiny", "prompt": fresh(" ".join([LONG] * 3), order),
                      "max_tokens": 20, "stream": True}).encode()
    host, port = pd[order].rsplit("/", 1)[1].split(":")
    os.kill(agent, signal.SIGSTOP)
    try:
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
            time.sleep(1.0)             # the prompt is in P's step, which waits for the agent
        time.sleep(1.0)                 # the client has gone: the proxy, D and P see it
    finally:
        os.kill(agent, signal.SIGCONT)
    wait_until(lambda: metric(pd["P"], "kv_transfers_offered_total") > offered0, timeout=30,
               message="P made no offer: the client did not leave during its step")
    wait_until(lambda: metric(pd["P"], "kv_blocks_held") == 0, timeout=TIMEOUT_S / 6,
               message="P still holds the blocks of a client gone during its step")
    assert metric(pd["D"], "e2e_request_latency_seconds_count") == started0, \
        "D started the request of a client that had gone"


def _d_to_drain(tmp_path, model_dir):
    """A D (its process and URL) that will be drained, and a thread (not started) that keeps
    a long stream of its own running meanwhile."""
    proc, url, _ = start_server(tmp_path, model_dir, "--shutdown-timeout", "120",
                                section=kv_section("kv_consumer", kv_transfer_timeout=TIMEOUT_S),
                                agent_ports=(free_port(),))
    busy = threading.Thread(target=requests.post, args=(url + "/v1/completions",),
                            kwargs={"timeout": 120, "json": {
                                "model": "tiny", "prompt": "keep draining", "stream": True,
                                "max_tokens": 1000, "ignore_eos": True}})
    return proc, url, busy


def test_a_draining_d_leaves_its_requests_to_another_d(pd, tmp_path, tiny_model_dir):
    """p-first, two Ds, one of them draining (SIGTERM, a request of its own still running):
    it answers new requests 503 without starting them, and the proxy sends each one to the
    other D with P's same offer, which that D reads (P frees the blocks at once)."""
    proc, drainer, busy = _d_to_drain(tmp_path, tiny_model_dir)
    procs = Procs()
    try:
        proxy = procs.proxy([pd["P"]], [drainer, pd["D"]], "--health-interval", "60")[1]
        busy.start()
        wait_until(lambda: metric(drainer, "num_requests_running") == 1, timeout=30)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: requests.get(drainer + "/ready", timeout=5).status_code == 503,
                   timeout=30)
        loaded0 = metric(pd["D"], "kv_remote_prefill_tokens_total")
        for i in range(4):       # round-robin: two of them are sent to the draining D first
            r = requests.post(proxy + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": fresh(LONG, f"draining D {i}"), "max_tokens": 3})
            assert r.status_code == 200, r.text
        assert metric(pd["D"], "kv_remote_prefill_tokens_total") > loaded0
        wait_until(lambda: metric(pd["P"], "kv_blocks_held") == 0, timeout=TIMEOUT_S / 6,
                   message="P still holds the blocks of an offer the draining D left")
    finally:
        procs.close()
        assert stop_server(proc) == 0
        if busy.ident is not None:
            busy.join(30)


def test_a_draining_d_stays_out_of_the_rotation(pd, tmp_path, tiny_model_dir):
    """The proxy routes by readiness: a D draining for a shutdown (its /health still 200, as
    it is alive and finishing its own request) leaves the rotation at the next check and
    stays out, so no request is first sent to it to be refused."""
    proc, drainer, busy = _d_to_drain(tmp_path, tiny_model_dir)
    agent = agent_pids(proc.pid)[0]
    procs = Procs()
    try:
        proxy = procs.proxy([pd["P"]], [drainer, pd["D"]], "--health-interval", "0.5")[1]
        wait_until(lambda: proxy_metric(proxy, "instance_up", role="decode", url=drainer) == 1,
                   timeout=30)
        busy.start()
        wait_until(lambda: metric(drainer, "num_requests_running") == 1, timeout=30)
        os.kill(agent, signal.SIGSTOP)      # its request then drains until we say
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: requests.get(drainer + "/ready", timeout=5).status_code == 503,
                   timeout=30)
        assert requests.get(drainer + "/health", timeout=5).status_code == 200
        wait_until(lambda: proxy_metric(proxy, "instance_up", role="decode", url=drainer) == 0,
                   timeout=10, message="the draining D is still in the proxy's rotation")
        for i in range(2):
            r = requests.post(proxy + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": fresh(LONG, f"drained D {i}"), "max_tokens": 3})
            assert r.status_code == 200, r.text
        time.sleep(1.5)         # three more checks
        assert proxy_metric(proxy, "instance_up", role="decode", url=drainer) == 0
        assert proc.poll() is None and busy.is_alive()      # it was draining all along
    finally:
        os.kill(agent, signal.SIGCONT)
        procs.close()
        assert stop_server(proc) == 0
        if busy.ident is not None:
            busy.join(30)


@pytest.mark.parametrize("order", ["p-first", "d-first"])
def test_responses_api_through_the_proxy_is_prefilled_on_p(pd, order):
    """/v1/responses behind the proxy, as chat: P prefills the input (max_output_tokens 1),
    D loads its KV and decodes; the answer, whole and streamed (the openai package's
    responses.create and responses.stream), is the one an instance gives on its own (P: D's
    prefix cache must not have the prompt), and P holds no blocks after."""
    import openai
    proxied = openai.OpenAI(base_url=pd[order] + "/v1", api_key="none", max_retries=0)
    alone = openai.OpenAI(base_url=pd["P"] + "/v1", api_key="none", max_retries=0)
    ask = dict(model="tiny", input=fresh(LONG, f"responses {order}"), max_output_tokens=12,
               temperature=0)
    want = alone.responses.create(**ask).output_text
    loaded0 = metric(pd["D"], "kv_remote_prefill_tokens_total")
    r = proxied.responses.create(**ask)
    assert r.status == "incomplete" and r.output_text == want
    loaded1 = metric(pd["D"], "kv_remote_prefill_tokens_total")
    assert loaded1 > loaded0, "D computed the prompt itself"
    with proxied.responses.stream(**{**ask, "input": fresh(LONG, f"responses {order} s")}
                                  ) as stream:
        said = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert said == final.output_text and len(final.output_text) > 0
    assert metric(pd["D"], "kv_remote_prefill_tokens_total") > loaded1
    wait_until(lambda: metric(pd["P"], "kv_blocks_held") == 0, timeout=TIMEOUT_S / 6)
