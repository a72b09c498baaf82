"""Embedding models (vLLM's ``--runner pooling``): LLM.embed against HF transformers'
``AutoModel(...).last_hidden_state`` on the same random weights, pooled (LAST, MEAN, CLS)
and L2-normalized, for a tiny Llama and a tiny Qwen3 saved as a causal LM and as a base
model (``LlamaModel`` / ``Qwen3Model``: no lm_head, no "model." prefix); a ragged batch in
one step, and a long prompt split over many prefill chunks, give the single prompt's vector;
the pooler's configuration and the refusals."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from llm_serving import LLM, PoolingParams
from llm_serving.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024
RNG = np.random.default_rng(7)
# ragged: 1 to 90 tokens
PROMPTS = [RNG.integers(3, VOCAB, n).tolist() for n in (1, 7, 33, 90, 12)]
LONG = RNG.integers(3, VOCAB, 150).tolist()


def _base_model_dir(causal_dir: str, out: str) -> str:
    """The causal LM's decoder saved as HF saves a base model (``*Model``)."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(causal_dir, dtype=torch.float32)
    lm.model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        shutil.copy(f"{causal_dir}/{name}", f"{out}/{name}")
    return out


@pytest.fixture(scope="module")
def model_pairs(tiny_model_dir, qwen3_model_dir, tmp_path_factory):
    """{name: (causal LM dir, base model dir)} for the tiny Llama and the tiny Qwen3."""
    root = tmp_path_factory.mktemp("embed")
    return {"llama": (tiny_model_dir, _base_model_dir(tiny_model_dir, str(root / "llama"))),
            "qwen3": (qwen3_model_dir, _base_model_dir(qwen3_model_dir, str(root / "qwen3")))}


def _hf_hidden(model_dir: str, prompts) -> list[np.ndarray]:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in prompts]


def _pool(hidden: np.ndarray, kind: str, normalize: bool = True) -> np.ndarray:
    v = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind].astype(np.float64)
    return v / np.linalg.norm(v) if normalize else v


def _embed(llm, prompts, params=None) -> list[np.ndarray]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params)
    return [np.asarray(o.outputs.embedding) for o in outs]


def test_base_model_config_is_read_as_its_causal_lm(model_pairs):
    from llm_serving.model_executor.loader import ModelConfig
    for causal, base in model_pairs.values():
        c, b = ModelConfig.from_pretrained(causal), ModelConfig.from_pretrained(base)
        assert json.load(open(f"{base}/config.json"))["architectures"][0].endswith("Model")
        assert b.base_model and not c.base_model
        assert b.architecture == c.architecture and b.hidden_size == c.hidden_size


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_embeddings_match_hf_for_base_and_causal_checkpoints(model_pairs, name, kind):
    causal, base = model_pairs[name]
    ref = [_pool(h, kind) for h in _hf_hidden(base, PROMPTS)]
    # the base model serves pooling by default (runner auto), the causal LM when asked
    for llm in (LLM(base, num_blocks=64, pooler_config={"pooling_type": kind}),
                LLM(causal, runner="pooling", num_blocks=64,
                    pooler_config={"pooling_type": kind})):
        assert llm.engine.config.model.pooler.pooling_type == kind
        ours = _embed(llm, PROMPTS)              # one ragged step: 143 tokens < the budget
        for o, r in zip(ours, ref):
            assert o.shape == r.shape
            assert abs(np.linalg.norm(o) - 1) < 1e-5
            np.testing.assert_allclose(o, r, atol=5e-4, rtol=0)
        single = _embed(llm, [PROMPTS[3]])[0]
        np.testing.assert_allclose(single, ours[3], atol=1e-5, rtol=0)
        # only prefilled, ended with their last chunk: no block held, nothing left to run
        assert not any(llm.engine.block_manager.ref_counts)
        assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_a_prompt_split_over_prefill_chunks_pools_as_a_whole(model_pairs, kind):
    _, base = model_pairs["qwen3"]
    ref = _pool(_hf_hidden(base, [LONG])[0], kind)
    whole = LLM(base, num_blocks=64, pooler_config={"pooling_type": kind})
    split = LLM(base, num_blocks=64, pooler_config={"pooling_type": kind},
                max_num_batched_tokens=16)       # 150 tokens: 10 chunks
    one = _embed(whole, [LONG])[0]
    chunked = _embed(split, [LONG, PROMPTS[2]])
    np.testing.assert_allclose(one, ref, atol=5e-4, rtol=0)
    np.testing.assert_allclose(chunked[0], one, atol=1e-5, rtol=0)
    np.testing.assert_allclose(chunked[1], _embed(whole, [PROMPTS[2]])[0], atol=1e-5, rtol=0)



def test_encode_is_vllms_generic_pooling_call(model_pairs):
    """vLLM's LLM.encode(..., pooling_task="embed"): each prompt's pooled data (a numpy array
    here, a tensor there), transformers' LAST hidden state normalized; without pooling_task,
    or with a token-level task, a ValueError naming it."""
    from llm_serving import PoolingRequestOutput
    _, base = model_pairs["llama"]
    llm = LLM(base, num_blocks=64)
    refs = [_pool(h, "LAST") for h in _hf_hidden(base, PROMPTS[:2])]
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS[:2]], pooling_task="embed")
    assert all(isinstance(o, PoolingRequestOutput) for o in outs)
    for out, ref in zip(outs, refs):
        np.testing.assert_allclose(out.outputs.data, ref, atol=5e-4, rtol=0)
    for task, match in ((None, "pooling_task required"), ("token_embed", "pooling_task")):
        with pytest.raises(ValueError, match=match):
            llm.encode({"prompt_token_ids": PROMPTS[0]}, pooling_task=task)

