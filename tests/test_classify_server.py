"""POST /classify, /score and /rerank on the real server (start.py, the model in a WorkAgent)
with `requests`: a cross-encoder (a tiny Qwen3ForSequenceClassification of one label) and a
3-label classifier against HF transformers' logits, an embedding model's /score against the
cosine similarity of HF's hidden states; vLLM's answer shapes, bad fields a 400 naming them,
and a 404 for the routes a model does not serve."""
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


def test_score_matches_hf_one_to_many_and_n_to_n(ce_server, ce_hf):
    tok, logit = ce_hf

    def score(a: str, b: str) -> float:        # the tokenizer's pair encoding, as vLLM's
        return _sigmoid(logit(tok(a, text_pair=b)["input_ids"]))
    for path in ("/score", "/v1/score"):
        out = _post(ce_server, path, {"text_1": QUERY, "text_2": DOCS})
        assert out["object"] == "list" and out["id"].startswith("score-")
        assert [d["index"] for d in out["data"]] == [0, 1, 2]
        assert all(d["object"] == "score" for d in out["data"])
        for d, doc in zip(out["data"], DOCS):
            assert abs(d["score"] - score(QUERY, doc)) < 1e-5
        tokens = sum(len(tok(QUERY, text_pair=d)["input_ids"]) for d in DOCS)
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == tokens
    # N:N under vLLM's other names for the two sides
    out = _post(ce_server, "/score", {"queries": DOCS[:2], "documents": [QUERY, QUERY]})
    for d, doc in zip(out["data"], DOCS[:2]):
        assert abs(d["score"] - score(doc, QUERY)) < 1e-5


