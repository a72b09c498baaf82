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
def tiny_model_dir(tmp_path_factory):
    """The built-in default tiny model, built the way start.py builds it."""
    from llm_serving.model_executor.tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from llm_serving import LLM
    return LLM(tiny_model_dir, num_blocks=256, block_size=16)
