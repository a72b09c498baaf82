"""POST /classify on the real server (start.py, the model in a WorkAgent) with `requests`: a
classifier of one label (a tiny Qwen3ForSequenceClassification) and one of 3 labels against
HF transformers' logits; vLLM's answer shape, bad fields a 400 naming them, and a 404 for the
routes a model does not serve."""
from __future__ import annotations

import numpy as np
import pytest
import requests

from test_embeddings_server import _port, served

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUERY = "Where is Paris?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "x"]


@pytest.fixture(scope="module")
def ce_server(classifier_dirs):
    with served(classifier_dirs[("qwen3", 1)], port=_port(2)) as url:
        yield url


@pytest.fixture(scope="module")
def ce_hf(classifier_dirs):
    path = classifier_dirs[("qwen3", 1)]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)

    def logit(ids: list[int]) -> float:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, 0].item()
    return tok, logit


def _sigmoid(x: float) -> float:
    return 1 / (1 + np.exp(-x))


def _post(url: str, path: str, body: dict) -> dict:
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_classify_on_a_cross_encoder(ce_server, ce_hf):
    tok, logit = ce_hf
    ids = [tok(t)["input_ids"] for t in (QUERY, DOCS[0])]
    out = _post(ce_server, "/classify", {"input": [QUERY, DOCS[0]]})
    assert out["object"] == "list" and out["id"].startswith("classify-")
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == sum(map(len, ids))
    for d, x in zip(out["data"], ids):
        assert d["label"] == "relevant" and d["num_classes"] == 1
        np.testing.assert_allclose(d["probs"], [_sigmoid(logit(x))], atol=1e-5, rtol=0)
    by_ids = _post(ce_server, "/classify", {"input": ids[1]})
    np.testing.assert_allclose(by_ids["data"][0]["probs"], [_sigmoid(logit(ids[1]))],
                               atol=1e-5, rtol=0)
    raw = _post(ce_server, "/classify", {"input": QUERY, "use_activation": False})
    np.testing.assert_allclose(raw["data"][0]["probs"], [logit(ids[0])], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("path, body, field", [
    ("/classify", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/classify", {}, "input"),
    ("/classify", {"input": "hi", "normalize": True}, "normalize"),
    ("/classify", {"input": "hi", "cache_salt": "s"}, "cache_salt"),
])
def test_bad_fields_are_a_400_naming_them(ce_server, path, body, field):
    r = requests.post(ce_server + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or err["message"].startswith(field) or field in str(
        err["param"]), err


def test_the_routes_each_model_serves(tiny_model_dir, ce_server):
    r = requests.post(ce_server + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert r.status_code == 404 and "serves /classify" in r.text
    with served(tiny_model_dir, "--runner", "pooling", port=_port(3)) as url:
        r = requests.post(url + "/classify", json={"input": "hi"}, timeout=60)
        assert r.status_code == 404 and "serves /v1/embeddings" in r.text


def test_classify_names_the_most_likely_label(classifier_dirs):
    path = classifier_dirs[("llama", 3)]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with served(path, port=_port(4)) as url:
        out = _post(url, "/classify", {"input": DOCS})
        for d, doc in zip(out["data"], DOCS):
            with torch.no_grad():
                ref = torch.softmax(model(torch.tensor([tok(doc)["input_ids"]])).logits[0], -1)
            np.testing.assert_allclose(d["probs"], ref.numpy(), atol=1e-5, rtol=0)
            assert d["num_classes"] == 3
            assert d["label"] == model.config.id2label[int(ref.argmax())]
