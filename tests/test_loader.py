"""Model config parsing and weight loading (safetensors single/sharded/bf16, MindSpore .ckpt)."""

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.loader import (
    ModelConfig,
    hf_to_mindformers_name,
    iter_weights,
    mindformers_to_hf_name,
    save_mindformers_ckpt,
)
from llm_serving.model_executor.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("loader") / "tiny"))


def weights(model_dir, **kw):
    out = {}
    for name, arr in iter_weights(model_dir, **kw):
        assert name not in out, f"duplicate {name}"
        out[name] = np.array(arr)
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# --- config ----------------------------------------------------------------------------------


def test_config_from_tiny_model(tiny):
    c = ModelConfig.from_pretrained(tiny)
    assert c.architecture == "LlamaForCausalLM"
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (128, 1024, 2048)
    assert c.rope_scaling is None and c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-6
    assert not c.tie_word_embeddings and not c.qkv_bias and not c.o_bias
    assert c.bos_token_id == 1 and c.eos_token_id == 2 and c.eos_token_ids == [2]
    assert c.torch_dtype == "float32"
    with pytest.raises(Exception):
        c.hidden_size = 3  # frozen


def test_config_variants(tmp_path):
    q = ModelConfig.from_pretrained(make_tiny_model(str(tmp_path / "q"), qkv_bias=True, tie_word_embeddings=True,
                                                    rope_scaling="llama3", rope_theta=500000.0))
    assert q.architecture == "Qwen2ForCausalLM" and q.qkv_bias and not q.o_bias and q.tie_word_embeddings
    assert q.rope_theta == 500000.0
    assert q.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def _write_cfg(d: Path, **overrides):
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000}
    base.update(overrides)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    return str(d)


