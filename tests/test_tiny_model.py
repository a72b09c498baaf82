"""The random-weight model builder: deterministic, HF-loadable, with a real tokenizer."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from llm_serving.model_executor import tiny_model
from llm_serving.model_executor.loader import read_safetensors
from llm_serving.model_executor.tiny_model import (default_model_dir, ensure_tiny_model,
                                                   make_tiny_model, model_path)


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


def test_deterministic(tmp_path):
    a = make_tiny_model(str(tmp_path / "a"), num_shards=2, rope_scaling="llama3")
    b = make_tiny_model(str(tmp_path / "b"), num_shards=2, rope_scaling="llama3")
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name
    c = make_tiny_model(str(tmp_path / "c"), num_shards=2, rope_scaling="llama3", seed=1)
    assert _files(c)["model-00001-of-00002.safetensors"] != fa["model-00001-of-00002.safetensors"]


def test_files_and_config(tmp_path):
    d = Path(make_tiny_model(str(tmp_path / "m")))
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"} <= names
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == 1024 and cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4] and gen["bos_token_id"] == 1


def test_sharded_tied_qwen2(tmp_path):
    from safetensors.numpy import load_file

    d = Path(make_tiny_model(str(tmp_path / "m"), num_shards=3, tie_word_embeddings=True, qkv_bias=True))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    tensors = {}
    for s in shards:
        part = load_file(str(d / s))
        assert all(index["weight_map"][k] == s for k in part)
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])
    assert "lm_head.weight" not in tensors
    assert tensors["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert tensors["model.layers.1.self_attn.k_proj.bias"].shape == (32,)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True


def test_loads_in_transformers_and_generates(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from llm_serving.tokenizer import Tokenizer

    d = make_tiny_model(str(tmp_path / "m"), rope_scaling="llama3")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    ours = Tokenizer.from_pretrained(d)
    assert len(hf_tok) == ours.vocab_size == model.config.vocab_size == 1024
    assert model.config.rope_parameters["rope_type"] == "llama3"

    # every file tensor is in the HF model, with the same values
    state = model.state_dict()
    for name, arr in load_file(str(Path(d) / "model.safetensors")).items():
        np.testing.assert_array_equal(state[name].numpy(), arr)

    ids = hf_tok("Give three tips for staying healthy.", return_tensors="pt").input_ids
    assert ids[0, 0].item() == ours.bos_token_id == 1
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
        logits = model(out).logits[0].numpy()
    gen = out[0, ids.shape[1]:].tolist()
    assert len(set(gen)) >= 8, gen  # not the same token forever
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.05  # greedy choices are not near-ties


@pytest.mark.parametrize("kwargs", [dict(tie_word_embeddings=True), dict(qkv_bias=True, num_kv_heads=4)])
def test_variants_load_in_transformers(tmp_path, kwargs):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = make_tiny_model(str(tmp_path / "m"), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = torch.tensor([[1, 100, 200, 300]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert len(set(out[0, 4:].tolist())) >= 4


def test_tokenizer_vocab_size_matches_config(tmp_path):
    from llm_serving.tokenizer import Tokenizer

    for vocab in (300, 1024, 2000):
        d = make_tiny_model(str(tmp_path / f"v{vocab}"), vocab_size=vocab, num_layers=1)
        tok = Tokenizer.from_pretrained(d)
        assert tok.vocab_size == vocab
        assert json.loads((Path(d) / "config.json").read_text())["vocab_size"] == vocab
        assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def test_bf16_weights_are_rounded_float32(tmp_path):
    from llm_serving.model_executor.loader import iter_weights

    a = dict(iter_weights(make_tiny_model(str(tmp_path / "f32"), num_layers=1)))
    b = dict(iter_weights(make_tiny_model(str(tmp_path / "bf16"), num_layers=1, dtype="bfloat16")))
    assert set(a) == set(b)
    for k in a:
        assert b[k].dtype == np.float32
        np.testing.assert_allclose(b[k], a[k], rtol=2**-8, atol=0)


def test_corpus_is_the_bundled_alpaca():
    texts, source = tiny_model.corpus_texts()
    assert source.endswith(os.path.join("clients", "data", "alpaca_521.json"))
    assert len(texts) > 1000


def test_default_dir_and_ensure(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path / "home"))
    d = default_model_dir()
    assert d == str(tmp_path / "home" / "models" / "tiny-llama")
    assert ensure_tiny_model() == d
    assert (Path(d) / "config.json").is_file() and (Path(d) / "model.safetensors").is_file()
    mtime = (Path(d) / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == d  # present: not rewritten
    assert (Path(d) / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in Path(d).parent.iterdir()) == ["tiny-llama"]  # no temp dirs left
    other = ensure_tiny_model(str(tmp_path / "x" / "y"))
    assert _files(other) == _files(d)
    monkeypatch.delenv("LLM_SERVING_HOME")
    assert default_model_dir() == str(Path.home() / ".cache" / "llm_serving" / "models" / "tiny-llama")


def test_a_built_in_model_from_an_older_generator_is_made_again(tmp_path, monkeypatch):
    """An upgrade that changes what a preset generates (tiny-qwen3's tokenizer gained Qwen3's
    marker tokens) must not go on serving the old built-in model from the cache: a model
    without the generator's stamp, or with another version, is made again, atomically."""
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path / "home"))
    d = Path(ensure_tiny_model(preset="tiny-qwen3"))
    fresh = _files(d)
    (d / tiny_model.GENERATOR_STAMP).unlink()           # as made before the stamp existed
    (d / "tokenizer.json").write_text("{}")
    assert ensure_tiny_model(preset="tiny-qwen3") == str(d) and _files(d) == fresh
    (d / tiny_model.GENERATOR_STAMP).write_text('{"generator": 1}')
    assert ensure_tiny_model(preset="tiny-qwen3") == str(d) and _files(d) == fresh
    assert sorted(p.name for p in d.parent.iterdir()) == ["tiny-qwen3"]   # nothing left over


