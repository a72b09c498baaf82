"""vLLM's run-time adapter routes: with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true,
/v1/load_lora_adapter serves an adapter by name (the next request with that model runs with
it), load_inplace replaces it, /v1/unload_lora_adapter stops serving it; bad requests are
4xx naming the field. Without the variable the routes do not exist, as in vLLM."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import openai
import pytest
import requests

from lora_adapters import hf_logits_and_greedy, make_adapter, merged_hf_model
from test_http_server import stop_server
from test_lora_server import serve

pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW = 12
PROMPT = np.random.default_rng(12).integers(3, 1024, 20).tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-adapters")
    return {"c": make_adapter(str(root / "c"), tiny_model_dir, r=8, alpha=16, seed=21),
            "d": make_adapter(str(root / "d"), tiny_model_dir, r=4, alpha=4, seed=22,
                              targets=("o_proj", "down_proj"))}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    return {name: hf_logits_and_greedy(merged_hf_model(tiny_model_dir, path), PROMPT, NEW)[1]
            for name, path in adapters.items()}


@pytest.fixture(scope="module")
def runtime_server(tiny_model_dir):
    proc, url = serve(tiny_model_dir, "--served-model-name", "tiny", "--enable-lora",
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


def _tokens(url, model):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                            "min_tokens": NEW})
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def _post(url, route, **body):
    return requests.post(f"{url}/v1/{route}", json=body, timeout=60)


def test_load_use_replace_unload(runtime_server, adapters, reference):
    url = runtime_server
    r = _post(url, "load_lora_adapter", lora_name="c", lora_path=adapters["c"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    models = requests.get(url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("c", "tiny")]
    assert _tokens(url, "c") == reference["c"]
    # a name in use needs load_inplace
    r = _post(url, "load_lora_adapter", lora_name="c", lora_path=adapters["d"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert "already been loaded" in r.json()["error"]["message"]
    r = _post(url, "load_lora_adapter", lora_name="c", lora_path=adapters["d"],
              load_inplace=True)
    assert r.status_code == 200
    assert _tokens(url, "c") == reference["d"]          # not c's cached KV
    r = _post(url, "unload_lora_adapter", lora_name="c")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        _tokens(url, "c")
    r = _post(url, "unload_lora_adapter", lora_name="c")
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


def test_bad_loads_are_refused_naming_the_field(runtime_server, tiny_model_dir, tmp_path):
    url = runtime_server
    r = _post(url, "load_lora_adapter", lora_name="x", lora_path=str(tmp_path / "none"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "not a directory" in r.json()["error"]["message"]
    big = make_adapter(str(tmp_path / "big"), tiny_model_dir, r=32, seed=23)
    r = _post(url, "load_lora_adapter", lora_name="big", lora_path=big)
    assert r.status_code == 400 and "greater than max_lora_rank 16" in r.json()["error"]["message"]
    r = _post(url, "load_lora_adapter", lora_name="tiny", lora_path=big)
    assert r.status_code == 400 and "conflicts with a served base model" in r.text
    r = _post(url, "load_lora_adapter", lora_name="", lora_path=big)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert "x" not in [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]]


def test_routes_need_the_variable(tiny_model_dir, adapters):
    proc, url = serve(tiny_model_dir, "--enable-lora")
    try:
        r = _post(url, "load_lora_adapter", lora_name="c", lora_path=adapters["c"])
        assert r.status_code == 404
    finally:
        assert stop_server(proc) == 0


def _stream_tokens(url, model, max_tokens):
    """A streamed greedy completion of PROMPT: its open response and a generator of its
    events (token ids per chunk, the finish reason, or the error)."""
    r = requests.post(url + "/v1/completions", stream=True, timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "min_tokens": max_tokens, "stream": True, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200

    def events():
        for line in r.iter_lines():
            if not line or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                yield "error", event["error"]["message"]
                continue
            choice = event["choices"][0]
            yield "tokens", [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
            if choice["finish_reason"]:
                yield "finish", choice["finish_reason"]
    return r, events()


def test_an_adapter_gone_after_loading_still_runs_and_then_fails_its_own_requests_only(
        runtime_server, adapters, reference, tiny_model_dir, tmp_path):
    """The WorkAgent reads an adapter when it is loaded (as vLLM's workers do): removing its
    directory after the load's answer does not stop it from serving. Once the agent has
    dropped it (max_cpu_loras is 1 here: another adapter loaded), its next request needs the
    directory, and fails alone: a base-model request in the same steps streams on to its end
    with the base model's tokens, while the adapter's request ends with one line naming the
    path (the traceback goes to the server's log only). Then the name is a 400 naming the
    path while the directory is gone, and once it is back the name serves the adapter's own
    tokens (not KV computed without it while it was gone)."""
    url = runtime_server
    base = hf_logits_and_greedy(merged_hf_model(tiny_model_dir), PROMPT, NEW)[1]
    gone = tmp_path / "gone"
    shutil.copytree(adapters["c"], gone)
    assert _post(url, "load_lora_adapter", lora_name="gone", lora_path=str(gone)).ok
    shutil.rmtree(gone)
    assert _tokens(url, "gone") == reference["c"]
    assert _post(url, "load_lora_adapter", lora_name="other", lora_path=adapters["d"]).ok
    r, events = _stream_tokens(url, "tiny", 300)
    with r:
        got = list(next(events)[1])                  # the base request is running ...
        _, lora_events = _stream_tokens(url, "gone", NEW)   # ... when the adapter's starts
        errors = [v for k, v in lora_events if k == "error"]
        assert len(errors) == 1, errors
        assert str(gone) in errors[0] and "Traceback" not in errors[0]
        assert "\n" not in errors[0]
        rest = list(events)
    got += [t for k, v in rest if k == "tokens" for t in v]
    assert ("finish", "length") in rest and not [v for k, v in rest if k == "error"]
    assert len(got) == 300 and got[:NEW] == base
    r = requests.post(url + "/v1/completions", timeout=60,
                      json={"model": "gone", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert str(gone) in r.json()["error"]["message"]
    shutil.copytree(adapters["c"], gone)
    assert _tokens(url, "gone") == reference["c"]
    for name in ("gone", "other"):
        assert _post(url, "unload_lora_adapter", lora_name=name).ok


def test_an_adapter_with_unreadable_weights_is_refused_when_loaded(runtime_server, adapters,
                                                                   tmp_path):
    """Weights that cannot be read (a truncated file: its header is whole) are a 400 naming
    lora_path at load time, not a failure of the first step that runs the adapter."""
    url = runtime_server
    cut = tmp_path / "cut"
    shutil.copytree(adapters["c"], cut)
    weights = cut / "adapter_model.safetensors"
    os.truncate(weights, weights.stat().st_size - 64)
    r = _post(url, "load_lora_adapter", lora_name="cut", lora_path=str(cut))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "truncated" in r.json()["error"]["message"]
    models = requests.get(url + "/v1/models", timeout=10).json()["data"]
    assert "cut" not in [m["id"] for m in models]
