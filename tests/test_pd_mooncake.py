"""PD disaggregation between real servers over Mooncake's TransferEngine (MooncakeConnector,
P2P over TCP on loopback): a producer and a consumer ``start.py`` each, driven by hand with
``requests`` (first P with max_tokens 1 and do_remote_decode, then D with P's
kv_transfer_params), against a colocated server; plus a client leaving during a transfer, on
one kv_both server whose agent reads from itself (InProcessConnector, with a slow read).
Needs the ``pd`` extra (CI installs it with ``.[test]``); it is not skipped when Mooncake is
missing."""
from __future__ import annotations

import json
import time

import pytest
import requests

from test_http_server import free_port, start_server, stop_server, wait_until
from test_pd_proxy_routing import Procs
from conftest import metric

PROMPTS = ["Give three tips for staying healthy, then explain each of them in a few words.",
           "What is the capital of France? Answer with the city and one fact about it.",
           "Hi"]


def fresh(prompt: str, tag: str) -> str:
    """``prompt`` with a first block of its own: the consumer's prefix cache (on by default)
    has not seen it, so its KV comes over the transfer (a prompt D has already seen is
    answered from D's own cache, without one)."""
    return f"[{tag}] {prompt}"


def kv_section(role, **extra):
    cfg = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_transfer_timeout": 5,
           **extra}
    return "kv_transfer: " + json.dumps(cfg) + "\n"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("pd")
    started = {}
    try:
        for name, section in (("P", kv_section("kv_producer")), ("D", kv_section("kv_consumer")),
                              ("C", "")):
            started[name] = start_server(tmp, tiny_model_dir, section=section,
                                         agent_ports=(free_port(),))
        yield {name: s[1] for name, s in started.items()}
    finally:
        codes = {name: stop_server(s[0]) for name, s in started.items()}
    assert codes == {"P": 0, "D": 0, "C": 0}


def p_then_d(urls, route, body, p_fields, ask):
    """First P (its max-tokens field 1, do_remote_decode), then D with P's params."""
    rp = requests.post(urls["P"] + route, json={**body, **p_fields, "stream": False,
                                                **ask({"do_remote_decode": True})}, timeout=60)
    assert rp.status_code == 200, rp.text
    params = rp.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["tp_size"] == 1
    rd = requests.post(urls["D"] + route, json={**body, **ask(params)}, timeout=60)
    assert rd.status_code == 200, rd.text
    return params, rd.json()


def top_level(kv):
    return {"kv_transfer_params": kv}


def test_completions_through_p_then_d_match_colocated(servers):
    done0 = metric(servers["D"], 'kv_transfers_total{outcome="done"}')
    moved = 0
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}
        ref = requests.post(servers["C"] + "/v1/completions", json=body, timeout=60).json()
        params, out = p_then_d(servers, "/v1/completions", body, {"max_tokens": 1}, top_level)
        moved += bool(params["remote_block_ids"])
        r, d = ref["choices"][0], out["choices"][0]
        assert d["text"] == r["text"]
        assert d["logprobs"]["tokens"] == r["logprobs"]["tokens"]
        assert d["logprobs"]["token_logprobs"] == pytest.approx(
            r["logprobs"]["token_logprobs"], abs=1e-5)
    assert moved == 2                                # "Hi" has no full block to move
    assert metric(servers["D"], 'kv_transfers_total{outcome="done"}') == done0 + moved
    assert metric(servers["D"], "kv_remote_prefill_tokens_total") > 0
    # The producer held the blocks until D read them; then both pools are empty again.
    wait_until(lambda: metric(servers["P"], "kv_blocks_held") == 0
               and metric(servers["P"], "kv_cache_usage_perc") == 0)
    assert metric(servers["D"], "kv_cache_usage_perc") == 0
    # Asked again, D answers from its own prefix cache: nothing is read, and D tells P at
    # once, so P frees the offer well before it would expire (kv_transfer_timeout 5 s)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    ref = requests.post(servers["C"] + "/v1/completions", json=body, timeout=60).json()
    t0 = time.monotonic()            # P's offer cannot expire before t0 + 5 s
    params, out = p_then_d(servers, "/v1/completions", body, {"max_tokens": 1}, top_level)
    assert params["remote_block_ids"]
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert metric(servers["D"], 'kv_transfers_total{outcome="done"}') == done0 + moved
    wait_until(lambda: metric(servers["P"], "kv_blocks_held") == 0, timeout=30)
    assert time.monotonic() - t0 < 4.5


