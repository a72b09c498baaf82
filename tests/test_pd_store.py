"""The pool connector (MooncakeStoreConnector) between real servers: the test starts its own
``mooncake_master`` on free ports. A second instance serves a prompt the first has prefilled
without computing it (counted in /metrics), with the same greedy output as a colocated
engine; the P-then-D flow works unchanged; with the master gone requests are computed
locally, never hang. Needs the ``pd`` extra (CI installs it with ``.[test]``)."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import requests

from llm_serving import SamplingParams
from test_http_server import free_port, start_server, stop_server
from test_pd_proxy_routing import Procs
from conftest import metric

PROMPT = ("Give three tips for staying healthy, then explain each of them in a few words, "
          "and finish with a short summary.")


@pytest.fixture(scope="module")
def master():
    exe = shutil.which("mooncake_master")
    assert exe, "mooncake_master is missing: pip install -e '.[pd]'"
    port = free_port()
    proc = subprocess.Popen([exe, f"--port={port}", "--enable_http_metadata_server=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    import socket
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "no mooncake_master"
            time.sleep(0.1)
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir, master):
    """A is set up in our terms; B as vLLM's MooncakeStoreConnector guide sets up an instance:
    vLLM's keys on the command line's JSON and the store's settings in the JSON file that
    MOONCAKE_CONFIG_PATH names (sizes with units)."""
    tmp = tmp_path_factory.mktemp("pool")
    started = {}
    a_section = "kv_transfer: " + json.dumps({
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
        "kv_transfer_timeout": 5,
        "kv_connector_extra_config": {"master_server_address": master[1],
                                      "global_segment_size": 64 << 20}}) + "\n"
    store_file = tmp / "mooncake_config.json"
    store_file.write_text(json.dumps({
        "mode": "embedded", "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master[1], "global_segment_size": "64MB",
        "local_buffer_size": "16MB", "protocol": "tcp", "device_name": ""}))
    b_flag = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                         "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
                         "kv_transfer_timeout": 5})
    try:
        started["A"] = start_server(tmp, tiny_model_dir, section=a_section,
                                    agent_ports=(free_port(),))
        started["B"] = start_server(tmp, tiny_model_dir, "--kv-transfer-config", b_flag,
                                    agent_ports=(free_port(),),
                                    env={"MOONCAKE_CONFIG_PATH": str(store_file)})
        yield {name: s[1] for name, s in started.items()}
    finally:
        codes = {name: stop_server(s[0]) for name, s in started.items()}
    assert codes == {"A": 0, "B": 0}


def complete(url, prompt, n=10, **extra):
    r = requests.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_second_instance_skips_the_prefill_another_one_did(pool, tiny_llm):
    ref = tiny_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10,
                                                   ignore_eos=True))[0]
    n_prompt = len(ref.prompt_token_ids)
    a = complete(pool["A"], PROMPT)
    assert a["choices"][0]["text"] == ref.outputs[0].text
    names = ("prompt_tokens_total", "kv_remote_prefill_tokens_total",
             'prompt_tokens_by_source_total{source="local_compute"}',
             'prompt_tokens_by_source_total{source="external_kv_transfer"}',
             "prompt_tokens_cached_total",
             'prompt_tokens_cached_by_source_total{source="p2p"}',
             "external_prefix_cache_queries_total", "external_prefix_cache_hits_total")
    before = [metric(pool["B"], name) for name in names]
    b = complete(pool["B"], PROMPT)
    assert b["choices"][0]["text"] == ref.outputs[0].text
    prompt, loaded, computed, external, cached, p2p, queried, hit = (
        metric(pool["B"], name) - b0 for name, b0 in zip(names, before))
    assert loaded == 16 * ((n_prompt - 1) // 16) > 0      # every full block but the last token's
    assert computed == n_prompt - loaded                     # only the rest was computed
    assert prompt == n_prompt and external == cached == loaded   # as vLLM's /metrics has it
    assert p2p == loaded                # vLLM's tier of KV from another instance
    # vLLM's connector lookup: the prompt's tokens not cached here, and those loaded
    assert (queried, hit) == (n_prompt, loaded)
    assert metric(pool["B"], 'kv_transfers_total{outcome="done"}') >= 1
    assert metric(pool["B"], "kv_transfer_bytes_total") > 0
    assert metric(pool["A"], "kv_cache_usage_perc") == 0
    assert metric(pool["B"], "kv_cache_usage_perc") == 0


def test_a_salted_prompt_loads_only_its_own_salts_kv(pool):
    """vLLM's cache_salt holds over the pool too: B loads what A stored under the same salt,
    nothing of another salt's."""
    prompt = "Salted: " + PROMPT
    name = "kv_remote_prefill_tokens_total"
    complete(pool["A"], prompt, cache_salt="tenant-1")
    before = metric(pool["B"], name)
    complete(pool["B"], prompt, cache_salt="tenant-2")
    assert metric(pool["B"], name) == before
    complete(pool["B"], prompt, cache_salt="tenant-1")
    assert metric(pool["B"], name) > before


