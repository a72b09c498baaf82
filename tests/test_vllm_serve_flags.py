"""`vllm serve` flags that users' scripts pass: vLLM's names for the KV pool size, the
logprobs cap, and the start-up checks of the ones whose values we cannot honour."""
from __future__ import annotations

import pytest

from llm_serving.cli import build_parser, server_settings
from llm_serving.errors import ConfigError


def _settings(model, *flags):
    return server_settings(build_parser().parse_args(["serve", "--model", model, *flags]))


@pytest.mark.parametrize("flags, key", [
    (["--load-format", "pt"], "load_format"),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode"),
    (["--pipeline-parallel-size", "2"], "pipeline_parallel_size"),
    (["--data-parallel-size", "2"], "data_parallel_size"),
    (["--max-logprobs", "-1"], "max_logprobs"),
    (["--max-logprobs", "21"], "max_logprobs"),
])
def test_vllm_flags_we_cannot_honour_are_refused_naming_them(tiny_model_dir, flags, key):
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, *flags)
    assert e.value.key == key and flags[1] in str(e.value)


def test_kv_cache_memory_bytes_sizes_the_pool_as_vllm_reads_it(tiny_model_dir):
    engine_args = _settings(tiny_model_dir, "--kv-cache-memory-bytes", "4M")[0]
    assert engine_args.kv_cache_memory_bytes == 4 << 20
    cfg = engine_args.create_engine_config()
    block = 2 * cfg.model.hf.num_layers * 16 * cfg.model.hf.num_kv_heads * cfg.model.hf.head_dim * 4
    assert cfg.cache.num_blocks == (4 << 20) // block
    assert _settings(tiny_model_dir, "--kv-cache-memory-bytes", "4m")[0] \
        .kv_cache_memory_bytes == 4_000_000


def test_the_engine_flags_are_yaml_keys_too(tmp_path, tiny_model_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  num_blocks: 64\n"
                   "  num_gpu_blocks_override: 300\n  max_logprobs: 5\n  load_format: auto\n")
    engine_args = server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))[0]
    assert engine_args.num_blocks == 300 and engine_args.max_logprobs == 5
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  load_format: gguf\n")
    with pytest.raises(ConfigError, match="llm_serving.load_format"):
        server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))


def test_max_logprobs_caps_what_a_request_may_ask_for(tiny_model_dir):
    from llm_serving import LLM, SamplingParams
    llm = LLM(tiny_model_dir, num_blocks=64, max_logprobs=1)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=2, logprobs=1))[0].outputs[0]
    assert all(len(entry) >= 1 for entry in out.logprobs)
    for asked in ({"logprobs": 2}, {"prompt_logprobs": 2}):
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, **asked))
