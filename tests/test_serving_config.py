"""llm-serving's YAML files load unchanged; bad ones fail naming the key."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_serving.cli_args import DEFAULT_CONFIG, find_config
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
    assert "\n" not in warning                    # one line, as llm-serving users were told
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


def test_an_empty_seq_length_is_llm_servings_dynamic_length(tmp_path):
    """llm-serving's check_valid_config takes an empty seq_length as a dynamic sequence
    length (seq_type "dyn"), and an empty zactivate_len too (mindspore-ai/serving, branch dev,
    mindspore_serving/config/config.py): such a file loads, max_generate_length (else the
    model) bounding the length."""
    p = tmp_path / "c.yaml"
    legacy = ("model_config: {{model_name: m, end_token: 2, vocab_size: 10, seq_length: [], "
              "zactivate_len: [], decode_batch_size: [8]{}}}\nllm_serving: {{model: /m}}\n")
    p.write_text(legacy.format(", max_generate_length: 1024"))
    kw = load_config(p).engine_kwargs
    assert kw["max_model_len"] == 1024 and kw["max_num_seqs"] == 8
    p.write_text(legacy.format(""))
    assert "max_model_len" not in load_config(p).engine_kwargs


@pytest.mark.parametrize("text, key", [
    ("model_config: {model_name: m, end_token: 2, vocab_size: 10, decode_batch_size: abc}",
     "model_config.decode_batch_size"),
    ("model_config: {model_name: m, vocab_size: 10}", "model_config.end_token"),
    ("model_config: {model_name: m, end_token: 2, vocab_size: 10, decode_batch_size: []}",
     "model_config.decode_batch_size"),
    ("model_config: {model_name: m, end_token: 2, vocab_size: 10, seq_length: [0]}",
     "model_config.seq_length"),
    ("serving_config: {agent_ports: [1]}", "serving_config.server_port"),
    ("serving_config: {agent_ports: [1], server_port: 99999}", "serving_config.server_port"),
    ("pa_config: {num_blocks: -1}", "pa_config.num_blocks"),
    ("pa_config: {block_sise: 16}", "pa_config.block_sise"),
    ("modle_config: {}", "modle_config"),
    ("serving_config: {agent_ports: [1], server_port: 8835}", "llm_serving.model"),
    ("llm_serving: {model: /m, max_num_seqz: 5}", "llm_serving.max_num_seqz"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    p = tmp_path / "c.yaml"
    ours = "llm_serving" in text or key == "llm_serving.model"
    p.write_text(text + ("\n" if ours else "\nllm_serving: {model: /m}\n"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(key + ":"), str(e.value)
    if key == "llm_serving.max_num_seqz":
        assert "did you mean max_num_seqs?" in str(e.value)


def _start_error(config: Path, *flags: str) -> str:
    """The error line of ``start.py --config FILE --dry-run``, which must fail."""
    r = subprocess.run([sys.executable, str(ROOT / "start.py"), "--config", str(config),
                        "--dry-run", *flags], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    return next(line for line in r.stderr.splitlines() if line.startswith("error: "))


def test_an_impossible_legacy_value_is_named_by_its_key_in_the_file(tmp_path, tiny_model_dir):
    """The shipped file's max_generate_length: 4096 on a model of 2048 positions, or three
    agent_ports for a model of 4 heads: the error names the key the user wrote, not the
    engine argument it became; given as a flag, the flag's own name."""
    p = tmp_path / "c.yaml"
    for length, ports, key in [(4096, "[1]", "model_config.max_generate_length"),
                               (1024, "[1, 2, 3]", "serving_config.agent_ports")]:
        p.write_text(f"model_config: {{model_name: m, end_token: 2, vocab_size: 1024, "
                     f"max_generate_length: {length}}}\n"
                     f"serving_config: {{agent_ports: {ports}, server_port: 8835}}\n"
                     f"llm_serving: {{model: {tiny_model_dir}}}\n")
        assert _start_error(p).startswith(f"error: {key}: ")
    assert _start_error(p, "--tensor-parallel-size", "3").startswith(
        "error: tensor_parallel_size: 3 does not divide")


def test_serve_with_only_a_model_takes_the_engine_defaults_not_the_tiny_models_file(tmp_path):
    """``start.py --model DIR`` must not inherit the tiny default's batch and KV pool (64
    sequences, 1024 blocks): a user serving their model gets the engine's defaults, as with
    ``vllm serve DIR``; with no flags at all the tiny default's file still applies."""
    from llm_serving.cli import build_parser, server_settings
    defaults = EngineArgs(model="/m")
    engine_args = server_settings(build_parser().parse_args(["serve", "--model", "/m"]))[0]
    assert (engine_args.max_num_seqs, engine_args.num_blocks, engine_args.max_model_len) == \
        (defaults.max_num_seqs, None, None)
    tiny = load_config(find_config(DEFAULT_CONFIG)).engine_kwargs
    engine_args = server_settings(build_parser().parse_args(["serve"]))[0]
    assert (engine_args.max_num_seqs, engine_args.num_blocks) == \
        (tiny["max_num_seqs"], tiny["num_blocks"])
    assert tiny["max_num_seqs"] != defaults.max_num_seqs
    # A config file given with --model is read, the flag overriding its model.
    args = build_parser().parse_args(["serve", "--config", DEFAULT_CONFIG, "--model", "/m"])
    engine_args = server_settings(args)[0]
    assert (engine_args.model, engine_args.num_blocks) == ("/m", tiny["num_blocks"])