def test_p_then_d_works_unchanged_over_the_pool(pool, tiny_llm):
    prompt = PROMPT.replace("three", "four")
    ref = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True))[0].outputs[0].text
    p = complete(pool["A"], prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = p["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["kv_pool"]
    loaded0 = metric(pool["B"], "kv_remote_prefill_tokens_total")
    d = complete(pool["B"], prompt, 8, kv_transfer_params=params)
    assert d["choices"][0]["text"] == ref
    assert metric(pool["B"], "kv_remote_prefill_tokens_total") > loaded0


@pytest.mark.parametrize("order", ["p-first", "d-first"])
def test_greedy_outputs_through_the_proxy_over_the_pool_match_colocated(pool, tiny_llm,
                                                                         order):
    """``llm-serving proxy`` with A as P and B as D over the pool, both orders: the answers,
    plain and streamed, are the colocated engine's token for token, and B loaded the KV."""
    procs = Procs()
    try:
        proxy = procs.proxy([pool["A"]], [pool["B"]], "--order", order)[1]
        for stream in (False, True):
            prompt = f"{order} {stream}: {PROMPT} {PROMPT}"
            ref = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                           ignore_eos=True, logprobs=0))[0]
            loaded0 = metric(pool["B"], "kv_remote_prefill_tokens_total")
            r = requests.post(proxy + "/v1/completions", timeout=60, stream=stream, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": stream})
            assert r.status_code == 200, r.text
            choices = ([json.loads(x[6:])["choices"] for x in r.iter_lines(decode_unicode=True)
                        if x.startswith("data: {")] if stream else [r.json()["choices"]])
            choices = [c[0] for c in choices if c]
            assert "".join(c["text"] for c in choices) == ref.outputs[0].text
            np.testing.assert_allclose(
                [x for c in choices for x in c["logprobs"]["token_logprobs"]],
                [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs,
                                                ref.outputs[0].token_ids)], atol=1e-5)
            n_prompt = len(ref.prompt_token_ids)
            assert metric(pool["B"], "kv_remote_prefill_tokens_total") - loaded0 == \
                16 * ((n_prompt - 1) // 16) > 16
    finally:
        procs.close()
    assert metric(pool["B"], "kv_cache_usage_perc") == 0


def test_with_the_master_gone_requests_are_computed_here_without_hanging(pool, master,
                                                                         tiny_llm):
    prompt = PROMPT.replace("healthy", "awake")
    ref = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True))[0].outputs[0].text
    proc, _ = master
    proc.terminate()
    proc.wait(10)
    before = metric(pool["B"], "kv_transfer_recomputes_total")
    t0 = time.monotonic()
    out = complete(pool["B"], prompt, 6)
    assert time.monotonic() - t0 < 15
    assert out["choices"][0]["text"] == ref
    assert metric(pool["B"], "kv_transfer_recomputes_total") == before + 1
    assert metric(pool["B"], 'kv_transfers_total{outcome="failed"}') >= 1
    assert requests.get(pool["B"] + "/health", timeout=5).status_code == 200


