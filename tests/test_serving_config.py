"""llm-serving's YAML files load unchanged; bad ones fail naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from llm_serving.cli import find_config
from llm_serving.config import EngineArgs
from llm_serving.errors import ConfigError
from llm_serving.serving_config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_llama_7b_config_maps_the_knobs_that_still_mean_something():
    path = find_config("llama_7b_kbk_pa_dyn.yaml")       # a bare name, as users pass it
    assert path == ROOT / "configs" / "llama" / "llama_7b_kbk_pa_dyn.yaml"
    cfg = load_config(path)
    kw = cfg.engine_kwargs
    assert kw["max_num_seqs"] == 128 and kw["max_model_len"] == 4096
    assert kw["num_blocks"] == 1024 and kw["block_size"] == 16
    assert kw["enable_prefix_caching"] is True
    assert (cfg.host, cfg.port, cfg.agent_ports) == ("127.0.0.1", 8835, [16002])
    EngineArgs.from_kwargs(**kw)                           # every key is an engine argument
    warning = cfg.ignored_warning()
    for key in ("model_config.seq_length", "model_config.batch_waiting_time",
                "model_config.backend", "tokenizer", "warmup_inputs"):
        assert key in warning
    assert "decode_batch_size" not in warning and "pa_config.num_blocks" not in warning


def test_cli_overrides_win_and_our_section_wins_over_legacy_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model_config: {model_name: m, end_token: 2, vocab_size: 10, "
                 "decode_batch_size: [4, 8]}\nllm_serving: {model: /m, max_num_seqs: 6}\n")
    assert load_config(p).engine_kwargs["max_num_seqs"] == 6
    assert load_config(p, {"max_num_seqs": 2}).engine_kwargs["max_num_seqs"] == 2
    p.write_text("model_config: {model_name: m, end_token: 2, vocab_size: 10, "
                 "decode_batch_size: [4, 8]}\nllm_serving: {model: /m}\n")
    assert load_config(p).engine_kwargs["max_num_seqs"] == 8


@pytest.mark.parametrize("text, key", [
    ("model_config: {model_name: m, end_token: 2, vocab_size: 10, decode_batch_size: abc}",
     "model_config.decode_batch_size"),
    ("model_config: {model_name: m, vocab_size: 10}", "model_config.end_token"),
    ("serving_config: {agent_ports: [1]}", "serving_config.server_port"),
    ("serving_config: {agent_ports: [1], server_port: 99999}", "serving_config.server_port"),
    ("pa_config: {num_blocks: -1}", "pa_config.num_blocks"),
    ("pa_config: {block_sise: 16}", "pa_config.block_sise"),
    ("modle_config: {}", "modle_config"),
    ("serving_config: {agent_ports: [1], server_port: 8835}", "llm_serving.model"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    p = tmp_path / "c.yaml"
    p.write_text(text + ("\nllm_serving: {model: /m}\n" if "llm_serving.model" != key else "\n"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(key + ":"), str(e.value)
