"""llm-serving's config with no llm_serving section serves the model it names: a mindformers
model yaml (``model_config.model_cfg_path``, whose ``load_checkpoint`` is a MindSpore .ckpt) and
``tokenizer.vocab_file``. The tiny model, converted to exactly that, must answer as it does
from its HF directory."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llm_serving.errors import ConfigError
from llm_serving.serving_config import load_config

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):"]


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    """Materialized model directories go to a home of the test session's own."""
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def _mindformers_yaml(cfg: dict, checkpoint: str, **extra) -> str:
    """A mindformers predict yaml (predict_llama2_7b.yaml's shape) with the model's real
    dimensions, under mindformers' own key names."""
    mc = {
        "type": "LlamaConfig", "batch_size": 1, "seq_length": cfg["max_position_embeddings"],
        "hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
        "num_heads": cfg["num_attention_heads"], "n_kv_heads": cfg["num_key_value_heads"],
        "intermediate_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg["rms_norm_eps"], "theta": cfg["rope_theta"],
        "max_position_embedding": cfg["max_position_embeddings"],
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": 0, "compute_dtype": "float32", "param_init_type": "float32",
        "use_past": True, "use_flash_attention": False, "block_size": 16, "num_blocks": 512,
        **extra,
    }
    mc = {k: v for k, v in mc.items() if v is not None}     # extra's None: the key left out
    import yaml
    return yaml.safe_dump({
        "seed": 0, "run_mode": "predict", "load_checkpoint": checkpoint,
        "auto_trans_ckpt": False, "use_parallel": False,
        "model": {"model_config": mc, "arch": {"type": "LlamaForCausalLM"}},
        "processor": {"return_tensors": "ms", "tokenizer": {"type": "LlamaTokenizer"}},
    }, sort_keys=False)


def _serving_yaml(model_cfg_path: str, vocab_file, *, vocab_size=1024, end_token="[2, 4]",
                  extra="") -> str:
    """configs/llama/llama_7b_kbk_pa_dyn.yaml's shape, without our llm_serving section."""
    tokenizer = ("tokenizer:\n  type: LlamaTokenizer\n"
                 + (f"  vocab_file: '{vocab_file}'\n" if vocab_file else ""))
    return f"""model_config:
  model_name: 'llama_tiny'
  max_generate_length: 2048
  end_token: {end_token}
  seq_length: [2048]
  vocab_size: {vocab_size}
  prefill_batch_size: [1]
  decode_batch_size: [8]
  zactivate_len: [512, 1024, 2048]
  model_type: 'dyn'
  seq_type: 'static'
  batch_waiting_time: 0.0
  decode_batch_waiting_time: 0.0
  batching_strategy: 'continuous'
  current_index: False
  page_attention: True
  model_dtype: "DataType.FLOAT32"
  pad_token_id: 0
  backend: 'kbk'
  model_cfg_path: '{model_cfg_path}'
serving_config:
  agent_ports: [16002]
  start_device_id: 0
  server_ip: '127.0.0.1'
  server_port: 8835
pa_config:
  num_blocks: 256
  block_size: 16
  decode_seq_length: 2048
{tokenizer}basic_inputs:
  type: LlamaBasicInputs
extra_inputs:
  type: LlamaExtraInputs
warmup_inputs:
  type: LlamaWarmupInputs
{extra}"""


@pytest.fixture(scope="module")
def tiny_cfg(tiny_model_dir):
    return json.loads((Path(tiny_model_dir) / "config.json").read_text())


@pytest.fixture(scope="module")
def legacy(tiny_model_dir, tiny_cfg, tmp_path_factory):
    """The tiny model as llm-serving users have it: a .ckpt with mindformers' names, a
    mindformers yaml naming it by a path relative to the yaml, and llm-serving's yaml. The
    tiny model has only a tokenizer.json, so vocab_file is that file."""
    pytest.importorskip("mindspore")
    from llm_serving.model_executor.loader import save_mindformers_ckpt
    root = tmp_path_factory.mktemp("mf")
    save_mindformers_ckpt(tiny_model_dir, str(root / "ckpt" / "tiny.ckpt"))
    (root / "predict_llama_tiny.yaml").write_text(_mindformers_yaml(tiny_cfg, "ckpt/tiny.ckpt"))
    path = root / "llama_tiny_kbk_pa_dyn.yaml"
    path.write_text(_serving_yaml(str(root / "predict_llama_tiny.yaml"),
                                  Path(tiny_model_dir) / "tokenizer.json"))
    return path