def test_with_the_master_gone_a_producer_skips_its_puts_instead_of_stalling(pool, master):
    """A producer puts the blocks of every prefill, and with its master gone the store's client
    retries each put for seconds (about 4), in the step. After the first failure the puts are
    skipped until the master accepts a connection again: the prefills go on at their speed."""
    proc, _ = master
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)
    complete(pool["A"], "first: " + PROMPT, 2)     # its put finds the master gone
    t0 = time.monotonic()
    for i in range(4):
        complete(pool["A"], f"{i}: {PROMPT}", 2)
    assert time.monotonic() - t0 < 8


class _SlowStore:
    """A store client whose lookups wait for ``answer`` (a slow or hung master)."""

    def __init__(self):
        self.answer = threading.Event()
        self.calls = 0

    def batch_is_exist(self, keys):
        self.calls += 1
        self.answer.wait(30)
        return [1] * len(keys)


def test_the_store_lookup_never_blocks_the_scheduler(monkeypatch):
    """The scheduler side asks the store off its thread: "not known yet" at once while the
    master is slow, the answer when it comes (asked once, reused), and a lookup the master
    never answers fails after LOOKUP_TIMEOUT_S, then the store is left alone for a while."""
    from types import SimpleNamespace

    from llm_serving.distributed.kv_transfer import mooncake_store_connector as msc
    from llm_serving.distributed.kv_transfer.base import KVConnectorRole, KVTransferError
    from llm_serving.distributed.kv_transfer.config import KVTransferConfig
    monkeypatch.setattr(msc, "LOOKUP_TIMEOUT_S", 0.5)
    cfg = KVTransferConfig.from_dict({"kv_connector": "MooncakeStoreConnector",
                                      "kv_role": "kv_both", "kv_connector_extra_config": {
                                          "master_server_address": "127.0.0.1:1"}})
    conn = msc.MooncakeStoreConnector(cfg, KVConnectorRole.SCHEDULER, 16)
    conn.client = store = _SlowStore()
    req = SimpleNamespace(request_id="r1", prompt_token_ids=list(range(50)),
                          kv_transfer_params=None)
    t0 = time.monotonic()
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert time.monotonic() - t0 < 0.2                 # the scheduler did not wait
    store.answer.set()
    deadline = time.monotonic() + 5
    while conn.get_num_new_matched_tokens(req, 0) == (None, False):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert conn.get_num_new_matched_tokens(req, 0) == (48, True)    # 3 full blocks
    assert store.calls == 1

    store.answer.clear()                               # the master hangs now
    hung = SimpleNamespace(request_id="r2", prompt_token_ids=list(range(40)),
                           kv_transfer_params=None)
    assert conn.get_num_new_matched_tokens(hung, 0) == (None, False)
    aborted = SimpleNamespace(request_id="r4", prompt_token_ids=list(range(40)),
                              kv_transfer_params=None)
    assert conn.get_num_new_matched_tokens(aborted, 0) == (None, False)    # queued behind
    conn.forget(aborted)                               # the client went away
    time.sleep(0.6)
    with pytest.raises(KVTransferError, match="did not answer"):
        conn.get_num_new_matched_tokens(hung, 0)
    with pytest.raises(KVTransferError, match="not asked"):    # backoff: fails at once
        conn.get_num_new_matched_tokens(SimpleNamespace(
            request_id="r3", prompt_token_ids=list(range(40)), kv_transfer_params=None), 0)
    store.answer.set()
    time.sleep(0.3)
    assert store.calls == 2            # r2's; the aborted request's lookup was never sent
    conn.shutdown()
