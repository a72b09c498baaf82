"""vLLM 0.32's --kv-cache-metrics (KV block residency histograms) over a real server and
``requests``, and offline in ``LLM.get_metrics()``.

The residency histograms are checked against what the requests did to a pool of 24 blocks:
how many blocks had to be taken again, the prefix-cache hits, and the wall clock.
"""
from __future__ import annotations

import random
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from llm_serving.cli import build_parser, server_settings
from llm_serving.errors import ConfigError
from test_http_server import free_port, serve_model, stop_server

NUM_BLOCKS, BLOCK = 24, 16
FLAGS = ("--kv-cache-metrics", "--kv-cache-metrics-sample", "1")
RESIDENCY = ("kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
             "kv_block_reuse_gap_seconds")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    started = time.monotonic()
    proc, url = serve_model(tiny_model_dir, *FLAGS, port=free_port(), num_blocks=NUM_BLOCKS)
    try:
        yield proc, url, started
    finally:
        if proc.poll() is None:
            assert stop_server(proc) == 0


def complete(url: str, prompt: list[int], max_tokens: int) -> None:
    r = requests.post(url + "/v1/completions", json=dict(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0), timeout=60)
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def histograms(url: str) -> dict:
    """name -> {"count", "sum", "buckets": {le: cumulative count}, "labels", "type"}."""
    out = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics").text):
        name = family.name.removeprefix("vllm:")
        if name not in RESIDENCY:
            continue
        h = out[name] = {"type": family.type, "buckets": {}}
        for s in family.samples:
            if s.name.endswith("_bucket"):
                h["buckets"][float(s.labels["le"])] = s.value
            elif s.name.endswith(("_count", "_sum")):
                h[s.name.rsplit("_", 1)[1]] = s.value
                h["labels"] = s.labels
    return out


def test_residency_histograms_follow_the_blocks_evicted(server):
    _, url, started = server
    before = histograms(url)
    assert set(before) == set(RESIDENCY)
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    for _ in range(3):      # its 2 full blocks: found twice each, one reuse gap each
        complete(url, shared, 4)
        time.sleep(0.05)
    taken = 0
    for _ in range(6):      # 10 blocks each, from a pool of 24: every block is taken again
        prompt = [rng.randrange(3, 1000) for _ in range(150)]
        complete(url, prompt, 4)
        taken += -(-(150 + 3) // BLOCK)
    elapsed = time.monotonic() - started
    after = histograms(url)
    new = {n: after[n]["count"] - before[n]["count"] for n in RESIDENCY}
    # every block taken again was evicted: a take beyond the pool's 24 blocks is one at least
    assert new["kv_block_lifetime_seconds"] >= taken - NUM_BLOCKS
    assert new["kv_block_idle_before_evict_seconds"] == new["kv_block_lifetime_seconds"]
    assert new["kv_block_reuse_gap_seconds"] >= 2
    for name, h in after.items():
        assert h["type"] == "histogram" and set(h["labels"]) == {"engine", "model_name"}
        assert sorted(h["buckets"])[:3] == [0.001, 0.002, 0.005]     # vLLM's bounds
        assert max(b for b in h["buckets"] if b != float("inf")) == 1800
        # no block lived, sat idle or waited for a hit longer than the server has run
        limit = min(b for b in h["buckets"] if b >= elapsed)
        assert h["buckets"][limit] == h["count"], name
        assert h["sum"] - before[name]["sum"] <= new[name] * elapsed
    assert after["kv_block_idle_before_evict_seconds"]["sum"] \
        <= after["kv_block_lifetime_seconds"]["sum"] + 1e-6


def test_get_metrics_offline_with_and_without_the_flags(tiny_model_dir):
    from llm_serving import LLM, SamplingParams
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    prompt = list(range(3, 33))
    llm = LLM(tiny_model_dir, disable_log_stats=False, num_blocks=NUM_BLOCKS,
              kv_cache_metrics=True)
    llm.generate([{"prompt_token_ids": prompt}], params)
    got = {m.name.removeprefix("vllm:"): m for m in llm.get_metrics()}
    assert all(type(got[n]).__name__ == "Histogram" for n in RESIDENCY)
    del llm
    llm = LLM(tiny_model_dir, disable_log_stats=False, num_blocks=NUM_BLOCKS)
    llm.generate([{"prompt_token_ids": prompt}], params)
    got = {m.name.removeprefix("vllm:"): m for m in llm.get_metrics()}
    assert not set(RESIDENCY) & set(got)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_the_sample_rate_is_checked_as_vllm_checks_it(tiny_model_dir, value):
    with pytest.raises(ConfigError) as e:
        server_settings(build_parser().parse_args(
            ["serve", "--model", tiny_model_dir, "--kv-cache-metrics", "--kv-cache-metrics-sample",
             value]))
    assert e.value.key == "kv_cache_metrics_sample" and value in str(e.value)


def test_the_yaml_keys_are_checked_too(tiny_model_dir, tmp_path):
    cfg = tmp_path / "metrics.yaml"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  kv_cache_metrics: true\n"
                   "  kv_cache_metrics_sample: 0\n")
    with pytest.raises(ConfigError) as e:
        server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert e.value.key == "kv_cache_metrics_sample"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  kv_cache_metrics: true\n"
                   "  kv_cache_metrics_sample: 0.05\n")
    args = server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))[0]
    assert (args.kv_cache_metrics, args.kv_cache_metrics_sample) == (True, 0.05)