def test_legacy_config_serves_the_mindformers_model_as_its_hf_directory(legacy, tiny_llm,
                                                                         tiny_model_dir,
                                                                         tmp_path, monkeypatch):
    from llm_serving import LLM, SamplingParams
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path / "home"))      # empty, of its own
    cfg = load_config(legacy)
    kw = dict(cfg.engine_kwargs)
    model_dir = Path(kw["model"])
    assert model_dir.parent == Path(os.environ["LLM_SERVING_HOME"]) / "models" / "mindformers"
    assert model_dir.name.startswith("llama_tiny-")
    assert kw["checkpoint"] == str(legacy.parent / "ckpt" / "tiny.ckpt")
    assert os.readlink(model_dir / "tokenizer.json") == str(
        (Path(tiny_model_dir) / "tokenizer.json").resolve())
    assert (model_dir / "tokenizer_config.json").is_symlink()     # its sibling, linked too
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 4]
    assert str(model_dir) in cfg.model_source and "tiny.ckpt" in cfg.model_source
    warning = cfg.ignored_warning()
    for used in ("model_cfg_path", "end_token", "vocab_size", "  tokenizer:"):
        assert used not in warning, used
    assert "model_config.backend" in warning
    # The same start again: the same directory, not a second one.
    assert load_config(legacy).engine_kwargs["model"] == str(model_dir)
    assert len(list(model_dir.parent.iterdir())) == 1

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(**kw)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params)]
    assert got == want and all(len(t) == 8 for t in got)
    assert llm.tokenizer.encode(PROMPTS[0]) == tiny_llm.tokenizer.encode(PROMPTS[0])
    assert llm.tokenizer.eos_token_ids == tiny_llm.tokenizer.eos_token_ids


def test_the_model_flag_and_our_section_still_win(legacy, tmp_path):
    cfg = load_config(legacy, {"model": "/m"})
    assert cfg.engine_kwargs["model"] == "/m" and "checkpoint" not in cfg.engine_kwargs
    assert "model_config.model_cfg_path" in cfg.ignored_warning()
    p = tmp_path / "c.yaml"
    p.write_text(legacy.read_text() + "llm_serving:\n  model: /m\n")
    assert load_config(p).engine_kwargs["model"] == "/m"
    # llm_serving.checkpoint wins over load_checkpoint, and then none is needed.
    p.write_text(legacy.read_text() + "llm_serving:\n  checkpoint: /other.ckpt\n")
    assert load_config(p).engine_kwargs["checkpoint"] == "/other.ckpt"


def test_dry_run_shows_the_resolved_model(legacy):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "start.py", "--config", str(legacy), "--dry-run"],
                         cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr
    model_line = res.stdout.splitlines()[1]     # after the KV pool's line
    assert model_line.startswith("model: ") and "/models/mindformers/llama_tiny-" in model_line
    assert "checkpoint: " + str(legacy.parent / "ckpt" / "tiny.ckpt") in model_line
    assert "model_config.model_cfg_path" in res.stderr      # the log line naming the source


def test_sentencepiece_vocab_file_is_linked_as_tokenizer_model(tiny_cfg, tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from llm_serving.model_executor.tiny_model import corpus_texts
    from llm_serving.tokenizer import Tokenizer
    sp = tmp_path / "sp"
    sp.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts()[0]), model_prefix=str(sp / "tokenizer"),
        vocab_size=600, model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, num_threads=1, minloglevel=2, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True)
    (tmp_path / "c.ckpt").write_bytes(b"")
    (tmp_path / "mf.yaml").write_text(_mindformers_yaml(tiny_cfg, "c.ckpt"))
    p = tmp_path / "c.yaml"
    # Relative paths: read from the current directory first, as llm-serving did, else from
    # the config file's directory.
    p.write_text(_serving_yaml("mf.yaml", "sp/tokenizer.model", end_token=2))
    model_dir = Path(load_config(p).engine_kwargs["model"])
    assert os.readlink(model_dir / "tokenizer.model") == str(sp / "tokenizer.model")
    assert not (model_dir / "tokenizer.json").exists()
    ours = Tokenizer.from_pretrained(str(model_dir))
    text = "Give three tips for staying healthy."
    assert ours.encode(text) == [1] + spm.SentencePieceProcessor(
        model_file=str(sp / "tokenizer.model")).encode(text)
    assert ours.eos_token_ids == {2}


def test_hf_config_round_trips_through_to_hf_dict(tiny_model_dir, model_dirs):
    from llm_serving.model_executor.loader import ModelConfig
    for d in [tiny_model_dir, *model_dirs.values()]:
        c = ModelConfig.from_pretrained(d)
        assert ModelConfig.from_dict(c.to_hf_dict()) == c


# --- failures: one line, naming the key and the file -----------------------------------------


@pytest.fixture
def files(tiny_cfg, tmp_path):
    """A mindformers yaml, a checkpoint (not read before the engine starts) and a tokenizer
    file, for the error cases to break one at a time."""
    (tmp_path / "c.ckpt").write_bytes(b"")
    (tmp_path / "tokenizer.model").write_bytes(b"")
    (tmp_path / "mf.yaml").write_text(_mindformers_yaml(tiny_cfg, "c.ckpt"))
    return tmp_path


def _load(d: Path, text: str):
    p = d / "serving.yaml"
    p.write_text(text)
    return load_config(p)


