"""LoRA adapters through the HTTP server, as vLLM serves them: ``--enable-lora
--lora-modules`` (vLLM's name=path and JSON forms), a request whose model is an adapter's
name runs with it (completions, chat, llm-serving's generate), /v1/models lists the adapters
with the base model as parent, an unknown model keeps its 404, and a bad adapter stops the
start naming --lora-modules. The reference is HF transformers with the adapter merged."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
import requests

from lora_adapters import hf_logits_and_greedy, make_adapter, merged_hf_model
from test_http_server import ROOT, free_port, serve_model, stop_server

pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW = 16
PROMPT = np.random.default_rng(11).integers(3, 1024, 30).tolist()


_served = itertools.count()


def serve(model_dir, *flags, env=None):
    """A server of ``model_dir`` with ``flags`` (``--model``, no config file); its process
    and URL. Its port is a free one, or with LLM_SERVING_TEST_PORT=P the next of P, P + 1 ...
    (a machine whose tests must keep to a port range)."""
    base = os.environ.get("LLM_SERVING_TEST_PORT")
    port = int(base) + next(_served) if base else free_port()
    return serve_model(model_dir, *flags, port=port, env=env)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(str(root / "a"), tiny_model_dir, r=8, alpha=16, seed=1),
            "b": make_adapter(str(root / "b"), tiny_model_dir, r=4, alpha=8, seed=2,
                              targets=("q_proj", "v_proj"), rslora=True)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    return {name: hf_logits_and_greedy(
        merged_hf_model(tiny_model_dir, adapters[name] if name else None), PROMPT, NEW)[1]
        for name in (None, "a", "b")}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters):
    b = json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "tiny"})
    proc, url = serve(tiny_model_dir, "--served-model-name", "tiny", "--enable-lora",
                      "--max-loras", "2", "--lora-modules", f"a={adapters['a']}", b)
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


def _tokens(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW,
                                    temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True,
                                                "min_tokens": NEW})
    return out, [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def test_models_lists_the_adapters_with_their_parent(lora_server, adapters):
    data = requests.get(lora_server + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("a", "tiny"),
                                                      ("b", "tiny")]
    assert data[1]["root"] == adapters["a"]


def test_model_name_picks_the_adapter(lora_server, reference):
    client = openai.OpenAI(base_url=lora_server + "/v1", api_key="none")
    for name in ("a", "b", "tiny", "a"):
        out, tokens = _tokens(client, name)
        assert out.model == name
        assert tokens == reference[None if name == "tiny" else name], name
    assert reference["a"] != reference[None]


def test_chat_and_generate_route_the_adapter(lora_server):
    client = openai.OpenAI(base_url=lora_server + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Hello there"}]
    base = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                          temperature=0)
    lora = client.chat.completions.create(model="a", messages=msgs, max_tokens=8,
                                          temperature=0)
    again = client.chat.completions.create(model="a", messages=msgs, max_tokens=8,
                                           temperature=0)
    assert lora.model == "a" and base.model == "tiny"
    assert lora.choices[0].message.content == again.choices[0].message.content
    assert lora.choices[0].message.content != base.choices[0].message.content
    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 8}}
    texts = [requests.post(f"{lora_server}/models/{m}/generate", json=body,
                           timeout=60).json()["generated_text"] for m in ("tiny", "a")]
    assert texts[0] != texts[1]


def test_unknown_model_is_still_404(lora_server):
    client = openai.OpenAI(base_url=lora_server + "/v1", api_key="none")
    with pytest.raises(openai.NotFoundError, match="model 'c' does not exist"):
        client.completions.create(model="c", prompt="Hi", max_tokens=2)


def test_bad_lora_module_stops_the_start(tiny_model_dir, tmp_path):
    big = make_adapter(str(tmp_path / "big"), tiny_model_dir, r=32, seed=3)
    cut = make_adapter(str(tmp_path / "cut"), tiny_model_dir, r=8, seed=4)
    weights = os.path.join(cut, "adapter_model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 64)     # its header is whole
    for module, said in ((f"x={tmp_path / 'none'}", "not a directory"),
                         (f"big={big}", "LoRA rank 32 is greater than max_lora_rank 16"),
                         (f"cut={cut}", "cannot read the adapter's weights")):
        run = subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                              "--enable-lora", "--lora-modules", module, "--dry-run"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0
        assert "lora_modules: adapter" in run.stderr and said in run.stderr, run.stderr[-500:]


def _lora_info(url) -> dict:
    """vLLM's lora_requests_info series: (running, waiting, max_lora) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(url + "/metrics", timeout=10).text
    return {(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"],
             s.labels["max_lora"]): s.value
            for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
            for s in f.samples}


def test_metrics_name_the_running_adapters(lora_server):
    """A vLLM dashboard reads vllm:lora_requests_info{max_lora, running_lora_adapters,
    waiting_lora_adapters}; the series last set names the adapters running now."""
    body = {"model": "a", "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with requests.post(lora_server + "/v1/completions", json=body, stream=True,
                       timeout=120) as r:
        lines = r.iter_lines()         # kept: closing it would close the connection
        next(lines)                    # the request runs now
        during = _lora_info(lora_server)
    assert during and max(during, key=during.get) == ("a", "", "2"), during
    for _ in range(100):                               # the aborted stream leaves the batch
        after = _lora_info(lora_server)
        if max(after, key=after.get)[0] == "":
            break
        time.sleep(0.1)
    assert max(after, key=after.get) == ("", "", "2"), after
