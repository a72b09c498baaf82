"""The pool connector (MooncakeStoreConnector) between real servers: the test starts its own
``mooncake_master`` on free ports. A second instance serves a prompt the first has prefilled
without computing it (counted in /metrics), with the same greedy output as a colocated
engine; the P-then-D flow works unchanged; with the master gone requests are computed
locally, never hang. Needs the ``pd`` extra (CI installs it with ``.[test]``)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
import requests

from llm_serving import SamplingParams
from test_http_server import free_port, start_server, stop_server

PROMPT = ("Give three tips for staying healthy, then explain each of them in a few words, "
          "and finish with a short summary.")


def metric(url, name) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^llm_serving:{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


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
    tmp = tmp_path_factory.mktemp("pool")
    started = {}

    def section(role):
        return "kv_transfer: " + json.dumps({
            "kv_connector": "MooncakeStoreConnector", "kv_role": role,
            "kv_transfer_timeout": 5,
            "kv_connector_extra_config": {"master_server_address": master[1],
                                          "global_segment_size": 64 << 20}}) + "\n"
    try:
        for name, role in (("A", "kv_both"), ("B", "kv_both")):
            started[name] = start_server(tmp, tiny_model_dir, section=section(role),
                                         agent_ports=(free_port(),))
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
    computed0 = metric(pool["B"], "prompt_tokens_total")
    loaded0 = metric(pool["B"], "kv_remote_prefill_tokens_total")
    b = complete(pool["B"], PROMPT)
    assert b["choices"][0]["text"] == ref.outputs[0].text
    loaded = metric(pool["B"], "kv_remote_prefill_tokens_total") - loaded0
    computed = metric(pool["B"], "prompt_tokens_total") - computed0
    assert loaded == 16 * ((n_prompt - 1) // 16) > 0      # every full block but the last token's
    assert computed == n_prompt - loaded                     # only the rest was computed
    assert metric(pool["B"], 'kv_transfers_total{outcome="done"}') >= 1
    assert metric(pool["B"], "kv_transfer_bytes_total") > 0
    assert metric(pool["A"], "kv_cache_usage_perc") == 0
    assert metric(pool["B"], "kv_cache_usage_perc") == 0


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