def test_chat_and_the_generate_route_through_p_then_d(servers):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 10, "temperature": 0}
    ref = requests.post(servers["C"] + "/v1/chat/completions", json=body, timeout=60).json()
    _, out = p_then_d(servers, "/v1/chat/completions", body,
                      {"max_tokens": 1, "max_completion_tokens": 1}, top_level)
    assert out["choices"][0]["message"] == ref["choices"][0]["message"]

    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 10, "do_sample": False}}
    ref = requests.post(servers["C"] + "/models/llama2/generate", json=body, timeout=60).json()

    def in_parameters(kv):
        return {"parameters": {**body["parameters"], "kv_transfer_params": kv}}
    rp = requests.post(servers["P"] + "/models/llama2/generate", timeout=60, json={
        **body, "parameters": {"max_new_tokens": 1, "do_sample": False,
                               "kv_transfer_params": {"do_remote_decode": True}}})
    assert rp.status_code == 200, rp.text
    kv = rp.json()["kv_transfer_params"]
    rd = requests.post(servers["D"] + "/models/llama2/generate", json={
        **body, **in_parameters(kv)}, timeout=60)
    assert rd.json()["generated_text"] == ref["generated_text"]


def test_a_producer_that_is_gone_makes_the_consumer_recompute(servers):
    body = {"model": "tiny", "prompt": fresh(PROMPTS[0], "gone"), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    ref = requests.post(servers["C"] + "/v1/completions", json=body, timeout=60).json()
    rp = requests.post(servers["P"] + "/v1/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = rp["kv_transfer_params"]
    dead = f"127.0.0.1:{free_port()}"                 # nobody listens there
    params["remote_ranks"] = [{**r, "engine": dead} for r in params["remote_ranks"]]
    before = metric(servers["D"], "kv_transfer_recomputes_total")
    t0 = time.monotonic()
    out = requests.post(servers["D"] + "/v1/completions",
                        json={**body, "kv_transfer_params": params}, timeout=60).json()
    assert time.monotonic() - t0 < 10                  # within the 5 s transfer timeout
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert metric(servers["D"], "kv_transfer_recomputes_total") == before + 1
    # The unread offer is freed when it expires.
    wait_until(lambda: metric(servers["P"], "kv_blocks_held") == 0, timeout=15)
    assert metric(servers["D"], "kv_cache_usage_perc") == 0


def test_a_hung_producer_times_out_without_stalling_the_consumer(servers):
    """A producer that accepts connections and never answers (a stopped process, a
    half-dead host): Mooncake's handshake blocks for about a minute. The consumer's step
    loop does not: the request recomputes after the 5 s timeout, others are served meanwhile."""
    import socket
    import threading
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    held = []

    def accept_and_stay_silent():
        try:
            for _ in range(16):
                held.append(hole.accept())
        except OSError:             # the test closed the socket
            pass
    threading.Thread(target=accept_and_stay_silent, daemon=True).start()
    body = {"model": "tiny", "prompt": fresh(PROMPTS[1], "hung"), "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    ref = requests.post(servers["C"] + "/v1/completions", json=body, timeout=60).json()
    params = requests.post(servers["P"] + "/v1/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    ).json()["kv_transfer_params"]
    engine = f"127.0.0.1:{hole.getsockname()[1]}"
    params["remote_ranks"] = [{**r, "engine": engine} for r in params["remote_ranks"]]
    result = {}

    def slow():
        t = time.monotonic()
        result["out"] = requests.post(servers["D"] + "/v1/completions", timeout=60, json={
            **body, "kv_transfer_params": params}).json()
        result["s"] = time.monotonic() - t
    th = threading.Thread(target=slow)
    th.start()
    time.sleep(0.5)
    t0 = time.monotonic()          # another request is not held up by the hung transfer
    quick = requests.post(servers["D"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Hi", "max_tokens": 2}).json()
    assert quick["choices"][0]["finish_reason"] and time.monotonic() - t0 < 4
    th.join(30)
    assert 4 < result["s"] < 12
    assert result["out"]["choices"][0]["text"] == ref["choices"][0]["text"]
    assert metric(servers["D"], 'kv_transfers_total{outcome="timeout"}') >= 1
    hole.close()


def test_kv_transfer_params_are_refused_without_a_kv_transfer_config(servers):
    r = requests.post(servers["C"] + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"
    r = requests.post(servers["D"] + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "kv_producer" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def tp2_pair(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("pd-tp2")
    started = {}
    try:
        for name, role in (("P", "kv_producer"), ("D", "kv_consumer")):
            started[name] = start_server(tmp, tiny_model_dir, section=kv_section(role),
                                         agent_ports=(free_port(), free_port()))
        yield {name: s[1] for name, s in started.items()}
    finally:
        codes = {name: stop_server(s[0]) for name, s in started.items()}
    assert codes == {"P": 0, "D": 0}


def test_tensor_parallel_2_on_both_sides_moves_each_ranks_heads(servers, tp2_pair):
    """Each D rank reads its P rank's KV heads; the answer is the colocated one."""
    urls = {**tp2_pair, "C": servers["C"]}
    for prompt in PROMPTS[:2]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}
        ref = requests.post(urls["C"] + "/v1/completions", json=body, timeout=60).json()
        rp = requests.post(urls["P"] + "/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        params = rp["kv_transfer_params"]
        assert params["tp_size"] == 2 and len(params["remote_ranks"]) == 2
        out = requests.post(urls["D"] + "/v1/completions", timeout=60,
                            json={**body, "kv_transfer_params": params}).json()
        r, d = ref["choices"][0], out["choices"][0]
        assert d["text"] == r["text"]
        assert d["logprobs"]["token_logprobs"] == pytest.approx(
            r["logprobs"]["token_logprobs"], abs=1e-5)
    assert metric(urls["D"], 'kv_transfers_total{outcome="done"}') == 2
    assert metric(urls["D"], "kv_transfer_recomputes_total") == 0
    wait_until(lambda: metric(urls["P"], "kv_blocks_held") == 0)
    # A TP 1 consumer cannot read a TP 2 producer's halves: it computes the prompt itself.
    prompt = fresh(PROMPTS[0], "tp 2 to 1")
    rp = requests.post(urls["P"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    before = metric(servers["D"], "kv_transfer_recomputes_total")
    out = requests.post(servers["D"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": rp["kv_transfer_params"]})
    assert out.status_code == 200
    assert metric(servers["D"], "kv_transfer_recomputes_total") == before + 1


def test_tensor_parallel_2_on_both_sides_through_the_proxy_in_both_orders(servers, tp2_pair):
    """``llm-serving proxy`` over the TP 2 pair, p-first and d-first: the colocated answers,
    each loaded over the transfer (two ranks each), nothing recomputed or left held."""
    procs = Procs()
    try:
        done0 = metric(tp2_pair["D"], 'kv_transfers_total{outcome="done"}')
        recomputes0 = metric(tp2_pair["D"], "kv_transfer_recomputes_total")
        for order in ("p-first", "d-first"):
            proxy = procs.proxy([tp2_pair["P"]], [tp2_pair["D"]], "--order", order)[1]
            body = {"model": "tiny", "prompt": f"{order}: {PROMPTS[0]}", "max_tokens": 10,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1}
            ref = requests.post(servers["C"] + "/v1/completions", json=body, timeout=60).json()
            out = requests.post(proxy + "/v1/completions", json=body, timeout=60).json()
            r, d = ref["choices"][0], out["choices"][0]
            assert d["text"] == r["text"]
            assert d["logprobs"]["token_logprobs"] == pytest.approx(
                r["logprobs"]["token_logprobs"], abs=1e-5)
    finally:
        procs.close()
    assert metric(tp2_pair["D"], 'kv_transfers_total{outcome="done"}') == done0 + 2
    assert metric(tp2_pair["D"], "kv_transfer_recomputes_total") == recomputes0
    wait_until(lambda: metric(tp2_pair["P"], "kv_blocks_held") == 0)


def test_a_client_that_leaves_during_the_transfer_frees_everything(tmp_path, tiny_model_dir):
    """One kv_both server reading from itself through the InProcessConnector (its agent holds
    both sides), each read taking 2 s: the client leaves while its request waits for the
    KV; the request is aborted, its blocks stay held while the read may still write and are
    freed when it ends, and the producer's offer when it is read or expires."""
    import socket
    import struct
    # (no prefix caching: the server would find the prompt it offered in its own cache)
    section = "  enable_prefix_caching: false\nkv_transfer: " + json.dumps({
        "kv_connector": "InProcessConnector", "kv_role": "kv_both", "kv_transfer_timeout": 4,
        "kv_connector_extra_config": {"load_delay": 2.0}}) + "\n"
    proc, url, _ = start_server(tmp_path, tiny_model_dir, section=section,
                                agent_ports=(free_port(),))
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        params = requests.post(url + "/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        ).json()["kv_transfer_params"]
        host, port = url.rsplit("/", 1)[1].split(":")
        # (not streamed: nothing is sent to the client before it leaves)
        payload = json.dumps({**body, "kv_transfer_params": params}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(payload)).encode()
                  + b"\r\n\r\n" + payload)
        wait_until(lambda: metric(url, "kv_loads_in_flight") == 1, timeout=10)
        # the client leaves mid-transfer (a reset: a half-close may go unnoticed)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        wait_until(lambda: metric(url, "kv_loads_in_flight") == 0, timeout=10)
        assert metric(url, 'request_success_total{finished_reason="abort"}') == 1
        wait_until(lambda: metric(url, "kv_cache_usage_perc") == 0
                   and metric(url, "kv_blocks_held") == 0, timeout=15)
        r = requests.post(url + "/v1/completions", json=body, timeout=60)   # still serving
        assert r.status_code == 200
    finally:
        assert stop_server(proc) == 0