def test_model_path_takes_a_preset_or_a_directory(tmp_path, monkeypatch):
    # a benchmark's --model: a preset's name gives its built-in model (made on first use),
    # anything else is a directory, passed through; None is the default preset's
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path / "home"))
    d = model_path("tiny")
    assert d == default_model_dir("tiny") and (Path(d) / "config.json").is_file()
    assert model_path(None, default="tiny") == d
    own = make_tiny_model(str(tmp_path / "own"), num_layers=1)
    assert model_path(own) == own
    with pytest.raises(FileNotFoundError,
                       match="bench-gq.*tiny, tiny-qwen3, tiny-qwen3-moe, tiny-internlm, "
                             "tiny-internlm2, tiny-gpt-bigcode, tiny-baichuan2, "
                             "tiny-baichuan2-alibi, tiny-w8a8, bench, bench-gqa"):
        model_path("bench-gq")                            # a typo: neither a preset nor a model
    assert default_model_dir("bench-gqa") == str(tmp_path / "home" / "models" / "bench-gqa-287m")
    assert sorted(p.name for p in (tmp_path / "home" / "models").iterdir()) == ["tiny-llama"]


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert tiny_model.main(["--out", str(out), "--num-layers", "1", "--vocab-size", "512",
                            "--qkv-bias", "--rope-scaling", "llama3", "--num-shards", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 512
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert (out / "model.safetensors.index.json").is_file()
    assert tiny_model.PRESETS["bench"] == dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                                               intermediate_size=2048, vocab_size=8000)


def test_cli_qwen3(tmp_path):
    """--preset tiny-qwen3, and --architecture qwen3 on another preset's shape: checkpoints
    transformers loads as Qwen3ForCausalLM, with the q/k norm weights [head_dim]."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "q3"
    assert tiny_model.main(["--out", str(out), "--preset", "tiny-qwen3"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (64, 4, 32)
    assert cfg["tie_word_embeddings"] and not cfg["attention_bias"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert tuple(model.model.layers[1].self_attn.k_norm.weight.shape) == (32,)
    out = tmp_path / "q3-llama-shape"
    assert tiny_model.main(["--out", str(out), "--architecture", "qwen3", "--head-dim", "8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["head_dim"]) == (["Qwen3ForCausalLM"], 8)
    with pytest.raises(ValueError, match="qkv_bias"):
        make_tiny_model(str(tmp_path / "m"), architecture="qwen3", qkv_bias=True)
    with pytest.raises(ValueError, match="architecture"):
        make_tiny_model(str(tmp_path / "m"), architecture="gemma")


def test_cli_qwen3_moe(tmp_path):
    """--preset tiny-qwen3-moe: a checkpoint transformers loads as Qwen3MoeForCausalLM, with
    per-expert weights under the HF names, a router [experts, hidden], and layer 1 dense."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "q3moe"
    assert tiny_model.main(["--out", str(out), "--preset", "tiny-qwen3-moe"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["norm_topk_prob"], cfg["mlp_only_layers"]) == (8, 2, 32, True, [1])
    names = dict(read_safetensors(out / "model.safetensors"))
    assert names["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert names["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert names["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    assert not any(n.startswith("model.layers.1.mlp.experts") for n in names)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        make_tiny_model(str(tmp_path / "m"), architecture="qwen3_moe", num_experts=2,
                        num_experts_per_tok=3)


def test_qwen3_has_its_thinking_and_tool_markers_as_single_tokens(tmp_path):
    """As Qwen3's tokenizer: <think>, </think>, <tool_call>, </tool_call> are one token each
    (added, not special: a decode that skips special tokens keeps them), for our tokenizer and
    transformers' alike; the vocabulary keeps its size."""
    transformers = pytest.importorskip("transformers")
    from llm_serving.tokenizer import Tokenizer
    out = make_tiny_model(str(tmp_path / "q3"), **tiny_model.PRESETS["tiny-qwen3"])
    text = "a<think>b</think>c<tool_call>d</tool_call>"
    for tok in (Tokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(out)):
        ids = tok.encode(text, add_special_tokens=False)
        assert [i for i in ids if i >= 1020] == [1020, 1021, 1022, 1023]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert len(tok.get_vocab()) == 1024


def test_cli_internlm(tmp_path):
    """--preset tiny-internlm: internlm-7b's config.json keys (bias, rotary; no
    num_key_value_heads) and biases on the q, k, v and o projections under Llama's names."""
    out = tmp_path / "internlm"
    assert tiny_model.main(["--out", str(out), "--preset", "tiny-internlm"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["InternLMForCausalLM"], "internlm")
    assert cfg["bias"] is True and cfg["rotary"] == {"base": 10000.0, "type": "dynamic"}
    assert "num_key_value_heads" not in cfg and "rope_theta" not in cfg
    names = dict(read_safetensors(out / "model.safetensors"))
    for part in ("q", "k", "v", "o"):
        assert names[f"model.layers.1.self_attn.{part}_proj.bias"].shape == (64,)
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(str(tmp_path / "m"), architecture="internlm", num_kv_heads=2)


def test_cli_internlm2(tmp_path):
    """--preset tiny-internlm2: InternLM2's weight names, each layer's q, k and v packed per KV
    group in attention.wqkv (here 2 query heads, then the key, then the value, per KV head), and
    internlm2-chat-7b's dynamic rope scaling."""
    out = tmp_path / "internlm2"
    assert tiny_model.main(["--out", str(out), "--preset", "tiny-internlm2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["InternLM2ForCausalLM"], "internlm2")
    assert cfg["bias"] is False and cfg["rope_scaling"] == {"type": "dynamic", "factor": 2.0}
    names = dict(read_safetensors(out / "model.safetensors"))
    assert sorted(n for n in names if ".layers." not in n) == [
        "model.norm.weight", "model.tok_embeddings.weight", "output.weight"]
    assert sorted(n[len("model.layers.0."):] for n in names if ".layers.0." in n) == [
        "attention.wo.weight", "attention.wqkv.weight", "attention_norm.weight",
        "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
        "ffn_norm.weight"]
    llama = dict(read_safetensors(Path(make_tiny_model(str(tmp_path / "llama"))) /
                                  "model.safetensors"))
    wqkv = names["model.layers.1.attention.wqkv.weight"].reshape(2, 4, 16, 64)
    q = llama["model.layers.1.self_attn.q_proj.weight"].reshape(2, 2, 16, 64)
    np.testing.assert_array_equal(wqkv[:, :2], q)
    np.testing.assert_array_equal(wqkv[:, 2].reshape(32, 64),
                                  llama["model.layers.1.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(wqkv[:, 3].reshape(32, 64),
                                  llama["model.layers.1.self_attn.v_proj.weight"])


def test_builtin_names_a_preset_by_its_directory(tmp_path, monkeypatch):
    from llm_serving.cli_args import resolve_model
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path / "home"))
    d = resolve_model("builtin:tiny-qwen3")
    assert d == default_model_dir("tiny-qwen3")
    assert json.loads((Path(d) / "config.json").read_text())["model_type"] == "qwen3"
    assert resolve_model("builtin:tiny-llama") == default_model_dir("tiny")
    d = resolve_model("builtin:tiny-qwen3-moe")
    assert d == default_model_dir("tiny-qwen3-moe")
    assert json.loads((Path(d) / "config.json").read_text())["model_type"] == "qwen3_moe"
    d = resolve_model("builtin:tiny-internlm")
    assert d == default_model_dir("tiny-internlm")
    assert json.loads((Path(d) / "config.json").read_text())["model_type"] == "internlm"
    d = resolve_model("builtin:tiny-internlm2")
    assert d == default_model_dir("tiny-internlm2")
    assert json.loads((Path(d) / "config.json").read_text())["model_type"] == "internlm2"
    from llm_serving.errors import ConfigError
    with pytest.raises(ConfigError, match="builtin:tiny-qwen2: no built-in model") as e:
        resolve_model("builtin:tiny-qwen2")          # a typo gave the tiny Llama, silently
    assert e.value.key == "model" and "builtin:tiny-qwen3" in str(e.value)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(str(tmp_path / "m"), num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_model(str(tmp_path / "m"), dtype="int8")
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(str(tmp_path / "m"), vocab_size=100)


def test_ensure_concurrent_and_blocked(tmp_path):
    import threading

    target = str(tmp_path / "shared" / "tiny-llama")
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny_model(target))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target] * 3
    assert sorted(p.name for p in Path(target).parent.iterdir()) == ["tiny-llama"]
    assert _files(target) == _files(make_tiny_model(str(tmp_path / "ref")))

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "junk").write_text("x")
    with pytest.raises(OSError, match="no config.json"):
        ensure_tiny_model(str(blocked))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "ref", "shared"]
