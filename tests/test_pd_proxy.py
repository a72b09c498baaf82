"""End to end: ``llm-serving proxy`` in front of real ``start.py`` instances, a producer and
a consumer over MooncakeConnector, against one colocated instance, in both orders (p-first:
the proxy asks P then D; d-first: D's server asks P). Real clients (``openai``, ``requests``).
Faults: a P killed mid-run, a D killed mid-run, clients disconnecting during transfers; in
every case each request completes or fails with a clear error, nothing hangs, and the KV
pools go back to 0."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import openai
import pytest
import requests

from test_http_server import agent_pids, free_port, start_server, stop_server, wait_until
from test_pd_mooncake import fresh, kv_section
from test_pd_proxy_routing import Procs
from test_pd_proxy_routing import metric as proxy_metric
from conftest import metric, metric_value

PROMPTS = ["Give three tips for staying healthy, then explain each of them in a few words.",
           "What is the capital of France? Answer with the city and one fact about it.",
           "Hi"]
LONG = " ".join(["Summarize the following notes about the history of the river valley."] * 20)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_model_dir):
    """P, D and a colocated C; a p-first and a d-first proxy over P and D."""
    tmp = tmp_path_factory.mktemp("pd-proxy")
    started, procs = {}, Procs()
    try:
        for name, section in (("P", kv_section("kv_producer")), ("D", kv_section("kv_consumer")),
                              ("C", "")):
            started[name] = start_server(tmp, tiny_model_dir, section=section,
                                         agent_ports=(free_port(),))
        urls = {name: s[1] for name, s in started.items()}
        for order in ("p-first", "d-first"):
            urls[order] = procs.proxy([urls["P"]], [urls["D"]], "--order", order)[1]
        yield {"urls": urls, "tmp": tmp, "model": tiny_model_dir, "procs": procs}
    finally:
        procs.close()
        codes = {name: stop_server(s[0]) for name, s in started.items()}
    assert codes == {"P": 0, "D": 0, "C": 0}


def pools_empty(*urls):
    """Every instance's KV pool back to 0 and nothing held for a transfer."""
    wait_until(lambda: all(metric(u, "kv_blocks_held") == 0
                           and metric(u, "kv_cache_usage_perc") == 0 for u in urls),
               timeout=20)


@pytest.mark.parametrize("order", ["p-first", "d-first"])
def test_greedy_outputs_through_the_proxy_match_colocated(pd, order):
    u = pd["urls"]
    proxy = openai.OpenAI(base_url=u[order] + "/v1", api_key="none")
    colo = openai.OpenAI(base_url=u["C"] + "/v1", api_key="none")
    done0 = metric(u["D"], 'kv_transfers_total{outcome="done"}')
    recomputes0 = metric(u["D"], "kv_transfer_recomputes_total")
    for prompt in PROMPTS:
        kw = dict(model="tiny", prompt=fresh(prompt, order), max_tokens=12, temperature=0,
                  logprobs=1, extra_body={"ignore_eos": True})
        ref, out = colo.completions.create(**kw).choices[0], \
            proxy.completions.create(**kw).choices[0]
        assert out.text == ref.text
        assert out.logprobs.tokens == ref.logprobs.tokens
        assert out.logprobs.token_logprobs == pytest.approx(ref.logprobs.token_logprobs,
                                                            abs=1e-5)
        kw["prompt"] = fresh(prompt, order + " streamed")
        ref = colo.completions.create(**kw).choices[0]
        streamed = "".join(c.choices[0].text for c in proxy.completions.create(
            **kw, stream=True) if c.choices)
        assert streamed == ref.text
    # Two prompts of each pass had full blocks to move, twice (plain and streamed).
    assert metric(u["D"], 'kv_transfers_total{outcome="done"}') == done0 + 4
    assert metric(u["D"], "kv_transfer_recomputes_total") == recomputes0

    msgs = [{"role": "user", "content": PROMPTS[1]}]
    ref = colo.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                       temperature=0)
    out = proxy.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                        temperature=0)
    assert out.choices[0].message.content == ref.choices[0].message.content

    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 10, "details": True,
                                                 "return_full_text": False}}
    ref = requests.post(u["C"] + "/models/llama2/generate", json=body, timeout=60).json()
    out = requests.post(u[order] + "/models/llama2/generate", json=body, timeout=60).json()
    assert out["generated_text"] == ref["generated_text"]
    lines = requests.post(u[order] + "/models/llama2/generate_stream", json=body,
                          timeout=60).text.splitlines()
    steps = [json.loads(x)["data"][0] for x in lines]
    assert "".join(s["generated_text"] for s in steps) == ref["generated_text"]
    assert [s["tokens"]["id"] for s in steps] == [t["id"] for t in ref["tokens"]]  # a line each
    pools_empty(u["P"], u["D"])