def test_config_defaults_and_spellings(tmp_path):
    c = ModelConfig.from_pretrained(_write_cfg(tmp_path / "a"))
    assert c.num_kv_heads == 4 and c.head_dim == 16 and not c.tie_word_embeddings and c.rope_scaling is None
    c = ModelConfig.from_pretrained(_write_cfg(tmp_path / "b", head_dim=32, attention_bias=True,
                                               eos_token_id=[2, 7], rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.head_dim == 32 and c.q_size == 128 and c.qkv_bias and c.o_bias
    assert c.eos_token_id == [2, 7] and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # transformers v5 writes rope_parameters instead of rope_theta/rope_scaling
    c = ModelConfig.from_pretrained(_write_cfg(tmp_path / "c", rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 1e6}))
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    c = ModelConfig.from_pretrained(_write_cfg(tmp_path / "d", architectures=["MistralForCausalLM"],
                                               sliding_window=None))
    assert c.architecture == "MistralForCausalLM" and c.max_position_embeddings == 32768
    c = ModelConfig.from_pretrained(_write_cfg(tmp_path / "e", architectures=None, model_type="qwen2",
                                               sliding_window=4096, use_sliding_window=False))
    assert c.architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize("overrides, match", [
    (dict(architectures=["GPT2LMHeadModel"]), r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen2ForCausalLM"),
    (dict(num_key_value_heads=3), "divisible by num_key_value_heads"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_size=None), "missing required key 'hidden_size'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768), "sliding"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_scaling type 'longrope'"),
    (dict(rope_scaling={"type": "dynamic"}), "dynamic needs a numeric 'factor'"),
    (dict(rope_scaling={"rope_type": "yarn"}), "yarn needs a numeric 'factor'"),
    (dict(vocab_size=-1), "vocab_size must be a positive integer"),
])
def test_config_errors(tmp_path, overrides, match):
    d = _write_cfg(tmp_path / "m", **overrides)
    with pytest.raises(ModelLoadError, match=match) as e:
        ModelConfig.from_pretrained(d)
    assert "config.json" in str(e.value)


def test_config_path_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"no config\.json in model directory"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        ModelConfig.from_pretrained(str(tmp_path / "file"))


def test_mindformers_yaml(tmp_path):
    p = tmp_path / "llama2_7b.yaml"
    p.write_text(
        "model:\n"
        "  model_config:\n"
        "    type: LlamaConfig\n"
        "    hidden_size: 4096\n    num_layers: 32\n    num_heads: 32\n    vocab_size: 32000\n"
        "    multiple_of: 256\n    rms_norm_eps: 1.0e-5\n    seq_length: 4096\n    theta: 10000.0\n"
        "    compute_dtype: float16\n    param_init_type: float16\n"
        "  arch:\n    type: LlamaForCausalLM\n"
    )
    c = ModelConfig.from_mindformers_yaml(str(p))
    assert (c.architecture, c.intermediate_size, c.num_kv_heads, c.max_position_embeddings) == (
        "LlamaForCausalLM", 11008, 32, 4096)
    assert c.rms_norm_eps == 1e-5 and c.torch_dtype == "float16"
    p.write_text(
        "model:\n  model_config:\n    hidden_size: 8192\n    num_layers: 80\n    num_heads: 64\n    n_kv_heads: 8\n"
        "    vocab_size: 128256\n    multiple_of: 1024\n    ffn_dim_multiplier: 1.3\n    theta: 500000\n"
        "    extend_method: LLAMA3\n    scaling_factor: {factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,"
        " original_max_position_embeddings: 8192}\n"
    )
    c = ModelConfig.from_mindformers_yaml(str(p))
    assert c.intermediate_size == 28672 and c.num_kv_heads == 8 and c.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_mindformers_yaml(str(tmp_path / "none.yaml"))


# --- weights ---------------------------------------------------------------------------------


def test_single_file_matches_safetensors_library(tiny):
    from safetensors.numpy import load_file

    ours = weights(tiny)
    assert_same(ours, load_file(str(Path(tiny) / "model.safetensors")))
    assert len(ours) == 1 + 2 * 9 + 1 + 1


def test_sharded_equals_single(tmp_path, tiny):
    sharded = make_tiny_model(str(tmp_path / "sharded"), num_shards=4)
    assert len(list(Path(sharded).glob("model-*-of-00004.safetensors"))) == 4
    assert_same(weights(sharded), weights(tiny))
    # without the index: all *.safetensors files
    (Path(sharded) / "model.safetensors.index.json").unlink()
    assert_same(weights(sharded), weights(tiny))


def test_index_naming_missing_shard(tmp_path):
    d = Path(make_tiny_model(str(tmp_path / "m"), num_shards=2))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        weights(str(d))


def test_bf16_file(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t = {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
         "b": torch.tensor([1.0, -2.5, 3e38, float("inf"), 1e-40]).to(torch.bfloat16),
         "c": torch.arange(6, dtype=torch.float16).reshape(2, 3),
         "d": torch.arange(4, dtype=torch.int64)}
    save_file(t, str(tmp_path / "model.safetensors"))
    got = weights(str(tmp_path))
    for k in ("a", "b"):
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], t[k].float().numpy())
    assert got["c"].dtype == np.float16 and got["d"].dtype == np.int64
    np.testing.assert_array_equal(got["c"], t["c"].numpy())
    kept = dict(iter_weights(str(tmp_path), keep_bf16=True))     # bits as they are
    for k in ("a", "b"):
        assert kept[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(kept[k].view(np.int16), t[k].view(torch.int16).numpy())


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_a_tensor_read_leaves_rss_once_dropped(tmp_path):
    """Each tensor is its own memory map: reading a 64 MB file tensor by tensor, dropping each,
    holds about one tensor's pages (8 MB), not the file's (what lets llm_serving.quantize
    stream a checkpoint larger than memory)."""
    from safetensors.numpy import save_file
    save_file({f"t{i}": np.full(2 * 2**20, i, np.float32) for i in range(8)},
              str(tmp_path / "model.safetensors"))
    base, peak = _rss_file_kb(), 0
    for name, arr in iter_weights(str(tmp_path)):
        assert float(arr.sum()) == int(name[1:]) * arr.size       # every page touched
        peak = max(peak, _rss_file_kb() - base)
        del arr
    assert 8 * 1024 <= peak < 24 * 1024, peak


def test_bad_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        weights(str(tmp_path))


def test_weight_path_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        weights(str(tmp_path / "missing"))
    _write_cfg(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match=r"no weights in .*empty.*model\.safetensors.*\.ckpt"):
        weights(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        weights(str(tmp_path / "empty"), checkpoint=str(tmp_path / "x.ckpt"))


def test_name_mapping():
    assert mindformers_to_hf_name("model.tok_embeddings.embedding_weight") == "model.embed_tokens.weight"
    assert mindformers_to_hf_name("model.layers.3.attention.wk.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert mindformers_to_hf_name("model.layers.3.attention.wq.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert mindformers_to_hf_name("model.layers.0.feed_forward.w3.weight") == "model.layers.0.mlp.up_proj.weight"
    assert mindformers_to_hf_name("model.layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert mindformers_to_hf_name("model.norm_out.weight") == "model.norm.weight"
    assert mindformers_to_hf_name("model.layers.1.mlp.down_proj.weight") == "model.layers.1.mlp.down_proj.weight"
    assert mindformers_to_hf_name("adam_m.model.norm_out.weight") is None
    assert mindformers_to_hf_name("global_step") is None
    for hf in ("model.embed_tokens.weight", "model.layers.7.self_attn.o_proj.weight", "lm_head.weight",
               "model.layers.2.mlp.gate_proj.weight", "model.layers.2.input_layernorm.weight"):
        assert mindformers_to_hf_name(hf_to_mindformers_name(hf)) == hf


def test_ckpt_equals_safetensors(tmp_path):
    pytest.importorskip("mindspore")
    src = make_tiny_model(str(tmp_path / "src"), qkv_bias=True, num_layers=1)
    ref = weights(src)
    # explicit checkpoint path
    ckpt = save_mindformers_ckpt(src, str(tmp_path / "out" / "llama.ckpt"))
    assert_same(weights(src, checkpoint=ckpt), ref)
    # the only *.ckpt in a model directory (no safetensors)
    d = tmp_path / "ckpt_dir"
    d.mkdir()
    shutil.copy(Path(src) / "config.json", d / "config.json")
    shutil.copy(ckpt, d / "model.ckpt")
    assert_same(weights(str(d)), ref)
    # mindformers names really are used in the file
    import mindspore

    names = set(mindspore.load_checkpoint(ckpt))
    assert "model.tok_embeddings.embedding_weight" in names and "model.layers.0.attention.wq.bias" in names
    # two ckpts: ambiguous
    shutil.copy(ckpt, d / "other.ckpt")
    with pytest.raises(ModelLoadError, match="checkpoint="):
        weights(str(d))


def test_ckpt_with_hf_names_and_bf16(tmp_path):
    ms = pytest.importorskip("mindspore")
    a = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    params = [
        {"name": "model.embed_tokens.weight", "data": ms.Tensor(a)},
        {"name": "model.layers.0.self_attn.q_proj.weight", "data": ms.Tensor(a).astype(ms.bfloat16)},
        {"name": "adam_v.model.embed_tokens.weight", "data": ms.Tensor(a)},
    ]
    path = str(tmp_path / "hf_names.ckpt")
    ms.save_checkpoint(params, path)
    got = weights(str(tmp_path), checkpoint=path)
    assert sorted(got) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(got["model.embed_tokens.weight"], a)
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == np.float32
    np.testing.assert_allclose(got["model.layers.0.self_attn.q_proj.weight"], a, rtol=2**-8)