def test_use_activation_false_gives_the_raw_pooled_state(model_pairs):
    _, base = model_pairs["llama"]
    ref = _pool(_hf_hidden(base, [PROMPTS[2]])[0], "MEAN", normalize=False)
    llm = LLM(base, num_blocks=64, pooler_config={"pooling_type": "MEAN",
                                                  "use_activation": False})
    np.testing.assert_allclose(_embed(llm, [PROMPTS[2]])[0], ref, atol=5e-4, rtol=0)
    # per request too, on a normalizing server
    llm = LLM(base, num_blocks=64, pooler_config={"pooling_type": "MEAN"})
    raw = _embed(llm, [PROMPTS[2]], PoolingParams(use_activation=False))[0]
    np.testing.assert_allclose(raw, ref, atol=5e-4, rtol=0)


def test_prefix_caching_last_reuses_blocks_mean_turns_it_off(model_pairs):
    _, base = model_pairs["llama"]
    llm = LLM(base, num_blocks=64, block_size=16)            # LAST, prefix caching on
    assert llm.engine.config.cache.enable_prefix_caching
    first = llm.embed({"prompt_token_ids": LONG})[0]
    again = llm.embed({"prompt_token_ids": LONG})[0]
    assert again.num_cached_tokens >= 128
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-5)
    # vLLM's cache_salt: a salted prompt shares blocks only with its own salt
    salted = [llm.embed({"prompt_token_ids": LONG, "cache_salt": "tenant-a"})[0]
              for _ in range(2)]
    assert [o.num_cached_tokens for o in salted][0] == 0 and salted[1].num_cached_tokens >= 128
    np.testing.assert_allclose(salted[1].outputs.embedding, first.outputs.embedding, atol=1e-5)
    mean = LLM(base, num_blocks=64, pooler_config={"pooling_type": "MEAN"})
    assert not mean.engine.config.cache.enable_prefix_caching


def test_sentence_transformers_pooling_module_sets_the_pooling(model_pairs, tmp_path):
    _, base = model_pairs["llama"]
    d = tmp_path / "st"
    shutil.copytree(base, d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    llm = LLM(str(d), num_blocks=64)
    pooler = llm.engine.config.model.pooler
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", False)   # no Normalize module
    ref = _pool(_hf_hidden(base, [PROMPTS[1]])[0], "MEAN", normalize=False)
    np.testing.assert_allclose(_embed(llm, [PROMPTS[1]])[0], ref, atol=5e-4, rtol=0)


def test_dimensions_only_for_matryoshka_models(model_pairs, tmp_path):
    _, base = model_pairs["llama"]
    llm = LLM(base, num_blocks=64)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=16))
    d = tmp_path / "mrl"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(str(d), num_blocks=64)
    full = _embed(llm, [PROMPTS[2]], PoolingParams(use_activation=False))[0]
    short = _embed(llm, [PROMPTS[2]], PoolingParams(dimensions=16))[0]
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    with pytest.raises(ValueError, match=r"Matryoshka dimensions \[16, 32, 64\], got 20"):
        llm.embed("hello", PoolingParams(dimensions=20))


def test_bad_configurations_are_refused_by_name(model_pairs, qwen3_model_dir):
    _, base = model_pairs["llama"]
    with pytest.raises(ConfigError, match="runner.*base model without an LM head"):
        LLM(base, runner="generate", num_blocks=64)
    with pytest.raises(ConfigError, match="pooler_config.*use_activation"):
        LLM(base, num_blocks=64, pooler_config={"normalize": True})
    with pytest.raises(ConfigError, match="pooler_config.*'ALL'"):
        LLM(base, num_blocks=64, pooler_config={"pooling_type": "ALL"})
    with pytest.raises(ConfigError, match="runner"):
        LLM(base, runner="embed", num_blocks=64)
    with pytest.raises(ConfigError, match="pooler_config.*only a pooling runner"):
        LLM(qwen3_model_dir, num_blocks=64, pooler_config={"pooling_type": "MEAN"})


def test_generation_and_pooling_calls_refused_on_the_other_runner(model_pairs):
    causal, base = model_pairs["llama"]
    pooling = LLM(base, num_blocks=64)
    with pytest.raises(ValueError, match="pooling model"):
        pooling.generate("hello")
    generate = LLM(causal, num_blocks=64)
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is for pooling models"):
        generate.embed("hello")
    # --convert embed serves the causal LM as an embedding model (vLLM's name)
    converted = LLM(causal, convert="embed", num_blocks=64)
    np.testing.assert_allclose(_embed(converted, [PROMPTS[2]])[0],
                               _embed(pooling, [PROMPTS[2]])[0], atol=1e-5)


def test_two_tensor_parallel_ranks_give_the_same_embeddings(model_pairs):
    """Through WorkAgents (the pooled sums come back in the shared-memory result segment),
    on two ranks: the hidden states are whole after the all-reduce."""
    import os
    from llm_serving.executor.shm_channel import segments_of
    _, base = model_pairs["qwen3"]
    ref = [_pool(h, "MEAN") for h in _hf_hidden(base, PROMPTS)]
    before = segments_of()
    llm = LLM(base, tensor_parallel_size=2, num_blocks=64, max_num_batched_tokens=32,
              pooler_config={"pooling_type": "MEAN"},
              cpu_affinity="0|1" if len(os.sched_getaffinity(0)) >= 2 else None)
    try:
        ours = _embed(llm, PROMPTS)
    finally:
        llm.engine.shutdown()
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, r, atol=5e-4, rtol=0)
    assert not segments_of() - before, "shared memory left behind"