@pytest.mark.parametrize("order", ["p-first", "d-first"])
def test_n_completions_through_the_proxy_match_colocated(pd, order):
    """n > 1 (completions and chat, streamed or not): P computes the prompt once, D loads it
    and samples the n choices, which are the colocated instance's."""
    u = pd["urls"]
    proxy = openai.OpenAI(base_url=u[order] + "/v1", api_key="none")
    colo = openai.OpenAI(base_url=u["C"] + "/v1", api_key="none")
    done0 = metric(u["D"], 'kv_transfers_total{outcome="done"}')
    kw = dict(model="tiny", prompt=fresh(PROMPTS[0], order + " n"), max_tokens=8, n=3,
              temperature=0, logprobs=1)
    ref, out = colo.completions.create(**kw), proxy.completions.create(**kw)
    assert [c.text for c in out.choices] == [c.text for c in ref.choices]
    for o, r in zip(out.choices, ref.choices):
        assert o.logprobs.token_logprobs == pytest.approx(r.logprobs.token_logprobs, abs=1e-5)
    texts = ["", ""]
    for chunk in proxy.completions.create(**dict(kw, n=2), stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in ref.choices[:2]]
    msgs = [{"role": "user", "content": fresh(PROMPTS[1], order + " n")}]
    ref = colo.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, n=2,
                                       temperature=0)
    out = proxy.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, n=2,
                                        temperature=0)
    assert [c.message.content for c in out.choices] == [c.message.content
                                                        for c in ref.choices]
    # The completion's and the chat's prompts came over (the stream's was in D's cache).
    assert metric(u["D"], 'kv_transfers_total{outcome="done"}') == done0 + 2
    pools_empty(u["P"], u["D"])


