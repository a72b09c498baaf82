"""``llm-serving proxy`` (started as a user starts it) in front of small real HTTP servers
that speak the PD contract without a model (tests/pd_fake_instance.py): what P and D are
sent in both orders, byte-for-byte relay, round-robin and least-loaded, upstream errors passed
through, dead instances out of rotation, a P or D killed mid-request, client disconnects.
The same proxy against real instances: tests/test_pd_proxy.py."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from test_http_server import free_port

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().parent / "pd_fake_instance.py"


class Procs:
    def __init__(self):
        self.procs = []

    def fake(self, name, health=200):
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), "--name", name,
                                 "--health", str(health)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(url + "/_log", timeout=1)
                return proc, url
            except requests.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "fake did not start"
                time.sleep(0.1)

    def proxy(self, prefill, decode, *flags):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "llm_serving.cli", "proxy", "--port", str(port),
             "--prefill", *prefill, "--decode", *decode, "--health-interval", "0.5", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        self.procs.append(proc)
        line = proc.stdout.readline()
        assert "proxy ready" in line, line + proc.stderr.read()
        return proc, f"http://127.0.0.1:{port}"

    def stop(self, proc):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def close(self):
        for p in self.procs:
            self.stop(p)


@pytest.fixture(scope="module")
def procs():
    p = Procs()
    yield p
    p.close()


@pytest.fixture(scope="module")
def fakes(procs):
    """Two prefill and two decode fakes."""
    return {name: procs.fake(name)[1] for name in ("P1", "P2", "D1", "D2")}


def log(url):
    return requests.get(url + "/_log", timeout=5).json()


def clear_logs(*urls):
    return {u: len(log(u)) for u in urls}


def new_entries(url, before):
    return log(url)[before[url]:]


def test_p_first_sends_the_contract_and_relays_bytes(procs, fakes):
    _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]])
    body = {"model": "m", "prompt": "hello", "max_tokens": 9, "min_tokens": 2,
            "stream_options": {"include_usage": True}, "temperature": 0}
    before = clear_logs(fakes["P1"], fakes["D1"])
    r = requests.post(proxy + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    [p], [d] = new_entries(fakes["P1"], before), new_entries(fakes["D1"], before)
    # P: the client's body, one token, not streamed, asked to keep the KV.
    assert p["path"] == "/v1/completions"
    assert p["body"] == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0,
                         "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    # D: the client's own body plus P's params, unchanged.
    assert d["body"] == {**body, "kv_transfer_params": {"do_remote_prefill": True,
                                                         "remote_block_ids": [7],
                                                         "from": "P1"}}
    # D's answer reaches the client byte for byte, with its headers.
    direct = requests.post(fakes["D1"] + "/v1/completions", json=d["body"], timeout=30)
    assert r.content == direct.content and b"  " in r.content
    assert r.headers["x-fake"] == "D1" and r.headers["content-type"] == "application/json"

    # Chat: both max-tokens fields; llm-serving's stream route: P gets /generate.
    before = clear_logs(fakes["P1"], fakes["D1"])
    requests.post(proxy + "/v1/chat/completions", timeout=30,
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    [p] = new_entries(fakes["P1"], before)
    assert p["body"]["max_tokens"] == 1 and p["body"]["max_completion_tokens"] == 1
    before = clear_logs(fakes["P1"], fakes["D1"])
    r = requests.post(proxy + "/models/llama2/generate_stream", timeout=30,
                      json={"inputs": "hi", "parameters": {"max_new_tokens": 7,
                                                           "return_full_text": True}})
    [p], [d] = new_entries(fakes["P1"], before), new_entries(fakes["D1"], before)
    assert p["path"] == "/models/llama2/generate"
    assert p["body"]["parameters"] == {"max_new_tokens": 1, "return_full_text": False,
                                       "kv_transfer_params": {"do_remote_decode": True}}
    assert d["path"] == "/models/llama2/generate_stream"
    assert d["body"]["parameters"]["max_new_tokens"] == 7
    assert d["body"]["parameters"]["kv_transfer_params"]["from"] == "P1"
    assert r.text.count("data:  ") == 5 and r.text.endswith("data: [DONE]\n\n")


def test_d_first_names_p_to_d(procs, fakes):
    _, proxy = procs.proxy([fakes["P2"]], [fakes["D2"]], "--order", "d-first")
    before = clear_logs(fakes["P2"], fakes["D2"])
    r = requests.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 3},
                      timeout=30)
    assert r.status_code == 200
    assert new_entries(fakes["P2"], before) == []      # D's server asks P, not the proxy
    [d] = new_entries(fakes["D2"], before)
    assert d["body"]["kv_transfer_params"] == {"do_remote_prefill": True,
                                               "remote_prefill_url": fakes["P2"]}


def test_stream_is_relayed_as_it_comes(procs, fakes):
    _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]])
    t0 = time.monotonic()
    arrivals = []
    with requests.post(proxy + "/v1/completions", json={"prompt": "slow", "stream": True},
                       stream=True, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                arrivals.append(time.monotonic() - t0)
    assert len(arrivals) == 6
    assert arrivals[-1] - arrivals[0] > 1.0       # chunks 0.4 s apart, not buffered


def test_a_client_leaving_after_the_last_event_is_counted_ok(procs, fakes):
    """A client that closes its stream once it has ``data: [DONE]`` (as openai's and aiohttp
    clients do) got its whole answer: requests_total counts it ok, not client_gone, and the
    proxy logs no error. One that leaves before the end is client_gone."""
    proc, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]])
    for _ in range(3):
        with requests.post(proxy + "/v1/completions", json={"prompt": "linger",
                                                            "stream": True},
                           stream=True, timeout=30) as r:
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    break
    with requests.post(proxy + "/v1/completions", json={"prompt": "slow", "stream": True},
                       stream=True, timeout=30) as r:
        next(r.iter_lines())
    time.sleep(1.5)
    assert metric(proxy, "requests_total", outcome="ok") == 3
    assert metric(proxy, "requests_total", outcome="client_gone") == 1
    procs.stop(proc)
    assert "Task exception was never retrieved" not in proc.stderr.read()


def test_round_robin_and_least_loaded(procs, fakes):
    P, D = [fakes["P1"], fakes["P2"]], [fakes["D1"], fakes["D2"]]
    _, proxy = procs.proxy(P, D)
    before = clear_logs(*P, *D)
    for _ in range(4):
        assert requests.post(proxy + "/v1/completions", json={"prompt": "x"},
                             timeout=30).status_code == 200
    assert [len(new_entries(u, before)) for u in P + D] == [2, 2, 2, 2]

    # least-loaded: while one D holds a slow stream, the quick requests go to the other.
    _, proxy = procs.proxy(P, D, "--policy", "least-loaded")
    before = clear_logs(*D)
    with requests.post(proxy + "/v1/completions", json={"prompt": "slow", "stream": True},
                       stream=True, timeout=30) as slow:
        busy = [u for u in D if new_entries(u, before)]
        assert len(busy) == 1
        for _ in range(3):
            assert requests.post(proxy + "/v1/completions", json={"prompt": "x"},
                                 timeout=30).status_code == 200
        idle = [u for u in D if u not in busy][0]
        assert len(new_entries(idle, before)) == 3 and len(new_entries(busy[0], before)) == 1
        slow.content


def test_upstream_errors_pass_through_unchanged(procs, fakes):
    _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]])
    # P refuses: the client gets P's answer and D is not asked.
    before = clear_logs(fakes["D1"])
    r = requests.post(proxy + "/v1/completions", json={"prompt": "status:422"}, timeout=30)
    direct = requests.post(fakes["P1"] + "/v1/completions", json={"prompt": "status:422"},
                           timeout=30)
    assert (r.status_code, r.content) == (422, direct.content) and b"P1" in r.content
    assert new_entries(fakes["D1"], before) == []
    # The proxy's own refusals name the field.
    r = requests.post(proxy + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {}},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = requests.post(proxy + "/v1/completions", data=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    # Other routes go to D unchanged.
    r = requests.get(proxy + "/v1/models", timeout=30)
    assert r.content == requests.get(fakes["D1"] + "/v1/models", timeout=30).content


def metric(proxy_url, name, **labels):
    """The proxy's metric (None when it is not there)."""
    text = requests.get(proxy_url + "/metrics", timeout=10).text
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^llm_serving_proxy:{re.escape(name)}\{{{re.escape(sel)}\}} (\S+)$" if sel \
        else rf"^llm_serving_proxy:{re.escape(name)} (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else None


def test_dead_and_unhealthy_instances_leave_the_rotation(procs, fakes):
    dead = f"http://127.0.0.1:{free_port()}"             # nothing listens there
    _, loading = procs.fake("loading", health=503)       # up, but not ready to serve
    _, proxy = procs.proxy([dead, loading, fakes["P1"]], [fakes["D1"]])
    for method, route in (("GET", "/health"), ("GET", "/ready"), ("GET", "/ping"),
                          ("POST", "/ping")):
        assert requests.request(method, proxy + route, timeout=10).status_code == 200
    before = clear_logs(loading, fakes["P1"])
    for _ in range(4):
        assert requests.post(proxy + "/v1/completions", json={"prompt": "x"},
                             timeout=30).status_code == 200
    assert len(new_entries(fakes["P1"], before)) == 4 and new_entries(loading, before) == []
    assert metric(proxy, "instance_up", role="prefill", url=dead) == 0
    assert metric(proxy, "instance_up", role="prefill", url=fakes["P1"]) == 1
    # The loading one comes back once its /health says so.
    requests.post(loading + "/_health/200", timeout=5)
    time.sleep(1.5)
    for _ in range(4):
        requests.post(proxy + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert len(new_entries(loading, before)) == 2
    # No decode instance up: /health (and /ready, /ping, as on an instance) and requests say so.
    _, proxy = procs.proxy([fakes["P1"]], [dead])
    for method, route in (("GET", "/health"), ("GET", "/ready"), ("GET", "/ping"),
                          ("POST", "/ping")):
        r = requests.request(method, proxy + route, timeout=10)
        assert r.status_code == 503 and "no decode instance is up" in r.json()["error"]["message"]
    r = requests.post(proxy + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 503 and dead in r.json()["error"]["message"]


def test_no_prefill_instance_up_is_healthy_when_d_recomputes(procs, fakes):
    """With ``--on-prefill-failure recompute`` (default) D serves every request while no P is
    up, so the proxy is healthy (its body says prefill is degraded); with ``fail`` it is not,
    as its requests then fail."""
    dead = f"http://127.0.0.1:{free_port()}"             # nothing listens there
    for order in ("p-first", "d-first"):
        _, proxy = procs.proxy([dead], [fakes["D1"]], "--order", order)
        for method, route in (("GET", "/health"), ("GET", "/ready"), ("GET", "/ping"),
                              ("POST", "/ping")):
            r = requests.request(method, proxy + route, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "degraded" and dead in r.json()["prefill"]
        assert requests.post(proxy + "/v1/completions", json={"prompt": "x"},
                             timeout=30).status_code == 200
        _, proxy = procs.proxy([dead], [fakes["D1"]], "--order", order,
                               "--on-prefill-failure", "fail")
        r = requests.get(proxy + "/health", timeout=10)
        assert r.status_code == 503 and "no prefill instance is up" in r.json()["error"]["message"]
        assert requests.post(proxy + "/v1/completions", json={"prompt": "x"},
                             timeout=30).status_code in (502, 503)
    _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]])
    r = requests.get(proxy + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""          # nothing degraded


def test_no_decode_instance_up_is_a_503_before_p_is_asked(procs, fakes):
    """p-first with every D down: the request is refused at once, and P is not asked to
    prefill (it would hold the prompt's KV blocks for a reader that cannot come)."""
    dead = f"http://127.0.0.1:{free_port()}"
    _, proxy = procs.proxy([fakes["P1"]], [dead])
    before = clear_logs(fakes["P1"])
    for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}):
        r = requests.post(proxy + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "no decode instance is up" in r.json()["error"]["message"]
    r = requests.post(proxy + "/models/llama2/generate", json={"inputs": "x"}, timeout=30)
    assert r.status_code == 503
    assert new_entries(fakes["P1"], before) == []


def test_a_malformed_body_is_a_400_naming_the_field(procs, fakes):
    """llm-serving's ``parameters`` that is not an object is a 400 naming it, as on an
    instance (the proxy sets fields in it), in both orders; no instance is asked."""
    before = clear_logs(fakes["P1"], fakes["D1"])
    for order in ("p-first", "d-first"):
        _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]], "--order", order)
        for route in ("generate", "generate_stream"):
            for bad in ("x", [1], 3):
                r = requests.post(f"{proxy}/models/llama2/{route}",
                                  json={"inputs": "x", "parameters": bad}, timeout=30)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "parameters"
    assert new_entries(fakes["P1"], before) == [] and new_entries(fakes["D1"], before) == []


