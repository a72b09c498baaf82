"""POST /v1/embeddings on the real server (start.py --runner pooling, the model in a
WorkAgent) with the `openai` client, against HF transformers' mean-pooled last_hidden_state;
bad fields are a 400 naming them; the generation routes answer 404 there, and
/v1/embeddings answers 404 on a generate server."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import time

import numpy as np
import openai
import pytest
import requests

from llm_serving.executor.shm_channel import segments_of
from test_http_server import free_port, serve_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors", "a"]


def _port(offset: int = 0) -> int:
    """LLM_SERVING_TEST_PORT (+ offset) when set (a shared machine's range), else a free one."""
    if os.environ.get("LLM_SERVING_TEST_PORT"):
        return int(os.environ["LLM_SERVING_TEST_PORT"]) + offset
    return free_port()


def _start(model_dir: str, *flags: str, port: int):
    return serve_model(model_dir, *flags, port=port, num_blocks=128, timeout=180)


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not segments_of(proc.pid), "the server left shared memory behind"


@contextlib.contextmanager
def served(model_dir: str, *flags: str, port: int):
    """The URL of a server of ``model_dir`` with ``flags``, stopped (and checked to have
    freed its shared memory) at the end."""
    proc, url = _start(model_dir, *flags, port=port)
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def pooling_server(tiny_model_dir):
    with served(tiny_model_dir, "--runner", "pooling", "--pooler-config",
                json.dumps({"pooling_type": "MEAN"}), port=_port()) as url:
        yield url


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    model = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            v = model(torch.tensor([ids])).last_hidden_state[0].mean(0).double().numpy()
        return v / np.linalg.norm(v)
    return tok, embed


def _model(url: str) -> str:
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_openai_client_embeddings_match_hf(pooling_server, hf):
    tok, embed = hf
    client = openai.OpenAI(base_url=pooling_server + "/v1", api_key="none")
    name = _model(pooling_server)
    out = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.object == "list" and out.model == name
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for d, x in zip(out.data, ids):
        assert d.object == "embedding" and len(d.embedding) == 64
        np.testing.assert_allclose(d.embedding, embed(x), atol=5e-4, rtol=0)
    # one string; token ids, one list and a list of lists
    one = client.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, out.data[0].embedding, atol=1e-5)
    by_ids = client.embeddings.create(model=name, input=ids, encoding_format="float")
    for a, b in zip(by_ids.data, out.data):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
    # an empty text is its BOS token alone, as vLLM embeds it
    empty = client.embeddings.create(model=name, input=["", TEXTS[2]], encoding_format="float")
    np.testing.assert_allclose(empty.data[0].embedding, embed(tok("")["input_ids"]), atol=5e-4)
    single = client.embeddings.create(model=name, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, out.data[1].embedding, atol=1e-5)
    # the client's default asks for base64 and decodes it itself
    default = client.embeddings.create(model=name, input=TEXTS)
    for a, b in zip(default.data, out.data):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-7)


def test_base64_is_little_endian_float32(pooling_server):
    body = {"input": TEXTS[:2], "encoding_format": "base64", "user": "u1"}
    b64 = requests.post(pooling_server + "/v1/embeddings", json=body, timeout=60).json()
    floats = requests.post(pooling_server + "/v1/embeddings", json={"input": TEXTS[:2]},
                           timeout=60).json()
    for a, b in zip(b64["data"], floats["data"]):
        assert isinstance(a["embedding"], str)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(a["embedding"]), "<f4"),
                                      np.asarray(b["embedding"], np.float32))


def test_truncate_prompt_tokens(pooling_server, hf):
    _, embed = hf
    ids = list(range(3, 40))
    post = lambda body: requests.post(pooling_server + "/v1/embeddings",   # noqa: E731
                                      json={"input": ids, **body}, timeout=60).json()
    left = post({"truncate_prompt_tokens": 5, "truncation_side": "left"})
    right = post({"truncate_prompt_tokens": 5, "truncation_side": "right"})
    assert left["usage"]["prompt_tokens"] == right["usage"]["prompt_tokens"] == 5
    np.testing.assert_allclose(left["data"][0]["embedding"], embed(ids[-5:]), atol=5e-4)
    np.testing.assert_allclose(right["data"][0]["embedding"], embed(ids[:5]), atol=5e-4)


CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
         [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]]