def test_the_served_model_name_is_the_model_as_given_unless_named():
    """As ``vllm serve MODEL``: clients see the --model string (a path or an HF-style id) in
    /v1/models, the answers' model field and the metrics' model_name; an llm-serving config
    serves its model_config.model_name (else its model directory's name);
    --served-model-name wins over both."""
    from llm_serving.cli import build_parser, server_settings

    def name(*argv):
        return server_settings(build_parser().parse_args(["serve", *argv]))[1]
    assert name() == "tiny-llama"             # the built-in default's directory
    assert name("--model", "/data/Llama-2-7b-hf") == "/data/Llama-2-7b-hf"
    assert name("--config", DEFAULT_CONFIG, "--model", "/m") == "/m"
    assert name("--model", "/m", "--served-model-name", "llama") == "llama"


def _serving_yaml(tmp_path, ports, section=""):
    p = tmp_path / "tp.yaml"
    p.write_text(f"serving_config: {{agent_ports: {ports}, server_port: 8835, "
                 f"start_device_id: 4}}\nllm_serving: {{model: /m{section}}}\n")
    return p


def test_tensor_parallel_size_comes_from_agent_ports_unless_given(tmp_path):
    from llm_serving.cli import build_parser, server_settings
    kw = load_config(_serving_yaml(tmp_path, [16002, 16003])).engine_kwargs
    assert kw["tensor_parallel_size"] == 2 and kw["start_device_id"] == 4
    kw = load_config(_serving_yaml(tmp_path, [16002])).engine_kwargs
    assert "tensor_parallel_size" not in kw                 # one port says nothing about tp
    kw = load_config(_serving_yaml(tmp_path, [16002]), {"tensor_parallel_size": 2}).engine_kwargs
    assert kw["tensor_parallel_size"] == 2
    kw = load_config(_serving_yaml(tmp_path, [1, 2], ", tensor_parallel_size: 2")).engine_kwargs
    assert kw["tensor_parallel_size"] == 2
    # The server: one WorkAgent per port, in agent processes.
    args = build_parser().parse_args(["serve", "--config", str(_serving_yaml(tmp_path, [1, 2]))])
    engine_args = server_settings(args)[0]
    assert engine_args.tensor_parallel_size == 2
    assert engine_args.distributed_executor_backend == "mp"
    assert engine_args.start_device_id == 4
    core = min(os.sched_getaffinity(0))
    args = build_parser().parse_args(["serve", "--config", str(_serving_yaml(tmp_path, [1])),
                                      "--tensor-parallel-size", "2",
                                      "--cpu-affinity", f"{core}|{core}"])
    engine_args = server_settings(args)[0]
    assert (engine_args.tensor_parallel_size, engine_args.cpu_affinity) == (2, [[core], [core]])


@pytest.mark.parametrize("section, overrides, key", [
    (", tensor_parallel_size: 3", None, "llm_serving.tensor_parallel_size"),
    ("", {"tensor_parallel_size": 1}, "--tensor-parallel-size"),
])
def test_tensor_parallel_size_conflicting_with_agent_ports_names_both(tmp_path, section,
                                                                      overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(_serving_yaml(tmp_path, [1, 2], section), overrides)
    assert str(e.value).startswith(key + ":") and "serving_config.agent_ports" in str(e.value)


def test_offline_tensor_parallel_uses_agents_and_checks_its_knobs():
    assert EngineArgs(model="/m").distributed_executor_backend == "uni"
    args = EngineArgs(model="/m", tensor_parallel_size=2)
    assert args.distributed_executor_backend == "mp" and args.cpu_affinity is None
    c = min(os.sched_getaffinity(0))
    assert EngineArgs(model="/m", tensor_parallel_size=2,
                      cpu_affinity=[[c], str(c)]).cpu_affinity == [[c], [c]]
    one = EngineArgs(model="/m", cpu_affinity=str(c))   # pinning needs an agent, even for one
    assert one.distributed_executor_backend == "mp" and one.cpu_affinity == [[c]]
    for kw, key in [(dict(tensor_parallel_size=0), "tensor_parallel_size"),
                    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
                     "distributed_executor_backend"),
                    (dict(cpu_affinity="0", distributed_executor_backend="uni"), "cpu_affinity"),
                    (dict(tensor_parallel_size=2, cpu_affinity="0"), "cpu_affinity"),
                    (dict(cpu_affinity="0-x"), "cpu_affinity"),
                    (dict(cpu_affinity=[[0.5]]), "cpu_affinity"),
                    (dict(cpu_affinity="4096"), "cpu_affinity"),
                    (dict(start_device_id=-1), "start_device_id")]:
        with pytest.raises(ConfigError) as e:
            EngineArgs(model="/m", **kw)
        assert e.value.key == key, (kw, str(e.value))


def test_a_model_that_cannot_be_split_is_refused_before_any_agent_starts(model_dirs):
    with pytest.raises(ConfigError, match="tensor_parallel_size: 4 does not divide the "
                                          "model's 6 attention heads"):
        EngineArgs(model_dirs["qwen2-mqa-tied"], num_blocks=16, block_size=16,
                   max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                   tensor_parallel_size=4).create_engine_config()