@pytest.mark.parametrize("order", ["p-first", "d-first"])
def test_a_completion_of_several_prompts_moves_each_prompts_own_kv(pd, order):
    """A list of prompts (as lm-eval sends them): P offers each prompt's blocks and D loads
    each prompt its own offer; the answers are the colocated instance's and no load fails
    (one prompt given another's offer used to be refused, and its refusal freed the offer
    the other prompt was reading)."""
    u = pd["urls"]
    proxy = openai.OpenAI(base_url=u[order] + "/v1", api_key="none")
    colo = openai.OpenAI(base_url=u["C"] + "/v1", api_key="none")
    done0 = metric(u["D"], 'kv_transfers_total{outcome="done"}')
    failed0 = metric(u["D"], 'kv_transfers_total{outcome="failed"}')
    prompts = [fresh(PROMPTS[0], order + " list"), fresh(PROMPTS[1], order + " list"), "Hi"]
    kw = dict(model="tiny", prompt=prompts, max_tokens=8, temperature=0, logprobs=1)
    ref, out = colo.completions.create(**kw), proxy.completions.create(**kw)
    assert [c.text for c in out.choices] == [c.text for c in ref.choices]
    for o, r in zip(out.choices, ref.choices):
        assert o.logprobs.token_logprobs == pytest.approx(r.logprobs.token_logprobs, abs=1e-5)
    assert metric(u["D"], 'kv_transfers_total{outcome="done"}') == done0 + 2   # not "Hi"
    assert metric(u["D"], 'kv_transfers_total{outcome="failed"}') == failed0
    pools_empty(u["P"], u["D"])
    r = requests.post(u["D"] + "/v1/completions", timeout=60, json=dict(
        kw, kv_transfer_params={"do_remote_prefill": True, "prompts": [None]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert "one offer per prompt (3)" in r.json()["error"]["message"]


def test_clients_disconnecting_during_transfers_leak_nothing(pd):
    u = pd["urls"]
    for order in ("p-first", "d-first"):
        for i in range(4):
            body = {"model": "tiny", "prompt": f"{i} {LONG}", "max_tokens": 50,
                    "stream": i % 2 == 0, "ignore_eos": True}
            try:      # gone during P's prefill, D's load or the first tokens
                requests.post(u[order] + "/v1/completions", json=body, timeout=0.05 + 0.1 * i)
            except (requests.Timeout, requests.ConnectionError):
                pass      # a timeout while the body streams in surfaces as ConnectionError
    pools_empty(u["P"], u["D"])
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    assert requests.post(u["p-first"] + "/v1/completions", json=body, timeout=60).json()[
        "choices"][0]["text"] == requests.post(u["C"] + "/v1/completions", json=body,
                                              timeout=60).json()["choices"][0]["text"]


def kill_server(proc) -> None:
    """SIGKILL a server and its WorkAgents (a machine or container gone)."""
    agents = agent_pids(proc.pid)
    proc.kill()
    for pid in agents:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def run_concurrently(calls, during=None, delay=1.0):
    """Runs the calls at once (each returns a result or raises); ``during`` after ``delay``."""
    results = [None] * len(calls)

    def run(i, call):
        t0 = time.monotonic()
        try:
            results[i] = (call(), time.monotonic() - t0)
        except Exception as e:      # noqa: BLE001 - reported to the test
            results[i] = (e, time.monotonic() - t0)
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    if during is not None:
        time.sleep(delay)
        during()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def kill_when_busy(proc, url, at_least=3) -> None:
    """Kills the server once it has ``at_least`` requests in flight (prefilling, or their
    KV held for a transfer): a fixed delay misses them all on a fast CPU."""
    def in_flight() -> float:
        text = requests.get(url + "/metrics", timeout=10).text
        return sum(metric_value(text, name) for name in ("num_requests_running",
                                                         "num_requests_waiting",
                                                         "kv_blocks_held"))
    deadline = time.monotonic() + 30
    while in_flight() < at_least:
        assert time.monotonic() < deadline, "the server never had requests in flight"
        time.sleep(0.01)
    kill_server(proc)


def test_a_prefill_instance_killed_mid_run(pd):
    """Requests in flight through a P that dies are computed by D (both orders: the proxy's
    --on-prefill-failure recompute, D's kv_failure_policy recompute): every answer is the
    colocated one; the dead P leaves the rotation; nothing leaks on D."""
    u, procs = pd["urls"], pd["procs"]
    proc, px = start_server(pd["tmp"], pd["model"], section=kv_section("kv_producer"),
                            agent_ports=(free_port(),))[:2]
    try:
        proxies = {order: procs.proxy([px], [u["D"]], "--order", order)[1]
                   for order in ("p-first", "d-first")}
        bodies = [{"model": "tiny", "prompt": f"{i} {LONG}", "max_tokens": 16,
                   "temperature": 0, "ignore_eos": True} for i in range(12)]
        refs = [requests.post(u["C"] + "/v1/completions", json=b, timeout=60).json()
                for b in bodies]
        calls = [lambda b=b, o=o: requests.post(proxies[o] + "/v1/completions", json=b,
                                                timeout=80)
                 for b in bodies for o in proxies]
        fallbacks0 = metric(u["D"], "kv_transfer_recomputes_total")
        results = run_concurrently(calls, during=lambda: kill_when_busy(proc, px), delay=0)
    finally:
        if proc.poll() is None:
            kill_server(proc)
    wrong = []
    for (r, took), ref in zip(results, [x for x in refs for _ in proxies]):
        assert not isinstance(r, Exception), r
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["text"] != ref["choices"][0]["text"]:
            wrong.append((r.json()["choices"][0]["text"], ref["choices"][0]["text"]))
        assert took < 60
    # P died with work in flight: D computed some prompts (its hook or its failed read),
    # or the proxy sent them to D without P's params.
    fallbacks = sum(proxy_metric(p, "prefill_fallbacks_total") for p in proxies.values())
    assert metric(u["D"], "kv_transfer_recomputes_total") - fallbacks0 + fallbacks >= 1
    for proxy in proxies.values():     # out of rotation by the next health check (0.5 s)
        wait_until(lambda: proxy_metric(proxy, "instance_up", role="prefill", url=px) == 0,
                   timeout=10)
        # D computes prompts meanwhile: the proxy stays healthy, prefill degraded
        r = requests.get(proxy + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
    pools_empty(u["D"])
    # Every answer is the colocated one (a read from the dying P is failed and recomputed,
    # never used with regions missing: test_mooncake_p2p.py).
    assert not wrong, f"{len(wrong)} answer(s) differ from the colocated ones: {wrong[:2]!r}"


def test_a_decode_instance_killed_mid_run(pd):
    """Requests on a D that dies fail with a clear error (502, or an error event in a
    stream) and none hangs; the others are served by the live D; P frees the blocks it
    held for the dead D after kv_transfer_timeout."""
    u, procs = pd["urls"], pd["procs"]
    proc, dx = start_server(pd["tmp"], pd["model"], section=kv_section("kv_consumer"),
                            agent_ports=(free_port(),))[:2]
    try:
        proxy = procs.proxy([u["P"]], [dx, u["D"]])[1]
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0,
                               timeout=80)

        started = threading.Semaphore(0)

        def stream(i):
            chunks = client.completions.create(model="tiny", prompt=f"{i} {PROMPTS[0]}",
                                               max_tokens=900, stream=True,
                                               extra_body={"ignore_eos": True})
            text = []
            for c in chunks:
                if not text:
                    started.release()
                text.append(c.choices[0].text if c.choices else "")
            return "".join(text)

        def kill_when_all_stream():
            for _ in range(6):
                started.acquire(timeout=30)
            kill_server(proc)
        results = run_concurrently([lambda i=i: stream(i) for i in range(6)],
                                   during=kill_when_all_stream, delay=0)
    finally:
        if proc.poll() is None:
            kill_server(proc)
    failed = [r for r, _ in results if isinstance(r, Exception)]
    served = [r for r, _ in results if not isinstance(r, Exception)]
    assert failed and served          # round-robin: half were on the dead D
    for e in failed:                  # the openai client raises on an error event
        assert dx in str(e), e
    assert all(took < 60 for _, took in results)
    # The proxy serves on with the live D; P's offers to the dead D expire (5 s).
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    for _ in range(2):
        r = requests.post(proxy + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    pools_empty(u["P"], u["D"])


def test_the_first_d_hook_on_a_consumer(pd):
    """D given remote_prefill_url asks that P itself; an unreachable P is recomputed (D's
    kv_failure_policy) and counted; a bad URL, or an instance without kv_transfer, is a 400
    naming kv_transfer_params."""
    u = pd["urls"]
    body = {"model": "tiny", "prompt": fresh(PROMPTS[0], "first D"), "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    ref = requests.post(u["C"] + "/v1/completions", json=body, timeout=60).json()
    done0 = metric(u["D"], 'kv_transfers_total{outcome="done"}')
    failed0 = metric(u["D"], 'kv_transfers_total{outcome="failed"}')
    recomputes0 = metric(u["D"], "kv_transfer_recomputes_total")

    def ask(url, body=body):
        return requests.post(u["D"] + "/v1/completions", timeout=60, json={
            **body, "kv_transfer_params": {"do_remote_prefill": True,
                                           "remote_prefill_url": url}})
    r = ask(u["P"])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert metric(u["D"], 'kv_transfers_total{outcome="done"}') == done0 + 1
    other = {**body, "prompt": fresh(PROMPTS[1], "first D")}     # not in D's prefix cache
    ref = requests.post(u["C"] + "/v1/completions", json=other, timeout=60).json()
    t0 = time.monotonic()
    r = ask(f"http://127.0.0.1:{free_port()}", other)          # nobody listens there
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert time.monotonic() - t0 < 10
    assert metric(u["D"], 'kv_transfers_total{outcome="failed"}') == failed0 + 1
    assert metric(u["D"], "kv_transfer_recomputes_total") == recomputes0 + 1
    r = ask("file:///etc/passwd")
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = requests.post(u["C"] + "/v1/completions", timeout=60, json={
        **body, "kv_transfer_params": {"do_remote_prefill": True,
                                       "remote_prefill_url": u["P"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    pools_empty(u["P"], u["D"])


def test_the_d_first_hooks_client_is_closed_at_shutdown():
    """A consumer's client to its producers (made on its first d-first request) is closed
    when the server shuts down, with its connections."""
    from llm_serving.config import EngineArgs
    from llm_serving.entrypoints import remote_prefill
    from llm_serving.entrypoints.api_server import build_app
    from llm_serving.entrypoints.http_common import ServerState

    app = build_app(ServerState(EngineArgs(model="tiny"), "tiny"), load=False)

    async def serve_then_stop():
        async with app.router.lifespan_context(app):
            client = remote_prefill.producer_client(app)
            assert remote_prefill.producer_client(app) is client and not client.is_closed
        return client
    assert asyncio.run(serve_then_stop()).is_closed