def test_chat_conversations_embed_as_their_template_renders_them(pooling_server, hf):
    """vLLM 0.32's chat forms: messages (one conversation, or a list of them: one embedding
    each, in order) or a conversation in input, rendered by the chat template without the
    generation prompt unless asked, no BOS added on top of the template's."""
    tok, embed = hf
    url = pooling_server + "/v1/embeddings"

    def ids(chat, **kw):
        return tok.apply_chat_template(chat, tokenize=True, return_dict=False, **kw)

    def post(body):
        r = requests.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    one = post({"messages": CHATS[0]})
    assert one["usage"]["prompt_tokens"] == len(ids(CHATS[0]))
    np.testing.assert_allclose(one["data"][0]["embedding"], embed(ids(CHATS[0])), atol=5e-4)
    batch = post({"messages": CHATS})
    assert [d["index"] for d in batch["data"]] == [0, 1]
    assert batch["usage"]["prompt_tokens"] == sum(len(ids(c)) for c in CHATS)
    for d, chat in zip(batch["data"], CHATS):
        np.testing.assert_allclose(d["embedding"], embed(ids(chat)), atol=5e-4)
    single = post({"input": CHATS[1]})["data"]          # the same, given as input
    assert len(single) == 1
    np.testing.assert_allclose(single[0]["embedding"], batch["data"][1]["embedding"], atol=1e-5)
    both = post({"input": CHATS})["data"]
    assert len(both) == 2
    for a, b in zip(both, batch["data"]):
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
    asked = post({"messages": CHATS[0], "add_generation_prompt": True,
                  "add_special_tokens": True, "truncate_prompt_tokens": 6})
    want = tok("", add_special_tokens=True)["input_ids"] + ids(CHATS[0],
                                                               add_generation_prompt=True)
    np.testing.assert_allclose(asked["data"][0]["embedding"], embed(want[:6]), atol=5e-4)
    # the openai client sends a conversation as input too
    client = openai.OpenAI(base_url=pooling_server + "/v1", api_key="none")
    out = client.embeddings.create(model=_model(pooling_server), input=CHATS[0],
                                   encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, one["data"][0]["embedding"], atol=1e-5)


@pytest.mark.parametrize("body, field", [
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "hi", "endianness": "big"}, "endianness"),
    ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [[{"role": "user", "content": "x"}], []]}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),      # a request's own template needs --trust-request-chat-template
    ({"messages": [{"role": "user", "content": "x"}], "media_io_kwargs": {"image": {}}},
     "media_io_kwargs"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": "hi", "normalize": True}, "normalize"),
    ({"input": [5, 99999]}, "input"),
    ({"input": "hi", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    ({"input": 3}, "input"),
])
def test_bad_fields_are_a_400_naming_them(pooling_server, body, field):
    r = requests.post(pooling_server + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or err["message"].startswith(field), err


def test_generation_routes_are_not_served_on_a_pooling_server(pooling_server):
    name = _model(pooling_server)
    for path, body in (("/v1/completions", {"model": name, "prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"model": name, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"model": name, "input": "hi"}),
                       ("/v1/messages", {"model": name, "max_tokens": 2, "messages": [
                           {"role": "user", "content": "hi"}]}),
                       (f"/models/{name}/generate", {"inputs": "hi"})):
        r = requests.post(pooling_server + path, json=body, timeout=60)
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]       # Anthropic's shape on /v1/messages, OpenAI's elsewhere
        assert "pooling model" in error["message"] and error["type"] == "not_found_error"
    client = openai.OpenAI(base_url=pooling_server + "/v1", api_key="none")
    with pytest.raises(openai.NotFoundError, match="pooling model"):
        client.completions.create(model=name, prompt="hi", max_tokens=2)
    assert requests.get(pooling_server + "/health", timeout=30).status_code == 200


def test_a_client_that_leaves_aborts_its_inputs(pooling_server):
    """A client that gives up on a large batch (a timeout, a closed connection) frees the
    server as vLLM's does: its inputs still waiting or running are aborted, not computed."""
    from conftest import metric
    body = {"model": _model(pooling_server), "input": [[5 + i % 7] * 1500 for i in range(200)]}
    aborted = metric(pooling_server, "request_aborted_total")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(pooling_server + "/v1/embeddings", json=body, timeout=0.5)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (metric(pooling_server, "num_requests_running")
                                           + metric(pooling_server, "num_requests_waiting")):
        time.sleep(0.2)
    assert metric(pooling_server, "request_aborted_total") - aborted > 100


def test_embeddings_on_a_generate_server_is_a_404(tiny_model_dir):
    with served(tiny_model_dir, port=_port(1)) as url:
        r = requests.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 404
        assert "--runner pooling" in r.json()["error"]["message"]
        r = requests.post(url + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