def test_p_killed_mid_request(procs, fakes):
    for policy, expect in (("recompute", 200), ("fail", 502)):
        p_proc, p_url = procs.fake("Pdying")
        _, proxy = procs.proxy([p_url], [fakes["D1"]], "--on-prefill-failure", policy)
        before = clear_logs(fakes["D1"])
        with requests.Session() as s:
            import threading
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("r", s.post(
                proxy + "/v1/completions", json={"prompt": "slow"}, timeout=30)))
            t0 = time.monotonic()
            t.start()
            time.sleep(0.8)
            p_proc.kill()
            t.join(30)
        r = out["r"]
        assert r.status_code == expect and time.monotonic() - t0 < 10
        if expect == 200:       # D computed the prompt itself: no kv_transfer_params
            [d] = new_entries(fakes["D1"], before)
            assert "kv_transfer_params" not in d["body"]
            assert metric(proxy, "prefill_fallbacks_total") == 1
        else:
            assert p_url in r.json()["error"]["message"]
            assert new_entries(fakes["D1"], before) == []


def test_d_killed_mid_stream_and_mid_answer(procs, fakes):
    d_proc, d_url = procs.fake("Ddying")
    _, proxy = procs.proxy([fakes["P1"]], [d_url])
    t0 = time.monotonic()
    with requests.post(proxy + "/v1/completions", json={"prompt": "slow", "stream": True},
                       stream=True, timeout=30) as r:
        lines = []
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if len(lines) == 2:
                    d_proc.kill()
    assert time.monotonic() - t0 < 10
    last = json.loads(lines[-1][len(b"data: "):])
    assert last["error"]["code"] == 502 and d_url in last["error"]["message"]
    # The shape of every error object the proxy and the instances send (param included).
    assert set(last["error"]) == {"message", "type", "param", "code"}
    assert b"[DONE]" not in lines[-1]
    # It left the rotation: the next request says no decode instance is up.
    time.sleep(1)
    r = requests.post(proxy + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 503


def test_client_disconnect_closes_the_upstream_request(procs, fakes):
    _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]])
    # During D's stream.
    before = clear_logs(fakes["P1"], fakes["D1"])
    with requests.post(proxy + "/v1/completions", json={"prompt": "slow", "stream": True},
                       stream=True, timeout=30) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 5
    while not new_entries(fakes["D1"], before)[0]["disconnected"]:
        assert time.monotonic() < deadline, "D never saw the client leave"
        time.sleep(0.1)
    # During P's prefill (non-streamed, slow): P sees it, D is never asked.
    before = clear_logs(fakes["P1"], fakes["D1"])
    with pytest.raises(requests.ReadTimeout):
        requests.post(proxy + "/v1/completions", json={"prompt": "slow"}, timeout=0.8)
    deadline = time.monotonic() + 5
    while not new_entries(fakes["P1"], before)[0]["disconnected"]:
        assert time.monotonic() < deadline, "P never saw the client leave"
        time.sleep(0.1)
    time.sleep(0.5)
    assert new_entries(fakes["D1"], before) == []
    assert metric(proxy, "requests_total", outcome="client_gone") == 2
    assert metric(proxy, "instance_requests_in_flight", role="decode", url=fakes["D1"]) == 0


def test_client_connections_are_bounded_as_on_an_instance(procs, fakes):
    """The proxy's own client side: a request that never arrives whole is closed with a 408
    after --request-read-timeout, an oversized head gets a 431, and requests still pass."""
    import socket
    _, proxy = procs.proxy([fakes["P1"]], [fakes["D1"]], "--request-read-timeout", "1")
    host, port = proxy.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        t0, data = time.monotonic(), b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408 ") and 0.5 < time.monotonic() - t0 < 5, data
    big = requests.get(proxy + "/health", headers={"X-Big": "a" * 40_000}, timeout=10)
    assert big.status_code == 431
    assert requests.get(proxy + "/health", timeout=10).status_code == 200
