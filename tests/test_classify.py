"""Sequence classification and scoring (vLLM's classify and score tasks on a pooling runner):
LLM.classify and LLM.score against HF transformers' ``*ForSequenceClassification`` logits on
the same random checkpoints (a tiny Llama and a tiny Qwen3, 3 labels and 1 label), with
vLLM's activations (softmax over labels, sigmoid for one, the raw logits without); a
cross-encoder's pair is the tokenizer's pair encoding; an embedding model scores by cosine
similarity; the refusals."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from llm_serving import LLM, PoolingParams
from llm_serving.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["The capital of France is Paris.", "a", "Classifiers read the last token " * 6]
QUERY = "Where is Paris?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "x"]


def _hf(model_dir: str):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()
    return tok, logits


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x)))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_classify_matches_hf(classifier_dirs, name):
    path = classifier_dirs[(name, 3)]
    tok, logits = _hf(path)
    # runner auto serves a sequence classifier as one; small chunks split the long prompt
    llm = LLM(path, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.engine.config.model.pooler.task == "classify"
    ids = [tok(t)["input_ids"] for t in TEXTS]
    prompts = TEXTS[:2] + [{"prompt_token_ids": ids[2]}]
    outs = llm.classify(prompts)
    raw = llm.classify(prompts, PoolingParams(use_activation=False))
    for o, r, x in zip(outs, raw, ids):
        assert o.prompt_token_ids == x and o.outputs.num_classes == 3
        np.testing.assert_allclose(o.outputs.probs, _softmax(logits(x)), atol=1e-5, rtol=0)
        np.testing.assert_allclose(r.outputs.probs, logits(x), atol=1e-4, rtol=1e-5)


def test_one_label_is_a_sigmoid_and_problem_type_is_read(classifier_dirs, tmp_path):
    path = classifier_dirs[("llama", 1)]
    tok, logits = _hf(path)
    x = tok(TEXTS[0])["input_ids"]
    out = LLM(path, num_blocks=64).classify(TEXTS[0])[0]
    np.testing.assert_allclose(out.outputs.probs, _sigmoid(logits(x)), atol=1e-5, rtol=0)
    # config.json's problem_type picks vLLM's (transformers' loss's) activation
    multi = shutil.copytree(classifier_dirs[("llama", 3)], tmp_path / "multi")
    cfg = json.loads((multi / "config.json").read_text())
    (multi / "config.json").write_text(json.dumps({**cfg, "problem_type":
                                                   "multi_label_classification"}))
    out = LLM(str(multi), num_blocks=64).classify(TEXTS[0])[0]
    np.testing.assert_allclose(out.outputs.probs, _sigmoid(_hf(str(multi))[1](x)), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cross_encoder_scores_the_tokenizers_pair_encoding(classifier_dirs, name):
    path = classifier_dirs[(name, 1)]
    tok, logits = _hf(path)
    llm = LLM(path, num_blocks=64)
    pair = lambda a, b: tok(a, text_pair=b)["input_ids"]    # noqa: E731
    one_to_many = llm.score(QUERY, DOCS)
    assert len(one_to_many) == 3
    for out, doc in zip(one_to_many, DOCS):
        assert out.prompt_token_ids == pair(QUERY, doc)
        np.testing.assert_allclose(out.outputs.score, _sigmoid(logits(pair(QUERY, doc))[0]),
                                   atol=1e-5, rtol=0)
    many = llm.score(DOCS[:2], [QUERY, QUERY])        # N:N pairs the i-th with the i-th
    for out, doc in zip(many, DOCS[:2]):
        np.testing.assert_allclose(out.outputs.score, _sigmoid(logits(pair(doc, QUERY))[0]),
                                   atol=1e-5, rtol=0)
    raw = llm.score(QUERY, DOCS[1], pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose(raw[0].outputs.score, logits(pair(QUERY, DOCS[1]))[0],
                               atol=1e-4, rtol=1e-5)
    # a score template (vLLM's: the messages {"role": "query"} and {"role": "document"}),
    # rendered and tokenized as transformers does it
    template = "Query: {{ messages[0].content }}\nDocument: {{ messages[1].content }}\nRelevant:"
    templated = llm.score(QUERY, DOCS[:2], chat_template=template)
    for out, doc in zip(templated, DOCS[:2]):
        text = tok.apply_chat_template([{"role": "query", "content": QUERY},
                                        {"role": "document", "content": doc}],
                                       chat_template=template, tokenize=False)
        assert out.prompt_token_ids == tok(text)["input_ids"]
        np.testing.assert_allclose(out.outputs.score,
                                   _sigmoid(logits(tok(text)["input_ids"])[0]), atol=1e-5, rtol=0)


def test_embedding_model_scores_by_cosine_similarity(tiny_model_dir):
    model = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)

    def last(text):
        with torch.no_grad():
            return model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
    llm = LLM(tiny_model_dir, runner="pooling", num_blocks=64)
    outs = llm.score(QUERY, DOCS)
    for out, doc in zip(outs, DOCS):
        ref = torch.nn.functional.cosine_similarity(last(QUERY), last(doc), dim=0).item()
        assert abs(out.outputs.score - ref) < 1e-5
        assert out.prompt_token_ids == tok(QUERY)["input_ids"] + tok(doc)["input_ids"]


def test_refusals(classifier_dirs, tiny_model_dir):
    cls3 = LLM(classifier_dirs[("llama", 3)], num_blocks=64)
    with pytest.raises(ValueError, match="num_labels == 1"):
        cls3.score(QUERY, DOCS)
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is for pooling models"):
        cls3.embed("hi")
    with pytest.raises(ValueError, match="pooling model"):
        cls3.generate("hi")
    with pytest.raises(ValueError, match="dimensions"):
        cls3.classify("hi", PoolingParams(dimensions=4))
    with pytest.raises(ValueError, match="task: the score task was removed"):
        PoolingParams(task="score")
    ce = LLM(classifier_dirs[("llama", 1)], num_blocks=64)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        ce.score(DOCS[:2], DOCS)
    with pytest.raises(ValueError, match="data_2: multimodal"):
        ce.score(QUERY, {"content": [{"type": "text", "text": "x"}]})
    with pytest.raises(ConfigError, match="runner"):
        LLM(classifier_dirs[("llama", 3)], runner="generate", num_blocks=64)
    with pytest.raises(ConfigError, match="convert"):      # a causal LM has no score head
        LLM(tiny_model_dir, convert="classify", num_blocks=64)
    with pytest.raises(ConfigError, match="MEAN"):
        LLM(classifier_dirs[("llama", 3)], pooler_config={"pooling_type": "MEAN"},
            num_blocks=64)
    emb = LLM(tiny_model_dir, runner="pooling", num_blocks=64)
    with pytest.raises(ValueError, match=r"LLM.classify\(\) is for pooling models"):
        emb.classify("hi")