def _fails(d: Path, text: str, key: str, *words: str) -> str:
    with pytest.raises(ConfigError) as e:
        _load(d, text)
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_no_model_at_all_says_what_to_add(files):
    text = _serving_yaml("x", None).replace("  model_cfg_path: 'x'\n", "")
    _fails(files, text, "llm_serving.model", "llm_serving.model: <an HF model directory>",
           "--model", "model_config.model_cfg_path", "tokenizer.vocab_file")


def test_a_missing_mindformers_yaml_names_the_key_and_file(files):
    _fails(files, _serving_yaml(str(files / "nope.yaml"), files / "tokenizer.model"),
           "model_config.model_cfg_path", str(files / "nope.yaml"), "llm_serving.model")


def test_an_unparseable_mindformers_yaml_names_the_key_and_file(files, tiny_cfg):
    (files / "mf.yaml").write_text("model:\n  model_config: {hidden_size: [\n")
    _fails(files, _serving_yaml(str(files / "mf.yaml"), files / "tokenizer.model"),
           "model_config.model_cfg_path", str(files / "mf.yaml"), "not valid YAML")
    (files / "mf.yaml").write_text("model:\n  arch: {type: LlamaForCausalLM}\n")
    _fails(files, _serving_yaml(str(files / "mf.yaml"), files / "tokenizer.model"),
           "model_config.model_cfg_path", str(files / "mf.yaml"), "model.model_config")
    (files / "mf.yaml").write_text(_mindformers_yaml(tiny_cfg, "c.ckpt", num_heads=None))
    _fails(files, _serving_yaml(str(files / "mf.yaml"), files / "tokenizer.model"),
           "model_config.model_cfg_path", str(files / "mf.yaml"), "num_heads")


def test_a_missing_vocab_file_names_the_key(files):
    _fails(files, _serving_yaml(str(files / "mf.yaml"), None), "tokenizer.vocab_file",
           "missing")
    _fails(files, _serving_yaml(str(files / "mf.yaml"), files / "gone.model"),
           "tokenizer.vocab_file", str(files / "gone.model"))
    (files / "vocab.json").write_text('{"a": 0}')
    _fails(files, _serving_yaml(str(files / "mf.yaml"), files / "vocab.json"),
           "tokenizer.vocab_file", "not a Hugging Face tokenizer.json")
    # llm_serving.tokenizer instead: then no vocab_file is needed.
    cfg = _load(files, _serving_yaml(str(files / "mf.yaml"), None)
                + "llm_serving:\n  tokenizer: /tok\n")
    assert cfg.engine_kwargs["tokenizer"] == "/tok"
    assert not (Path(cfg.engine_kwargs["model"]) / "tokenizer.model").exists()


def test_a_missing_checkpoint_names_the_key_and_file(files, tiny_cfg):
    mf = files / "mf.yaml"
    serving = _serving_yaml(str(mf), files / "tokenizer.model")
    mf.write_text(_mindformers_yaml(tiny_cfg, "gone.ckpt"))
    _fails(files, serving, "load_checkpoint", "gone.ckpt", str(mf), "does not exist")
    mf.write_text(_mindformers_yaml(tiny_cfg, ""))
    _fails(files, serving, "load_checkpoint", "missing", str(mf))
    # checkpoint_name_or_path, when load_checkpoint is empty
    mf.write_text(_mindformers_yaml(tiny_cfg, "", checkpoint_name_or_path="c.ckpt"))
    assert _load(files, serving).engine_kwargs["checkpoint"] == str(files / "c.ckpt")
    # A directory: its one .ckpt (mindformers' rank_0/ layout), or an error naming them.
    (files / "dir" / "rank_0").mkdir(parents=True)
    (files / "dir" / "rank_0" / "llama.ckpt").write_bytes(b"")
    mf.write_text(_mindformers_yaml(tiny_cfg, "dir"))
    assert _load(files, serving).engine_kwargs["checkpoint"] == str(
        files / "dir" / "rank_0" / "llama.ckpt")
    (files / "dir" / "rank_1").mkdir()
    (files / "dir" / "rank_1" / "llama.ckpt").write_bytes(b"")
    _fails(files, serving, "load_checkpoint", "2 .ckpt files", "rank_1/llama.ckpt")
    (files / "empty").mkdir()
    mf.write_text(_mindformers_yaml(tiny_cfg, "empty"))
    _fails(files, serving, "load_checkpoint", "no .ckpt file")


def test_vocab_size_and_end_token_are_checked_against_the_mindformers_yaml(files):
    serving = _serving_yaml(str(files / "mf.yaml"), files / "tokenizer.model", vocab_size=32000)
    _fails(files, serving, "model_config.vocab_size", "32000", "1024", str(files / "mf.yaml"))
    serving = _serving_yaml(str(files / "mf.yaml"), files / "tokenizer.model", end_token=5000)
    _fails(files, serving, "model_config.end_token", "5000")
    # end_token is the EOS, whatever the mindformers yaml's eos_token_id says.
    model = Path(_load(files, _serving_yaml(str(files / "mf.yaml"), files / "tokenizer.model",
                                            end_token=7)).engine_kwargs["model"])
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == 7
    assert json.loads((model / "config.json").read_text())["eos_token_id"] == 7
