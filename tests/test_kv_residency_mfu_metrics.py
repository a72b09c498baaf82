"""vLLM 0.32's --kv-cache-metrics (KV block residency histograms) and --enable-mfu-metrics
(estimated FLOPs and bytes per device) over a real server and ``requests``, and offline in
``LLM.get_metrics()``.

The MFU counters are checked against the FLOPs and bytes computed here, from the model's
config.json and the tokens each request ran, with the formulas vLLM documents in
vllm/v1/metrics/perf.py (attention, a three-GEMM MLP and the LM head; weights read once a
step). The residency histograms are checked against what the requests did to a pool of 24
blocks: how many blocks had to be taken again, the prefix-cache hits, and the wall clock.
"""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import metric
from llm_serving.cli import build_parser, server_settings
from llm_serving.errors import ConfigError
from test_http_server import free_port, serve_model, stop_server

NUM_BLOCKS, BLOCK = 24, 16
FLAGS = ("--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--enable-mfu-metrics",
         "--log-stats-interval", "1")
RESIDENCY = ("kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
             "kv_block_reuse_gap_seconds")
MFU = ("estimated_flops_per_gpu", "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu")


def expected(cfg: dict, prompt: int, generated: int, cached: int) -> tuple[int, int, int]:
    """vLLM's estimates (FLOPs, bytes read, bytes written) for a request that runs alone,
    float32: one step prefills its ``prompt - cached`` tokens (context ``prompt``), then
    ``generated - 1`` decode steps of one token each (contexts prompt + 1, prompt + 2 ...)."""
    D, L, I, V = (cfg[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                   "vocab_size"))
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    b = 4
    prefill, decodes = prompt - cached, generated - 1
    decode_ctx = sum(prompt + k for k in range(1, generated))
    t, tc, logits, steps = prefill + decodes, prefill * prompt + decode_ctx, generated, generated
    flops = (2 * t * D * (q + 2 * kv) * d * L + 2 * t * D * q * d * L   # q/k/v and o proj
             + 2 * 2 * q * tc * d * L                                   # QK^T and AV
             + 2 * 3 * D * I * t * L                                    # gate, up, down
             + 2 * logits * D * V)                                      # LM head
    weights = (D * (q + 2 * kv) * d + q * d * D + 3 * D * I) * b * L + D * V * b
    read = (steps * weights
            + (t * D + t * q * d) * b * L                   # q/k/v and o projections' inputs
            + (t * q * d + 2 * (prompt + decode_ctx) * kv * d) * b * L  # attention: Q, K/V
            + (t * D + 3 * t * I) * b * L                   # the MLP's GEMM and SiLU inputs
            + logits * D * b)
    written = ((t * (q + 2 * kv) * d + 2 * t * kv * d + t * D) * b * L
               + (3 * t * I + t * D) * b * L + logits * V * b)
    return flops, read, written


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


def test_the_mfu_counters_are_vllms_estimates_of_the_tokens_run(server, tiny_model_dir):
    _, url, _ = server
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    runs = [(shared, 8), (shared, 8), (shared, 8)] + [
        ([rng.randrange(3, 1000) for _ in range(n)], g) for n, g in ((100, 16), (200, 4), (64, 1))]
    before = {m: metric(url, m + "_total") for m in MFU}
    want = [0, 0, 0]
    for prompt, generated in runs:
        hits = metric(url, "prefix_cache_hits_total")
        complete(url, prompt, generated)
        cached = int(metric(url, "prefix_cache_hits_total") - hits)
        assert cached % BLOCK == 0 and cached < len(prompt)
        want = [w + e for w, e in zip(want, expected(cfg, len(prompt), generated, cached))]
    assert metric(url, "prefix_cache_hits_total") > 0        # the shared prompt was found
    got = [int(metric(url, m + "_total") - before[m]) for m in MFU]
    assert got == want
    text = requests.get(url + "/metrics").text
    for m in MFU:       # vLLM's names, type and labels
        assert f"# TYPE vllm:{m} counter" in text or f"# TYPE vllm:{m}_total counter" in text
        assert re.search(rf'^vllm:{m}_total{{engine="0",model_name="[^"]+"}} ', text, re.M), m


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


def test_the_stats_log_has_vllms_mfu_line(server):
    """Last (it stops the server): the periodic stats log's MFU line, as vLLM writes it."""
    proc, url, _ = server
    complete(url, list(range(3, 203)), 16)
    time.sleep(1.5)             # a stats period with the work in it
    assert stop_server(proc) == 0
    lines = re.findall(r"MFU: ([0-9.]+) TF/s/device ([0-9.]+) GB/s/device", proc.stderr.read())
    assert lines and any(float(gb) > 0 for _, gb in lines), lines


def test_get_metrics_offline_with_and_without_the_flags(tiny_model_dir):
    from llm_serving import LLM, SamplingParams
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    prompt = list(range(3, 33))
    llm = LLM(tiny_model_dir, disable_log_stats=False, num_blocks=NUM_BLOCKS,
              kv_cache_metrics=True, enable_mfu_metrics=True)
    llm.generate([{"prompt_token_ids": prompt}], params)
    got = {m.name.removeprefix("vllm:"): m for m in llm.get_metrics()}
    assert [got[m].value for m in MFU] == list(expected(cfg, len(prompt), 5, 0))
    assert all(type(got[n]).__name__ == "Histogram" for n in RESIDENCY)
    del llm
    llm = LLM(tiny_model_dir, disable_log_stats=False, num_blocks=NUM_BLOCKS)
    llm.generate([{"prompt_token_ids": prompt}], params)
    got = {m.name.removeprefix("vllm:"): m for m in llm.get_metrics()}
    # as vLLM: the MFU counters are there at 0, the residency histograms are not
    assert [got[m].value for m in MFU] == [0, 0, 0]
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
                   "  kv_cache_metrics_sample: 0.05\n  enable_mfu_metrics: true\n")
    args = server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))[0]
    assert (args.kv_cache_metrics, args.kv_cache_metrics_sample, args.enable_mfu_metrics) \
        == (True, 0.05, True)