def test_rerank_orders_by_relevance(ce_server, ce_hf):
    tok, logit = ce_hf
    ref = [_sigmoid(logit(tok(QUERY, text_pair=d)["input_ids"])) for d in DOCS]
    best = sorted(range(3), key=lambda i: ref[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        out = _post(ce_server, path, {"query": QUERY, "documents": DOCS, "top_n": 2})
        assert set(out) == {"id", "model", "usage", "results"}
        assert [r["index"] for r in out["results"]] == best[:2]
        for r in out["results"]:
            assert r["document"] == {"text": DOCS[r["index"]], "multi_modal": None}
            assert abs(r["relevance_score"] - ref[r["index"]]) < 1e-5
        tokens = sum(len(tok(QUERY, text_pair=d)["input_ids"]) for d in DOCS)
        assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    everything = _post(ce_server, "/rerank", {"query": QUERY, "documents": DOCS})
    assert [r["index"] for r in everything["results"]] == best


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
    salted = _post(ce_server, "/classify", {"input": ids[1], "cache_salt": "tenant-a"})
    np.testing.assert_allclose(salted["data"][0]["probs"], [_sigmoid(logit(ids[1]))],
                               atol=1e-5, rtol=0)           # vLLM's cache_salt is taken


def test_classify_a_conversation_as_its_chat_template_renders_it(ce_server, ce_hf):
    """vLLM's chat form of /classify: one conversation in messages, rendered by the chat
    template (no generation prompt unless asked), its class probabilities as input's."""
    tok, logit = ce_hf
    chat = [{"role": "user", "content": QUERY}, {"role": "assistant", "content": DOCS[0]}]
    for kw in ({}, {"add_generation_prompt": True}):
        ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False, **kw)
        out = _post(ce_server, "/classify", {"messages": chat, **kw})
        assert len(out["data"]) == 1 and out["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(out["data"][0]["probs"], [_sigmoid(logit(ids))],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("path, body, field", [
    ("/score", {"text_1": DOCS[:2], "text_2": DOCS}, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": {"content": [{"type": "text", "text": "x"}]}},
     "text_2"),
    ("/score", {"text_1": [], "text_2": DOCS}, "text_1"),
    ("/score", {"text_1": QUERY}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": DOCS, "max_tokens_per_doc": 4},
     "max_tokens_per_doc"),
    ("/score", {"text_1": QUERY, "text_2": DOCS, "instruction": "judge"}, "instruction"),
    ("/score", {"text_1": QUERY, "text_2": DOCS, "normalize": True}, "normalize"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False},
     "return_documents"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"documents": DOCS}, "query"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/classify", {"input": "hi", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/classify", {"messages": [[{"role": "user", "content": "x"}]]}, "messages"),  # one only
    ("/classify", {"input": [{"role": "user", "content": "x"}]}, "input"),   # as vLLM's
    ("/classify", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, "messages"),
    ("/classify", {}, "input"),
    ("/classify", {"input": "hi", "normalize": True}, "normalize"),
    ("/classify", {"input": "hi", "cache_salt": ""}, "cache_salt"),    # vLLM's check
    ("/score", {"text_1": QUERY, "text_2": DOCS, "cache_salt": "a/b"}, "cache_salt"),
])
def test_bad_fields_are_a_400_naming_them(ce_server, path, body, field):
    r = requests.post(ce_server + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or err["message"].startswith(field) or field in str(
        err["param"]), err


def test_embedding_model_scores_and_the_routes_each_model_serves(tiny_model_dir, ce_server):
    r = requests.post(ce_server + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert r.status_code == 404 and "/classify, /score and /rerank" in r.text
    model = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)

    def last(text):
        with torch.no_grad():
            return model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
    with served(tiny_model_dir, "--runner", "pooling", port=_port(3)) as url:
        out = _post(url, "/score", {"text_1": QUERY, "text_2": DOCS})
        for d, doc in zip(out["data"], DOCS):
            ref = torch.nn.functional.cosine_similarity(last(QUERY), last(doc), dim=0).item()
            assert abs(d["score"] - ref) < 1e-5
        # each text is embedded once: the query counts once
        tokens = sum(len(tok(t)["input_ids"]) for t in [QUERY] + DOCS)
        assert out["usage"]["prompt_tokens"] == tokens
        r = requests.post(url + "/classify", json={"input": "hi"}, timeout=60)
        assert r.status_code == 404 and "/v1/embeddings, /score and /rerank" in r.text


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
        r = requests.post(url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
        assert r.status_code == 404 and "serves /classify" in r.text   # num_labels != 1


def test_invocations_on_a_cross_encoder_reranks_scores_and_classifies(ce_server):
    """vLLM's SageMaker /invocations on a cross-encoder: a query with documents is a rerank,
    a score pair a score, an input a classification, each the answer of that route."""
    for path, body in (("/rerank", {"query": QUERY, "documents": DOCS}),
                       ("/score", {"text_1": QUERY, "text_2": DOCS}),
                       ("/classify", {"input": DOCS})):
        direct, via = _post(ce_server, path, body), _post(ce_server, "/invocations", body)
        for key in ("id", "created"):
            direct.pop(key, None)
            via.pop(key, None)
        assert via == direct, path


def test_chat_template_renders_each_pair_as_vllm_does(classifier_dirs, ce_hf):
    """--chat-template on a cross-encoder (vLLM's score template): /rerank scores the text
    the template makes of {"role": "query"} and {"role": "document"}, as transformers renders
    and tokenizes it."""
    tok, logit = ce_hf
    template = "Q: {{ messages[0].content }}\nD: {{ messages[1].content }}\nRelevant:"
    with served(classifier_dirs[("qwen3", 1)], "--chat-template", template,
                port=_port(5)) as url:
        out = _post(url, "/rerank", {"query": QUERY, "documents": DOCS})
    for result in out["results"]:
        text = tok.apply_chat_template([{"role": "query", "content": QUERY},
                                        {"role": "document", "content": DOCS[result["index"]]}],
                                       chat_template=template, tokenize=False)
        assert abs(result["relevance_score"] - _sigmoid(logit(tok(text)["input_ids"]))) < 1e-5
