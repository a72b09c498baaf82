"""Shared fixtures: tiny random models are built once per session and shared by all tests."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Two random checkpoints that together cover GQA, MQA, Qwen2 q/k/v bias, tied embeddings,
# llama3 rope scaling and sharded safetensors.
MODEL_VARIANTS = {
    "llama3-gqa": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=160, vocab_size=1024, rope_scaling="llama3",
                       num_shards=2, seed=1),
    "qwen2-mqa-tied": dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=1,
                           intermediate_size=128, vocab_size=1024, qkv_bias=True,
                           tie_word_embeddings=True, seed=2),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    from llm_serving.model_executor.tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in MODEL_VARIANTS.items()}


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory):
    """The built-in tiny Qwen3 (per-head q/k norms, head_dim 32 on hidden 64 with 4 heads,
    GQA, tied embeddings)."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3"),
                           **PRESETS["tiny-qwen3"])


@pytest.fixture(scope="session")
def gpt_bigcode_model_dir(tmp_path_factory):
    """The built-in tiny GPTBigCode (StarCoder / WizardCoder's layout: learned positions,
    LayerNorm, multi-query attention, GELU MLP, biases, tied embeddings)."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("gpt-bigcode") / "tiny-gpt-bigcode"),
                           **PRESETS["tiny-gpt-bigcode"])


@pytest.fixture(scope="session")
def qwen3_moe_model_dir(tmp_path_factory):
    """The built-in tiny Qwen3-MoE (8 experts of 32, top 2 renormalized; layers 0 and 2
    sparse, layer 1 dense through mlp_only_layers; Qwen3's attention)."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3-moe"),
                           **PRESETS["tiny-qwen3-moe"])


@pytest.fixture(scope="session")
def internlm_model_dir(tmp_path_factory):
    """The built-in tiny InternLM (v1: biases on the q, k, v and o projections, multi-head
    attention, internlm-7b's config.json keys)."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("internlm") / "tiny-internlm"),
                           **PRESETS["tiny-internlm"])


@pytest.fixture(scope="session")
def internlm2_model_dir(tmp_path_factory):
    """The built-in tiny InternLM2 (GQA 4 query heads on 2 KV heads, q/k/v packed per KV group
    in attention.wqkv, InternLM2's weight names, dynamic NTK rope scaling)."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("internlm2") / "tiny-internlm2"),
                           **PRESETS["tiny-internlm2"])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The built-in default tiny model, built the way start.py builds it."""
    from llm_serving.model_executor.tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.fixture(scope="session")
def w8a8_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a W8A8 int8 checkpoint (compressed-tensors, int8 weights per channel,
    activations per token), written by python -m llm_serving.quantize."""
    from llm_serving.quantize import quantize_model
    return quantize_model(tiny_model_dir,
                          str(tmp_path_factory.mktemp("w8a8") / "tiny-llama-w8a8"))


@pytest.fixture(scope="session")
def tiny_hf_logprobs(tiny_model_dir):
    """Prompts of 1, 2, 30 and 150 tokens and HF transformers' log_softmax over each prompt
    position of the tiny model (torch, CPU, fp32): the reference of logprob tests."""
    import numpy as np
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (1, 2, 30, 150)]
    with torch.no_grad():
        ref = [torch.log_softmax(model(torch.tensor([p])).logits[0], -1).numpy()
               for p in prompts]
    return prompts, ref


def hf_causal_lm(model_dir: str):
    """transformers' float32 model of ``model_dir`` in eval mode: the reference of numerics
    tests (torch, CPU)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from llm_serving import LLM
    return LLM(tiny_model_dir, num_blocks=256, block_size=16)


def metric_value(text: str, name: str) -> float:
    """A server's metric in /metrics ``text``: ``name`` without its prefix (vLLM's ``vllm:`` or
    this server's ``llm_serving:``), with a sample suffix (``_total``, ``_count``) and maybe
    labels to match (``request_success_total{finished_reason="abort"}``), summed over the
    samples that have them. 0 for a labelled metric with no samples yet; a metric the server
    does not declare fails the test (a renamed metric must not read as 0)."""
    import re

    from prometheus_client.parser import text_string_to_metric_families
    m = re.fullmatch(r"([a-z0-9_]+)(?:\{(.*)\})?", name)
    base, want = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
    total, declared = 0.0, False
    for family in text_string_to_metric_families(text):
        prefix, _, fam = family.name.partition(":")
        if prefix not in ("vllm", "llm_serving") or not base.startswith(fam):
            continue
        declared |= base[len(fam):] in ("", "_total", "_count", "_sum", "_bucket")
        for s in family.samples:
            if s.name == f"{prefix}:{base}" and want.items() <= s.labels.items():
                total += s.value
    assert declared, f"the server has no metric {name}"
    return total


def metric(url: str, name: str) -> float:
    import requests
    return metric_value(requests.get(url + "/metrics", timeout=10).text, name)


@pytest.fixture(scope="session")
def classifier_dirs(tiny_model_dir, qwen3_model_dir, tmp_path_factory):
    """Sequence classifiers saved by transformers (``LlamaForSequenceClassification``,
    ``Qwen3ForSequenceClassification``) from the tiny Llama and Qwen3, random score heads:
    {(name, num_labels): dir} for 3 labels (named) and 1 label (a cross-encoder)."""
    import shutil
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("classifiers")
    out = {}
    for name, src, cls in (("llama", tiny_model_dir, "LlamaForSequenceClassification"),
                           ("qwen3", qwen3_model_dir, "Qwen3ForSequenceClassification")):
        for n in (3, 1):
            cfg = transformers.AutoConfig.from_pretrained(src)
            cfg.architectures = [cls]
            cfg.num_labels = n
            cfg.id2label = ({0: "negative", 1: "neutral", 2: "positive"} if n == 3
                            else {0: "relevant"})
            cfg.label2id = {v: k for k, v in cfg.id2label.items()}
            torch.manual_seed(n)
            model = getattr(transformers, cls).from_pretrained(src, config=cfg,
                                                               dtype=torch.float32)
            with torch.no_grad():           # far from uniform probabilities
                model.score.weight.normal_(0, 0.5)
            path = str(root / f"{name}-{n}")
            model.save_pretrained(path)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(f"{src}/{f}", f"{path}/{f}")
            out[(name, n)] = path
    return out
