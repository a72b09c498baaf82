"""The real server (start.py in a subprocess, model in a WorkAgent) driven by real clients:
the `openai` package on the OpenAI API and `requests` on llm-serving's routes."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from llm_serving import SamplingParams
from llm_serving.cli_args import SHUTDOWN_TIMEOUT_S, STOP_WITH_PARENT_ENV
from llm_serving.entrypoints.api_server import ANSWER_ABORTED_S
from llm_serving.executor.shm_channel import segments_of
from conftest import metric, metric_value

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Give three tips for staying healthy.", "What is the capital of France?",
           "Write a haiku about the sea.", "List five prime numbers:"]


SERVERS = {}


def agent_pids(pid: int, module: str = "llm_serving.executor.worker") -> list[int]:
    """The WorkAgent processes started by server ``pid``, by tensor-parallel rank (or the
    processes of another ``module``, e.g. llm_serving.executor.comm_scheduler)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and module.encode() in cmd:
                args = cmd.split(b"\0")
                rank = int(args[args.index(b"--tp-rank") + 1]) if b"--tp-rank" in args else 0
                out.append((rank, int(d)))
    return [p for _, p in sorted(out)]


def wait_until(cond, timeout=15.0, message="condition never held", every=0.1):
    """Poll ``cond()`` until it holds; fail with ``message`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, message
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path, model_dir, *extra, section="", agent_ports=(16002,),
                 preexec_fn=None, env=None, model_name="tiny"):
    port = free_port()
    cfg = tmp_path / f"server-{port}.yaml"
    ports = ", ".join(map(str, agent_ports))
    cfg.write_text(f"model_config:\n  model_name: {model_name}\n  end_token: 2\n"
                   f"  vocab_size: 1024\n"
                   f"serving_config:\n  agent_ports: [{ports}]\n  server_port: {port}\n"
                   f"llm_serving:\n  model: {model_dir}\n  num_blocks: 512\n"
                   f"  max_num_seqs: 64\n  max_model_len: 1024\n{section}")
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--config", str(cfg),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,      # a test run killed outright leaves no server
                            env={**os.environ, STOP_WITH_PARENT_ENV: str(os.getpid()),
                                 **(env or {})},
                            preexec_fn=preexec_fn)
    return proc, f"http://127.0.0.1:{port}", wait_ready(proc)


def served(tmp_path, model_dir, *extra):
    """For a fixture (``yield from``): the URL of a server started as start_server starts it,
    on agent ports of its own, and stopped cleanly at the fixture's end."""
    proc, url, _ = start_server(tmp_path, model_dir, *extra, agent_ports=(free_port(),))
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


def wait_ready(proc, timeout: float = 120) -> str:
    """The server's "ready" line, read from its stdout; if it exits or the time runs out
    first, it is killed and RuntimeError shows its stderr's end."""
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "ready" in line or proc.poll() is not None:
            break
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return line


def serve_model(model_dir, *flags, port: int, num_blocks: int = 256, env=None,
                timeout: float = 120):
    """A server of ``model_dir`` started with ``--model`` and ``flags`` (no config file) on
    ``port``, stopped with the test run if it is killed: its process and URL."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--model", model_dir,
                             "--port", str(port), "--num-blocks", str(num_blocks), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, STOP_WITH_PARENT_ENV: str(os.getpid()),
                                 **(env or {})})
    wait_ready(proc, timeout)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    proc, url, line = start_server(tmp_path_factory.mktemp("srv"), tiny_model_dir)
    SERVERS[url] = proc
    try:
        assert len(segments_of(proc.pid)) == 4      # in and out, two steps in flight
        yield url
    finally:
        code = stop_server(proc)
    assert code == 0
    assert not segments_of(proc.pid), "the server left shared memory behind"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def _maps_mindspore(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libmindspore" in f.read()


def test_the_master_does_not_load_mindspore(server):
    """The master holds HTTP, the tokenizer and the scheduler; only the WorkAgent runs
    MindSpore (its import costs seconds of start-up and hundreds of MiB)."""
    pid = SERVERS[server].pid
    assert not _maps_mindspore(pid)
    agents = agent_pids(pid)
    assert agents and all(_maps_mindspore(agent) for agent in agents)


def test_profiler_routes_are_absent_without_profiler_config(server):
    """vLLM registers /start_profile and /stop_profile only with --profiler-config
    (tests/test_profiler.py has the server that profiles)."""
    for path in ("/start_profile", "/stop_profile"):
        assert requests.post(server + path).status_code == 404


def greedy(tiny_llm, prompt, n):
    return tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n))[0].outputs[0]


def test_ready_line_health_and_models(server, client):
    assert requests.get(server + "/health").status_code == 200
    assert requests.get(server + "/ready").json() == {"ready": True}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    # vLLM's /ping (GET and POST, SageMaker's health check) and /load (requests held).
    assert requests.get(server + "/ping").status_code == 200
    assert requests.post(server + "/ping").status_code == 200
    assert requests.get(server + "/load").json() == {"server_load": 0}
    # Seen from a poller started first: the tiny model can finish before a slowed client
    # reads its first line.
    seen, done = [], threading.Event()

    def poll():
        while not done.is_set():
            seen.append(requests.get(server + "/load").json()["server_load"])
    poller = threading.Thread(target=poll)
    poller.start()
    longest = client.models.list().data[0].max_model_len - 16
    try:
        r = requests.post(server + "/v1/completions", json={
            "prompt": "Hello", "max_tokens": longest, "ignore_eos": True, "n": 4})
    finally:
        done.set()
        poller.join()
    assert r.status_code == 200 and max(seen) == 4          # its 4 sequences, while it ran
    assert requests.get(server + "/load").json() == {"server_load": 0}


def test_completions_match_offline_greedy(client, tiny_llm):
    for prompt in PROMPTS:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                      temperature=0)
        ref = greedy(tiny_llm, prompt, 12)
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(tiny_llm.get_tokenizer().encode(prompt))


def test_streaming_with_usage_adds_up(client, tiny_llm):
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    ref = greedy(tiny_llm, PROMPTS[0], 16)
    assert text == ref.text and usage.completion_tokens == len(ref.token_ids)
    assert finish in ("stop", "length")


def test_continuous_usage_stats_count_each_choice_as_it_goes(client, tiny_llm):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
    far (and the last, choiceless chunk the request's)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    ref = greedy(tiny_llm, PROMPTS[0], 16)
    n_prompt = len(tiny_llm.get_tokenizer().encode(PROMPTS[0]))
    seen, final = {0: 0, 1: 0}, None
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                           temperature=0, n=2, stream=True,
                                           stream_options=opts):
        if not chunk.choices:
            final = chunk.usage
            continue
        u, idx = chunk.usage, chunk.choices[0].index
        assert u.prompt_tokens == n_prompt and u.total_tokens == n_prompt + u.completion_tokens
        assert u.completion_tokens >= seen[idx]
        seen[idx] = u.completion_tokens
    assert seen == {0: len(ref.token_ids), 1: len(ref.token_ids)}
    assert final.completion_tokens == 2 * len(ref.token_ids)

    msgs = [{"role": "user", "content": "Hello there"}]
    chat_ref = tiny_llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    usages = [c.usage for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options=opts)]
    assert all(u is not None for u in usages)
    assert usages[0].completion_tokens == 0                      # the role chunk
    assert usages[-1].completion_tokens == len(chat_ref.token_ids)


def test_chat_uses_the_template_and_streams(client, tiny_llm):
    msgs = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                       temperature=0)
    ref = tiny_llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


def test_n_logprobs_stop_and_seed(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, n=2,
                                  temperature=1.0, seed=7, logprobs=2)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    lp = r.choices[0].logprobs
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(t) <= 3 and tok in t for tok, t in zip(lp.tokens, lp.top_logprobs))
    again = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, n=2,
                                      temperature=1.0, seed=7, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model="tiny", max_tokens=6, logprobs=True,
                                          top_logprobs=3, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    content = chat.choices[0].logprobs.content
    assert content and len(content[0].top_logprobs) == 3
    free = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True})
    stop = free.choices[0].text[5:8]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == free.choices[0].text[:free.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def _check_echo_logprobs(lp, text, prompt_ids, gen_ids):
    """OpenAI's logprobs object over the echoed prompt then the completion: the first prompt
    token has null logprob and top_logprobs, and text_offset indexes the echoed text."""
    n_prompt = len(prompt_ids)
    total = n_prompt + len(gen_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == total
    assert len(lp.text_offset) == total
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, off in zip(lp.tokens[1:n_prompt], lp.text_offset[1:n_prompt]):
        assert text.startswith(tok, off), (tok, off, text)
    if gen_ids:
        assert lp.text_offset[n_prompt] == text.index(lp.tokens[n_prompt], len(text) - len(
            "".join(lp.tokens[n_prompt:])))


def test_echo_with_logprobs_scores_the_prompt(client, tiny_llm):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0 or 1, on
    token-id prompts; and plain echo on text prompts, with n > 1 and several prompts."""
    tok = tiny_llm.get_tokenizer()
    prompt = PROMPTS[1]
    ids = tok.encode(prompt)
    ref = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2,
                                                   prompt_logprobs=2))[0]
    gen = ref.outputs[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == prompt + gen.text
    _check_echo_logprobs(c.logprobs, c.text, ids, gen.token_ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
        + [e[t].logprob for e, t in zip(gen.logprobs, gen.token_ids)], abs=1e-5)
    assert c.logprobs.text_offset[len(ids)] == len(prompt)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(gen.token_ids)

    # Token-id prompts, max_tokens 0 (only the prompt) and 1; the text is the decoded prompt.
    other = tok.encode(PROMPTS[2])
    for max_tokens in (0, 1):
        r = client.completions.create(model="tiny", prompt=[ids, other], max_tokens=max_tokens,
                                      temperature=0, echo=True, logprobs=1)
        assert len(r.choices) == 2
        for c, p in zip(r.choices, [ids, other]):
            text = tok.decode(p, skip_special_tokens=False)     # as vLLM echoes token ids
            assert c.text.startswith(text) and (max_tokens or c.text == text)
            got = c.logprobs.token_logprobs
            assert len(got) == len(p) + max_tokens and got[0] is None
            _check_echo_logprobs(c.logprobs, c.text, p, [0] * max_tokens)
            assert c.finish_reason == "length"
        assert r.usage.completion_tokens == 2 * max_tokens
    # lm-eval reads the prompt's scores and greedy-ness from these fields.
    assert got[1:len(other)] == pytest.approx(
        [e[t].logprob for e, t in zip(tiny_llm.generate(
            {"prompt_token_ids": other}, SamplingParams(max_tokens=1, prompt_logprobs=1)
        )[0].prompt_logprobs[1:], other[1:])], abs=1e-5)

    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=5, n=2,
                                  temperature=0.8, seed=3, echo=True)
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.text.startswith(PROMPTS[c.index // 2]) and c.logprobs is None


def test_streaming_echo_sends_the_prompt_first(client, tiny_llm):
    prompt = PROMPTS[0]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      echo=True, logprobs=1)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                       echo=True, logprobs=1, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(prompt)
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    joined = {f: [v for c in chunks for v in getattr(c.logprobs, f)]
              for f in ("tokens", "token_logprobs", "text_offset")}
    for f in ("tokens", "token_logprobs"):
        assert joined[f] == getattr(whole.choices[0].logprobs, f), f
    # The prompt's offsets and the completion's start are the same; later generated tokens
    # are placed as before echo existed (at their chunk's start when streamed).
    n_prompt = len(tiny_llm.get_tokenizer().encode(prompt))
    assert joined["text_offset"][:n_prompt + 1] == \
        whole.choices[0].logprobs.text_offset[:n_prompt + 1]
    assert joined["text_offset"][n_prompt] == len(prompt)
    only = list(client.completions.create(model="tiny", prompt=[prompt, prompt], n=2,
                                          max_tokens=0, echo=True, stream=True))
    texts = {c.choices[0].index: c.choices[0].text for c in only if c.choices}
    assert texts == {i: prompt for i in range(4)}
    assert all(c.choices[0].finish_reason == "length" for c in only if c.choices)


def test_suffix_and_max_tokens_0_without_echo_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", suffix="y")
    assert "suffix" in e.value.message and "not supported" in e.value.message
    assert e.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens"


def test_llm_serving_routes_keep_their_shapes(server, tiny_llm):
    body = {"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 12, "do_sample": "False",
                                                 "return_full_text": "True"}}
    full = requests.post(server + "/models/llama2/generate", json=body)
    assert full.status_code == 200 and full.text.endswith("\n") and full.text.count("\n") == 1
    obj = json.loads(full.text)
    # llm-serving's keys in its order (clients compare bytes), its "seed": 0 for none given
    assert list(obj) == LLM_SERVING_FULL
    assert obj["seed"] == 0 and obj["finish_reason"] == "length"
    ref = greedy(tiny_llm, PROMPTS[3], 12)
    assert obj["generated_text"] == ref.text
    assert [t["id"] for t in obj["tokens"]] == ref.token_ids
    assert list(obj["tokens"][0]) == ["id", "logprob", "special", "text"]
    stream = requests.post(server + "/models/tiny/generate_stream", json=body)
    # sse-starlette's headers, which keep proxies such as nginx from holding the stream
    assert stream.headers["Cache-Control"] == "no-cache"
    assert stream.headers["X-Accel-Buffering"] == "no"
    parsed = [json.loads(line) for line in stream.text.splitlines()]
    for p in parsed:
        assert list(p) == ["event", "retry", "data"] and p["event"] == "message"
        assert p["retry"] == 30000 and isinstance(p["data"], list) and len(p["data"]) == 1
    for p in parsed[:-1]:
        assert list(p["data"][0]) == ["details", "generated_text", "tokens", "top_tokens"]
    pieces = [p["data"][0]["generated_text"] for p in parsed[:-1]]
    assert "".join(pieces) == ref.text                    # the last token's text included
    last = parsed[-1]["data"][0]                          # the return_full_text line:
    assert list(last) == ["details"] + LLM_SERVING_FULL[:-1]     # "details" first here
    assert last["generated_text"] == ref.text and last["tokens"] == obj["tokens"]
    assert last["seed"] == 0
    other = requests.post(server + "/models/llama2", json={**body, "stream": True, "parameters":
                          {**body["parameters"], "return_protocol": "plain", "seed": 7}}).text
    assert all(line.startswith("data:") for line in other.splitlines())
    last = json.loads(other.splitlines()[-1].removeprefix("data:"))
    assert list(last) == LLM_SERVING_FULL and last["seed"] == 7     # "details" last here
    info = requests.get(server + "/serving/get_serverd_model_info").text
    assert json.loads(info.removeprefix("data: "))["model_id"] == "tiny"


LLM_SERVING_FULL = ["generated_text", "finish_reason", "generated_tokens", "prefill", "seed",
                    "tokens", "top_tokens", "details"]


def test_llm_serving_answers_end_at_the_length_cap_and_texts_add_up(server, tiny_llm):
    """llm-serving's max_generate_length caps prompt + output: a request asking for more than
    the prompt leaves (its default 300 new tokens, say) ends there with "length", not a 400.
    The tokens' texts add up to the answer's (a character split between byte tokens
    included), in the answer and in the stream alike."""
    tok = tiny_llm.get_tokenizer()
    text = " ".join(["the sea"] * 400)
    while len(tok.encode(text)) > 1000:
        text = text[: len(text) * 9 // 10]
    n_prompt = len(tok.encode(text))
    for path in ("/models/llama2/generate", "/models/llama2/generate_stream"):
        r = requests.post(server + path, json={"inputs": text, "parameters": {
            "ignore_eos": True, "return_full_text": True}})
        assert r.status_code == 200, r.text
        obj = json.loads(r.text.splitlines()[-1])
        obj = obj["data"][0] if "data" in obj else obj
        assert obj["finish_reason"] == "length"
        assert n_prompt + obj["generated_tokens"] == 1024          # max_model_len
    r = requests.post(server + "/models/llama2/generate", json={"inputs": text * 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs", r.text
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 40, "ignore_eos": True,
                                                 "return_full_text": True}}
        obj = requests.post(server + "/models/llama2/generate", json=body).json()
        assert obj["generated_text"] == greedy(tiny_llm, prompt, 40).text
        assert "".join(t["text"] for t in obj["tokens"]) == obj["generated_text"]
        lines = requests.post(server + "/models/llama2/generate_stream", json=body).text
        *steps, full = [json.loads(line)["data"][0] for line in lines.splitlines()]
        assert [s["tokens"] for s in steps] == full["tokens"] == obj["tokens"]


def test_llm_serving_streams_end_with_the_whole_text_unless_told_not_to(server, tiny_llm):
    """llm-serving's Parameters default return_full_text to true (mindspore-ai/serving, branch
    dev, mindspore_serving/client/client_utils.py): a stream for a body that does not set it
    ends with the whole answer's line, and scripts written against it take that last line as
    the answer. Parsed as performance_serving parses a stream."""
    n = 12
    ref = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=n,
                                                       ignore_eos=True))[0].outputs[0]
    params = {"max_new_tokens": n, "do_sample": False, "ignore_eos": True}

    def texts(path, extra, body_extra=None):
        body = {"inputs": PROMPTS[1], "parameters": {**params, **extra}, **(body_extra or {})}
        with requests.post(server + path, json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            lines = [line for line in r.iter_lines(decode_unicode=True) if line]
        if extra.get("return_protocol") == "plain":
            return [json.loads(line.removeprefix("data:")) for line in lines]
        return [json.loads(line)["data"][0] for line in lines]

    lis = [d["generated_text"] for d in texts("/models/llama2/generate_stream", {})]
    assert len(lis) == n + 1 and lis[-1] == ref.text and "".join(lis[:-1]) == ref.text
    plain = texts("/models/llama2", {"return_protocol": "plain"}, {"stream": True})
    assert len(plain) == n + 1 and plain[-1]["generated_text"] == ref.text
    assert plain[-1]["finish_reason"] == "length"
    lis = [d["generated_text"] for d in texts("/models/llama2/generate_stream",
                                              {"return_full_text": "False"})]
    assert len(lis) == n and "".join(lis) == ref.text


def test_llm_serving_request_numbers_are_the_waiting_queue(server):
    """llm-serving's /serving/get_request_numbers is its scheduler's waiting queue's length
    (mindspore-ai/serving, branch dev, mindspore_serving/schedule/schedule.py get_queue_len),
    /serving/get_bs its running batch: with three requests running and none waiting, 3 and
    0. Read as an SSE event, as llm-serving's test/test_sse_recv.py reads them."""
    def event(path):
        text = requests.get(server + path, timeout=30).text
        assert text.startswith("data: ") and text.endswith("\r\n\r\n")
        return json.loads(text.removeprefix("data: "))["data"]

    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 900, "ignore_eos": True}}
    streams = [requests.post(server + "/models/llama2/generate_stream", json=body,
                             stream=True, timeout=120) for _ in range(3)]
    try:
        wait_until(lambda: event("/serving/get_bs") == 3, timeout=60,
                   message="three requests never ran at once")
        assert event("/serving/get_request_numbers") == 0
    finally:
        for r in streams:
            r.close()
    wait_until(lambda: event("/serving/get_bs") == 0, timeout=60)


def test_llm_serving_internlm_routes_answer_whatever_the_model(server, tiny_llm):
    """llm-serving served /models/internlm, /models/internlm/generate and
    /models/internlm/generate_stream beside the llama2 ones, whatever model it ran
    (mindspore-ai/serving, branch dev, examples/server_app_post.py): a client written for
    them gets the same answers here as on /models/llama2."""
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 6, "do_sample": False}}
    ref = greedy(tiny_llm, PROMPTS[1], 6).text
    r = requests.post(server + "/models/internlm/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"] == ref, r.text
    r = requests.post(server + "/models/internlm", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"] == ref, r.text
    lines = requests.post(server + "/models/internlm/generate_stream", json=body,
                          timeout=60).text.splitlines()
    assert json.loads(lines[-1])["data"][0]["generated_text"] == ref


def test_llm_serving_clients_nulls_take_the_defaults(server, tiny_llm):
    """llm-serving's Python client posts every field of its Parameters model, the unset ones
    as null, and `parameters` itself may be null: llm-serving took null as the default."""
    params = {"do_sample": False, "repetition_penalty": None, "temperature": None,
              "top_k": None, "top_p": None, "max_new_tokens": 12, "return_full_text": True,
              "return_protocol": "sse", "decoder_input_details": False, "details": False,
              "seed": 0, "stop": [], "top_n_tokens": 0, "truncate": False, "typical_p": 0,
              "watermark": False}
    r = requests.post(server + "/models/llama2/generate",
                      json={"inputs": PROMPTS[1], "parameters": params, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == greedy(tiny_llm, PROMPTS[1], 12).text
    r = requests.post(server + "/models/llama2",
                      json={"inputs": PROMPTS[2], "parameters": None, "stream": None})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == greedy(tiny_llm, PROMPTS[2], 300).text


def test_llm_serving_sampling_without_top_k_draws_from_the_three_likeliest(server, tiny_llm):
    """llm-serving sampled among the 3 likeliest tokens when a do_sample request gave no top_k
    (or a null one); a given top_k, 0 (the whole vocabulary) included, is taken as given. At
    temperature 50 the distribution is nearly flat, so 40 seeds reach all 3 and, with top_k 0,
    far more than 3 of the 1024 tokens."""
    prompt = PROMPTS[0]
    ref = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                   logprobs=3))[0].outputs[0]
    top3 = set(ref.logprobs[0])
    assert len(top3) == 3

    def first_ids(extra):
        def one(seed):
            params = {"do_sample": True, "temperature": 50.0, "seed": seed,
                      "max_new_tokens": 1, "ignore_eos": True, **extra}
            r = requests.post(server + "/models/llama2/generate",
                              json={"inputs": prompt, "parameters": params})
            assert r.status_code == 200, r.text
            return r.json()["tokens"][0]["id"]
        with ThreadPoolExecutor(8) as pool:
            return set(pool.map(one, range(40)))
    assert first_ids({}) == top3
    assert first_ids({"top_k": None}) == top3
    assert len(first_ids({"top_k": 0})) > 10


def test_llm_serving_finish_reason_is_eos_for_every_end_of_sequence_id(server, tiny_llm):
    """The model's generation_config.json lists end ids beside the tokenizer's EOS (the tiny
    model's <|im_end|>, Llama 3's <|eot_id|>): ending on one is "eos" on llm-serving's
    routes, as on its own EOS; "stop_sequence" is only a request's stop string."""
    ref = greedy(tiny_llm, "Hello", 300)     # the tiny model answers "Hello" with <|im_end|>
    end_id = ref.token_ids[-1]
    assert ref.finish_reason == "stop" and end_id != tiny_llm.get_tokenizer().eos_token_id
    body = {"inputs": "Hello", "parameters": {"return_full_text": True}}
    obj = requests.post(server + "/models/llama2/generate", json=body).json()
    assert obj["tokens"][-1]["id"] == end_id and obj["finish_reason"] == "eos"
    lines = requests.post(server + "/models/llama2/generate_stream", json=body).text
    assert json.loads(lines.splitlines()[-1])["data"][0]["finish_reason"] == "eos"
    stop = ref.text[1:3]
    body = {"inputs": "Hello", "parameters": {"stop": [stop]}}
    assert requests.post(server + "/models/llama2/generate",
                         json=body).json()["finish_reason"] == "stop_sequence"


def test_generate_stream_sends_a_line_per_token_when_the_client_lags(server, tiny_llm):
    """llm-serving's clients count a stream's lines and read each line's token. With twelve
    streams at once the engine steps faster than each handler is scheduled, and the tokens of
    two steps must still reach the client as two lines. (ignore_eos, vLLM's, is honoured.)"""
    n = 32
    refs = {p: tiny_llm.generate(p, SamplingParams(temperature=0.0, max_tokens=n,
                                                   ignore_eos=True))[0].outputs[0]
            for p in PROMPTS}

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": True,
                                                 "return_full_text": True}}
        r = requests.post(server + "/models/llama2/generate_stream", json=body, timeout=120)
        return prompt, [json.loads(line)["data"][0] for line in r.text.splitlines()]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    for prompt, lines in results:
        *steps, full = lines
        assert [s["tokens"]["id"] for s in steps] == refs[prompt].token_ids
        assert "".join(s["generated_text"] for s in steps) == refs[prompt].text
        assert full["generated_tokens"] == len(steps) == n


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", "{not json", 400, "JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [str(i) for i in range(101)]},
     400, "stop must hold at most 100 strings"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/models/llama2/generate", {"inputs": ""}, 400, "inputs"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"top_p": 2}}, 400, "top_p"),
    ("/models/other/generate", {"inputs": "x"}, 404, "other"),
    # llm-serving dropped fields it did not know; a client relying on one must hear of it.
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"best_of": 2}}, 400,
     "parameters.best_of"),
    ("/models/llama2/generate_stream", {"inputs": "x", "max_tokens": 9}, 400, "max_tokens"),
    # Ignored by llm-serving, whose client sends them switched off; asked for, refused.
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"watermark": True}}, 400,
     "parameters.watermark: not supported"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"typical_p": 0.9}}, 400,
     "parameters.typical_p"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"grammar": {
        "type": "regex", "value": "a+", "whitespace": " "}}}, 400, "parameters.grammar.whitespace"),
    # Started without --enable-auto-tool-choice: tools with tool_choice "auto" (the default
    # with tools) cannot be read back, so they are refused (as vLLM).
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "--enable-auto-tool-choice"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "(("}}}, 400, "grammar"),
    # ... and one the parser gives up on while generating: still the request's fault
    ("/models/llama2/generate", {"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "a{1000}{1000}"}}}, 400, "parameters.grammar:"),
    # Errors in llm-serving's field names, a NaN said as such
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"top_k": 2**40,
                                                               "do_sample": True}}, 400,
     "parameters.top_k must be < 2**31"),
    ("/models/llama2/generate", {"inputs": "x", "parameters": {"seed": 2**70}}, 400,
     "parameters.seed must fit in 64 bits"),
    ("/models/llama2/generate", '{"inputs": "x", "parameters": {"temperature": NaN}}', 400,
     "finite number"),
    # A text too long for the model by its length alone is refused before it is tokenized
    # (megabytes would hold the event loop for seconds).
    ("/v1/completions", {"prompt": "x" * 3_000_000}, 400, "prompt: 3000000 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3_000_000}]},
     400, "messages: 3000"),
    ("/models/llama2/generate", {"inputs": "x" * 3_000_000}, 400, "characters"),
    ("/tokenize", {"prompt": "x" * 3_000_000}, 400, "prompt: 3000000 characters"),
    ("/v1/completions", {"prompt": "a\ud800b"}, 400, "surrogate"),
    # A template is a program: a request's own only with --trust-request-chat-template.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template": "{{ 1 }}"}, 400, "--trust-request-chat-template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400,
     "--trust-request-chat-template"),
    # Bodies FastAPI cannot read, said in the API's error shape with what is wrong.
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "could not be read as JSON"),
    ("/v1/completions", "[" * 100_000, 400, "could not be read as JSON"),
    ("/v1/completions", '{"prompt": "x", "seed": ' + "9" * 5000 + "}", 400,
     "could not be read as JSON"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400,
     "temperature: Input should be a finite number"),
    ("/v1/completions", {"prompt": "x", "n": 100}, 400, "n: 100 is more than max_num_seqs"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 100, "max_tokens": 5}, 400,
     "min_tokens must be <= max_tokens"),
])
def test_bad_input_gets_a_4xx_naming_the_field(server, path, body, status, needle):
    kw = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
    r = requests.post(server + path, **kw)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert "=" not in (r.json()["error"].get("param") or "")      # a field's name, alone


def test_a_chunked_body_over_the_limit_is_a_413(server):
    """Without a Content-Length the limit is found while reading: a 413 too, not a 400."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = requests.post(server + "/v1/completions", data=chunks())
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_oversized_body_is_refused(server):
    r = requests.post(server + "/v1/completions",
                      data=json.dumps({"model": "tiny", "prompt": "x" * (5 << 20)}))
    assert r.status_code == 413


def _abort_count(server) -> float:
    return metric(server, 'request_success_total{finished_reason="abort"}')


def test_disconnect_storm_frees_everything(server, tiny_llm):
    """50 streaming requests: half read to the end and must be correct; a quarter hang up
    after two lines of a long generation, a quarter before the first token. The long ones
    would run for many seconds unless their hang-up aborts them."""
    ref = {p: greedy(tiny_llm, p, 24).text for p in PROMPTS}
    results, errors = [], []
    aborts_before = _abort_count(server)
    host, port = server.rsplit("/", 1)[1].split(":")

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        long = i % 2 == 1
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 900 if long else 24,
                                                 "return_full_text": False}}
        try:
            if i % 4 == 3:            # send the request, then close before any answer
                payload = json.dumps(body).encode()
                with socket.create_connection((host, int(port))) as sock:
                    sock.sendall(b"POST /models/llama2/generate_stream HTTP/1.1\r\n"
                                 b"Host: x\r\nContent-Type: application/json\r\n"
                                 + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                                 + payload)
                return
            with requests.post(server + "/models/llama2/generate_stream", json=body,
                               stream=True, timeout=60) as r:
                text = ""
                for k, line in enumerate(r.iter_lines()):
                    if long and k == 2:
                        return                      # hang up mid-stream
                    text += json.loads(line)["data"][0]["generated_text"]
                results.append(text == ref[prompt])
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 25 and all(results)
    wait_until(lambda: _gauge(server, "kv_cache_usage_perc") == 0
               and _gauge(server, "num_requests_running") == 0, 10, every=0.2)
    metrics = requests.get(server + "/metrics").text
    assert metric_value(metrics, "kv_cache_usage_perc") == 0.0
    assert metric_value(metrics, "time_to_first_token_seconds_count") > 0
    # Counted as vLLM's request_success_total{finished_reason="abort"}: at least every
    # mid-stream hang-up (one closed before the server read it may never become a request).
    assert _abort_count(server) - aborts_before >= 12


@pytest.mark.parametrize("path,body,prompts", [
    ("/v1/completions", {"prompt": PROMPTS[0]}, 1),                  # read directly
    ("/v1/completions", {"prompt": [PROMPTS[0], PROMPTS[1]]}, 2),    # merged by a pump
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]}, 1),
])
def test_an_openai_stream_hung_up_midway_is_aborted(server, path, body, prompts):
    """A streamed OpenAI request whose client leaves after two chunks of a long generation:
    every prompt of it is aborted and its blocks freed at once, not after 900 tokens."""
    aborts_before = _abort_count(server)
    body = dict(body, model="tiny", max_tokens=900, ignore_eos=True, stream=True)
    with requests.post(server + path, json=body, stream=True, timeout=60) as r:
        chunks = (line for line in r.iter_lines() if line)
        assert next(chunks).startswith(b"data: {") and next(chunks).startswith(b"data: {")
    wait_until(lambda: _abort_count(server) - aborts_before >= prompts
               and _gauge(server, "num_requests_running") == 0, 10)
    assert _abort_count(server) - aborts_before >= prompts
    assert _gauge(server, "num_requests_running") == 0
    assert _gauge(server, "kv_cache_usage_perc") == 0


def _gauge(server, name) -> float:
    return metric(server, name)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 900,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 900, "ignore_eos": True,
                              "messages": [{"role": "user", "content": PROMPTS[0]}]}),
    ("/models/llama2/generate", {"inputs": PROMPTS[0],
                                 "parameters": {"max_new_tokens": 900, "ignore_eos": True}}),
])
def test_a_non_streaming_client_that_resets_the_connection_is_aborted(server, path, body):
    """A long non-streaming generation whose client resets the connection (RST) mid-way is
    aborted at once: its blocks are freed, it counts as an abort, the server serves on."""
    host, port = server.rsplit("/", 1)[1].split(":")
    aborts_before = _abort_count(server)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    wait_until(lambda: _gauge(server, "kv_cache_usage_perc") != 0, 30,   # generating
               "the request never started", every=0.05)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()                                                # RST, not FIN
    wait_until(lambda: _gauge(server, "kv_cache_usage_perc") == 0
               and _gauge(server, "num_requests_running") == 0, 5,
               "the request ran on after its client left", every=0.05)
    assert _abort_count(server) == aborts_before + 1
    # (ignore_eos: sampled at temperature 1, the tiny model ends ~0.3% of 4-token answers early)
    r = requests.post(server + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _generate_stream_error(lines):
    """The error llm-serving's generate_stream ends a failed stream with."""
    return json.loads(lines[-1])["data"][0]["error"]


def _openai_stream_error(lines):
    """The error an OpenAI stream sends before its closing [DONE]."""
    assert lines[-1] == b"data: [DONE]"
    return json.loads(lines[-2][len(b"data: "):])["error"]["message"]


# A long streamed request on each surface: (path, body, the error its failed stream ends with).
GENERATE_STREAM = ("/models/llama2/generate_stream",
                   {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 200}},
                   _generate_stream_error)
OPENAI_STREAM = ("/v1/completions",
                 {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "stream": True},
                 _openai_stream_error)


def kill_an_agent_and_come_back(url, server_pid, tiny_llm, rank=0, num_agents=1,
                                stream=GENERATE_STREAM, sig=signal.SIGKILL, within=5.0):
    """SIGKILL agent ``rank`` during a ``stream`` (GENERATE_STREAM or OPENAI_STREAM), or hang
    it (SIGSTOP): the request fails naming the model process ``within`` seconds, /ready is 503
    until a new set of agents is up, then the server generates again, and /metrics counts on
    from where it was (Prometheus counters must not go back; the stats line must not turn
    negative)."""
    agents = agent_pids(server_pid)
    assert len(agents) == num_agents
    path, body, error_of = stream
    with requests.post(url + path, json=body, stream=True, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        next(lines)                                   # the request is running
        generated = metric(url, "generation_tokens_total")
        os.kill(agents[rank], sig)
        t0 = time.monotonic()
        rest = list(lines)
        detected = time.monotonic() - t0
    assert detected < within
    assert "model process failed" in error_of(rest)
    assert requests.get(url + "/live").status_code == 200        # the process is up ...
    assert requests.get(url + "/health").status_code == 503      # ... but cannot serve yet
    assert requests.get(url + "/ready").status_code == 503
    wait_until(lambda: requests.get(url + "/ready").status_code == 200, 90,
               "the server did not come back", every=0.2)
    new_agents = agent_pids(server_pid)
    assert len(new_agents) == num_agents and not set(new_agents) & set(agents)
    r = requests.post(url + "/models/llama2/generate",
                      json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 8}})
    assert r.json()["generated_text"] == greedy(tiny_llm, PROMPTS[1], 8).text
    assert metric(url, "generation_tokens_total") >= generated + 8


def test_metrics_and_load_answer_while_a_step_holds_the_engine(server):
    """A model step that holds the engine thread (a long prefill on a slow machine; a hung
    WorkAgent, until --execute-model-timeout) does not hold /metrics, /load and llm-serving's
    /serving/get_bs: within about a second they answer with the last stats (they waited for
    the step, up to 300 s, so a Prometheus scrape or a load balancer's poll timed out). Once
    the step ends they are current again, and the request in flight ends normally."""
    url = server
    agent = agent_pids(SERVERS[server].pid)[0]
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        next(lines)                                   # the request is running
        assert requests.get(url + "/load", timeout=10).json() == {"server_load": 1}
        os.kill(agent, signal.SIGSTOP)
        try:
            time.sleep(0.3)
            for path in ("/metrics", "/load", "/serving/get_bs"):
                t0 = time.monotonic()
                got = requests.get(url + path, timeout=10)
                assert got.status_code == 200 and time.monotonic() - t0 < 2.5, path
            assert json.loads(got.text[len("data: "):])["data"] == 1   # get_bs: 1 running
            assert requests.get(url + "/load", timeout=10).json() == {"server_load": 1}
            assert metric(url, "num_requests_running") == 1
        finally:
            os.kill(agent, signal.SIGCONT)
        rest = list(lines)
    assert rest[-1] == b"data: [DONE]" and b'"error"' not in b"".join(rest)
    wait_until(lambda: requests.get(url + "/load", timeout=10).json() == {"server_load": 0},
               10, "/load did not come back to 0")


def test_killed_agent_fails_requests_in_flight_and_comes_back(server, tiny_llm):
    kill_an_agent_and_come_back(server, SERVERS[server].pid, tiny_llm)


def test_a_server_whose_agents_keep_dying_exits_with_an_error(tmp_path, tiny_model_dir):
    """Every new WorkAgent killed as it starts: after RESTART_ATTEMPTS the engine loop gives
    up, and the server exits non-zero (as vLLM's does, so that a supervisor restarts it)
    instead of lingering unable to serve; nothing is left behind."""
    from llm_serving.engine.async_engine import RESTART_ATTEMPTS
    proc, url, _ = start_server(tmp_path, tiny_model_dir)
    killed: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in set(agent_pids(proc.pid)) - killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.05)
        assert proc.poll() is not None, "the server did not give up"
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert proc.returncode != 0 and len(killed) >= 1 + RESTART_ATTEMPTS
    assert "the engine loop stopped" in proc.stderr.read()
    assert not agent_pids(proc.pid) and not segments_of(proc.pid)


def test_sigterm_while_a_dead_agent_is_replaced_stops_at_once(tmp_path, tiny_model_dir):
    """SIGTERM while the replacement of a killed WorkAgent loads (stopped here: a big model's
    minutes of loading): the server gives the load up and exits 0 within seconds, nothing
    left running or in /dev/shm, and does not start yet another agent. The engine thread
    went on waiting for the load (up to 300 s); the server waited 10 s for it, killed
    nothing, and started a third agent once the exit killed the second."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir)
    started = []
    try:
        [first] = agent_pids(proc.pid)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: set(agent_pids(proc.pid)) - {first}, 30, "no new agent started")
        [second] = set(agent_pids(proc.pid)) - {first}
        os.kill(second, signal.SIGSTOP)
        started = [second]
        assert requests.get(url + "/health").status_code == 503
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    err = proc.stderr.read()
    assert took < 5, f"the server took {took:.1f} s to exit"
    assert "trying again" not in err, err[-2000:]
    assert not os.path.exists(f"/proc/{second}"), "the loading WorkAgent outlived the server"
    assert not segments_of(proc.pid), "the server left shared memory behind"


def test_a_hung_agent_is_replaced_after_the_step_timeout(tmp_path, tiny_model_dir, tiny_llm):
    """A WorkAgent that stops answering (SIGSTOP) is taken for hung once a step has run
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (vLLM's variable; --execute-model-timeout) seconds: its
    requests fail then (within the second the master polls in; not after a second timeout for
    the step submitted behind it), it is killed and replaced."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir,
                                env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "2"})
    try:
        hung = agent_pids(proc.pid)
        kill_an_agent_and_come_back(url, proc.pid, tiny_llm, sig=signal.SIGSTOP, within=3.6)
        wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in hung), 10,
                   "the hung WorkAgent was not killed")
    finally:
        assert stop_server(proc) == 0
    assert not segments_of(proc.pid), "the server left shared memory behind"


def test_tensor_parallel_server(tmp_path, tiny_model_dir, tiny_llm):
    """Two agent_ports: two WorkAgent ranks and MindSpore's scheduler. The server answers as
    one in-process model; a killed rank 1 takes its group down and a new one comes up; SIGTERM
    stops every process and leaves no shared memory."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, agent_ports=(16002, 16003))
    try:
        assert len(agent_pids(proc.pid)) == 2
        assert len(agent_pids(proc.pid, "llm_serving.executor.comm_scheduler")) == 1
        assert len(segments_of(proc.pid)) == 5      # in, out x 2 and the all-reduce's
        for prompt in PROMPTS:
            r = requests.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.json()["choices"][0]["text"] == greedy(tiny_llm, prompt, 16).text
        kill_an_agent_and_come_back(url, proc.pid, tiny_llm, rank=1, num_agents=2,
                                    stream=OPENAI_STREAM)
        children = agent_pids(proc.pid) + agent_pids(proc.pid, "llm_serving.executor.comm_scheduler")
        assert len(children) == 3
    finally:
        assert stop_server(proc) == 0
    assert not segments_of(proc.pid), "the server left shared memory behind"
    assert not [p for p in children if os.path.exists(f"/proc/{p}")], "a process outlived it"


def _own_group_with_ctrl_c():
    """A server in its own process group that takes Ctrl-C as a terminal's foreground job
    does (a test run in the background inherits SIGINT ignored)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_drains_a_tensor_parallel_server(tmp_path, tiny_model_dir, tiny_llm):
    """Ctrl-C in a terminal reaches the whole process group, the WorkAgents included: a
    request in flight still finishes whole within --shutdown-timeout, then every process
    exits. MindSpore's collective init had installed a SIGINT handler in each rank that
    stopped its communication, so the drain's next step hung in a collective for 30 s and
    the request ended with an error."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--shutdown-timeout", "60",
                                agent_ports=(16002, 16003), preexec_fn=_own_group_with_ctrl_c)
    children = []
    try:
        children = agent_pids(proc.pid) + agent_pids(proc.pid,
                                                     "llm_serving.executor.comm_scheduler")
        assert len(children) == 3
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)                              # the request is running
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            rest = [first] + list(lines)
        assert rest[-1] == b"data: [DONE]"
        chunks = [json.loads(line[len(b"data: "):]) for line in rest[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-1]
        want = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200,
                                                            ignore_eos=True))[0].outputs[0]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 45      # (the stream, then the exit; 57 s before)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not segments_of(proc.pid), "the server left shared memory behind"
    assert not [p for p in children if os.path.exists(f"/proc/{p}")], "a process outlived it"


def test_a_server_that_cannot_listen_exits_non_zero(tmp_path, tiny_model_dir):
    """The port taken by another server between the start-up check and uvicorn's bind (the
    check skipped here to make the race certain): the server exits non-zero (uvicorn's 3),
    so that a supervisor sees the failure, with its agent stopped and no shared memory left."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = ("import llm_serving.entrypoints.api_server as s; "
                "s._check_address = lambda *a: None; from llm_serving.cli import main; "
                f"main(['serve', '--model', {tiny_model_dir!r}, '--port', '{port}'])")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 3, err[-2000:]
    assert "address already in use" in err
    assert not segments_of(proc.pid), "the server left shared memory behind"


def test_a_second_ctrl_c_ends_the_drain_and_stops_cleanly(tmp_path, tiny_model_dir):
    """Ctrl-C twice (an impatient user) with a long request in flight and a long
    --shutdown-timeout: the second ends the drain, the request gets the shutdown error, and
    the server stops as after one (the engine and its agent stopped, no shared memory left,
    exit 0) within seconds. uvicorn skips the lifespan's shutdown on a second Ctrl-C: its
    task was cancelled at exit, logging a traceback, and the agent was left to the exit."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--shutdown-timeout", "60",
                                preexec_fn=_own_group_with_ctrl_c)
    agents = agent_pids(proc.pid)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            next(lines)                                      # the request is running
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.1)                 # (the tiny model makes 1000 tokens in ~1 s)
            os.killpg(proc.pid, signal.SIGINT)
            rest = list(lines)
        assert proc.wait(30) == 0
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _openai_stream_error(rest) == "the server is shutting down"
    assert took < 10, f"the server took {took:.1f} s to exit"
    err = proc.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    assert not [p for p in agents if os.path.exists(f"/proc/{p}")], "the agent outlived it"
    assert not segments_of(proc.pid), "the server left shared memory behind"


def test_sigterm_while_a_warm_up_step_hangs_exits_at_once(tmp_path, tiny_model_dir):
    """SIGTERM once the WorkAgent has loaded but its warm-up step hangs (the agent stopped
    as the master logs its multi-stream line, between the agent's READY and the warm-up):
    the server exits 0 within seconds, the agent killed, no shared memory left. The warm-up
    step was waited for (up to --execute-model-timeout), the lifespan gave the loading
    thread 30 s, and the exit then still waited for the agent's QUIT."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                             "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, STOP_WITH_PARENT_ENV: str(os.getpid())})
    agents = []
    try:
        for line in proc.stderr:
            if "multi-stream:" in line:       # logged by the engine after READY
                break
        agents = agent_pids(proc.pid)
        assert len(agents) == 1, "the WorkAgent did not start"
        os.kill(agents[0], signal.SIGSTOP)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in agents:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "ready" not in out, "the warm-up ended before the agent was stopped"
    assert proc.returncode == 0, err[-2000:]
    assert took < 5, f"the server took {took:.1f} s to exit"
    assert "Traceback" not in err, err[-2000:]
    assert not os.path.exists(f"/proc/{agents[0]}"), "the WorkAgent outlived the server"
    assert not segments_of(proc.pid), "the server left shared memory behind"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_while_the_model_loads_is_clean(tmp_path, tiny_model_dir, sig):
    """SIGTERM or Ctrl-C while the WorkAgent is still loading: the server exits 0 at once,
    with no traceback, no agent left running and no shared memory left behind."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                             "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not agent_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        agents = agent_pids(proc.pid)
        assert agents, "the WorkAgent did not start"
        while time.monotonic() < deadline:          # listening, not ready
            try:
                assert requests.get(f"http://127.0.0.1:{port}/live", timeout=1).ok
                break
            except requests.ConnectionError:
                time.sleep(0.05)
        assert requests.get(f"http://127.0.0.1:{port}/health").status_code == 503
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not any(os.path.exists(f"/proc/{a}") for a in agents)
    assert not segments_of(proc.pid)


def test_api_key_guards_the_generation_routes(tmp_path, tiny_model_dir):
    """As vLLM guards /v1/... (and llm-serving's generation routes here); health, metrics and
    the info routes stay open for probes and scrapers."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--api-key", "s3cret", "other")
    try:
        for path in ("/health", "/ping", "/ready", "/metrics", "/version", "/load"):
            assert requests.get(url + path).status_code == 200, path
        assert requests.post(url + "/tokenize", json={"prompt": "x"}).status_code == 200
        assert requests.get(url + "/v1/models").status_code == 401
        for path in ("/models/llama2/generate", "/models/llama2/generate_stream"):
            assert requests.post(url + path, json={"inputs": "x"}).status_code == 401
            assert requests.post(url + path, json={"inputs": "x"},
                                 headers={"Authorization": "Bearer s3cret"}).status_code == 200
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret")
        assert ok.completions.create(model="tiny", prompt="x", max_tokens=2).choices
        for wrong in ("wrong", "s3cre", "s3crett", "s3cret other"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key=wrong).models.list()
        # vLLM's: any of the keys, the scheme in any case
        assert openai.OpenAI(base_url=url + "/v1", api_key="other").models.list().data
        for header in ("bearer s3cret", "BEARER other"):
            assert requests.get(url + "/v1/models",
                                headers={"Authorization": header}).status_code == 200
        for header in ("Basic s3cret", "s3cret", "Bearer  s3cret"):
            assert requests.get(url + "/v1/models",
                                headers={"Authorization": header}).status_code == 401
    finally:
        assert stop_server(proc) == 0


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from llm_serving.entrypoints.api_server import api_keys
    monkeypatch.delenv("LLM_SERVING_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(None) == []
    monkeypatch.setenv("VLLM_API_KEY", "v")                 # vLLM's variable
    assert api_keys(None) == ["v"]
    monkeypatch.setenv("LLM_SERVING_API_KEY", "ours")
    assert api_keys(None) == ["ours"]
    assert api_keys(["a", "b"]) == ["a", "b"] and api_keys("a") == ["a"]


def test_busy_port_and_broken_config_fail_with_one_line(tmp_path, server, tiny_model_dir):
    port = server.rsplit(":", 1)[1]
    run = subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                          "--port", port], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in run.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"pa_config:\n  block_size: -3\nllm_serving:\n  model: {tiny_model_dir}\n")
    run = subprocess.run([sys.executable, str(ROOT / "start.py"), "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pa_config.block_size" in errors[0]


def test_small_server_readiness_overload_and_fuzzing(tmp_path, tiny_model_dir):
    """/ready is 503 while loading; a full queue gives 503 with Retry-After; schemathesis
    over /openapi.json finds no 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    port = free_port()
    cfg = tmp_path / "small.yaml"
    cfg.write_text(f"serving_config:\n  agent_ports: [1]\n  server_port: {port}\n"
                   f"llm_serving:\n  model: {tiny_model_dir}\n  num_blocks: 256\n"
                   "  max_num_seqs: 1\n  max_waiting_requests: 1\n  max_model_len: 640\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "start.py"), "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    seen = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                codes = tuple(requests.get(url + path, timeout=1).status_code
                              for path in ("/ready", "/health", "/v1/models", "/live"))
                seen.add(codes)
                if codes[0] == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        # While loading only /live answers 200; then everything does. A script that waits
        # for /health (as vLLM's users do) sends its first request once it can be served.
        assert (503, 503, 503, 200) in seen and (200, 200, 200, 200) in seen, seen

        # One running, one waiting: the third is refused at once.
        long = {"prompt": "Tell me a story", "max_tokens": 600, "ignore_eos": True,
                "stream": True}
        held = [requests.post(url + "/v1/completions", json=long, stream=True)]
        lines0 = held[0].iter_lines()                # (dropping it would hang up)
        next(lines0)                                 # the first is running
        held.append(requests.post(url + "/v1/completions", json=long, stream=True))
        body = {"inputs": "Tell me a story", "parameters": {"max_new_tokens": 8}}
        assert [r.status_code for r in held] == [200, 200]
        refused = requests.post(url + "/models/llama2/generate", json=body)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert "max_waiting_requests" in refused.json()["error"]["message"]
        for r in held:
            r.close()
        while _gauge(url, "num_requests_running"):
            time.sleep(0.1)

        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        failures = []
        for op in schema.get_all_operations():
            strategy = op.ok().as_strategy()

            @given(case=strategy)
            @settings(max_examples=int(os.environ.get("LLM_SERVING_FUZZ_EXAMPLES", 30)),
                      deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                response = case.call(base_url=url, timeout=30)
                if response.status_code >= 500:
                    failures.append((case.method, case.path, case.body,
                                     response.status_code, response.text[:200]))
            fuzz()
        assert not failures, failures[:3]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_performance_serving_client_runs_and_records(server, tmp_path, tiny_llm):
    """Run as the original was: from a directory holding alpaca_5010.json (here the 521
    set under that name, so that its rows tell which file was read), flags short or long;
    the result file is named by -X as a float, the score line is also logged under
    ./testLog, as the original's."""
    port = server.rsplit(":", 1)[1]
    data = ROOT / "clients" / "data" / "alpaca_521.json"
    shutil.copy(data, tmp_path / "alpaca_5010.json")
    run = subprocess.run([sys.executable, str(ROOT / "clients" / "performance_serving" /
                                              "test_serving_performance.py"),
                          "-X", "4", "--port", port, "--out_dir", str(tmp_path), "-T", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("All Tasks Done; Exec Time is ")
    assert float(last.rsplit(" ", 1)[1]) >= 1.75            # paced over -T seconds
    # ... and, as the original's, in ./testLog/test_performance_<time>.log
    logs = list((tmp_path / "testLog").glob("test_performance_*.log"))
    assert len(logs) == 1 and logs[0].read_text().splitlines()[-1] == last
    records = json.loads((tmp_path / "result_4.0_x.json").read_text())
    assert len(records) == 8
    rows = json.loads(data.read_text())
    tok = tiny_llm.get_tokenizer()
    for rec, row in zip(records, rows):
        assert set(rec) == {"input", "resp_text", "res_time", "first_token_time"}
        prompt = row["instruction"] + ":" + row["input"] if row["input"] else row["instruction"]
        assert rec["input"] == prompt
        assert 0 < rec["first_token_time"] <= rec["res_time"]
        n = max(1, len(tok.encode(row["output"], add_special_tokens=False)))
        assert rec["resp_text"] == greedy(tiny_llm, prompt, n).text
    assert "TTFT" in run.stdout and "failures: 0" in run.stdout
    plots = subprocess.run([sys.executable, str(ROOT / "clients" / "plot_results.py"),
                            str(tmp_path / "result_4.0_x.timeline.json"), "--out",
                            str(tmp_path / "plots")], capture_output=True, text=True,
                           timeout=120)
    assert plots.returncode == 0, plots.stderr
    for name in ("timeline.png", "latency_cdf.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_benchmark_serving_client_prints_vllm_block_and_saves_records(server, tmp_path,
                                                                      endpoint):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "clients" / "benchmark_serving.py"),
                          "--base-url", server, "--endpoint", endpoint, "--dataset-name",
                          "alpaca", "--dataset-path",
                          str(ROOT / "clients" / "data" / "alpaca_521.json"),
                          "--num-prompts", "12", "--request-rate", "20", "--max-output", "24",
                          "--ignore-eos", "--goodput", "ttft:60000", "--result-file", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Serving Benchmark Result" in run.stdout and "Mean TTFT (ms):" in run.stdout
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["completed"] == 12 and s["failed"] == 0 and s["request_goodput"] > 0
    recs = data["records"]
    # ignore_eos: every request produced exactly its asked-for length.
    assert all(r["output_tokens"] == r["max_tokens"] for r in recs)
    assert s["total_output_tokens"] == sum(r["max_tokens"] for r in recs)
    assert all(0 < r["ttft"] <= r["latency"] for r in recs)
    sends = sorted(r["send"] for r in recs)
    assert sends[-1] > 0.1                             # paced, not all at once
    plots = subprocess.run([sys.executable, str(ROOT / "clients" / "plot_results.py"),
                            str(out)], capture_output=True, text=True, timeout=120)
    assert plots.returncode == 0, plots.stderr
    assert (tmp_path / "bench" / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_the_periodic_stats_line_and_every_request_in_the_histograms(tmp_path, tiny_model_dir):
    """vLLM users watch its stats line; ours gives the same figures. The llm-serving routes
    that read the engine's stats (get_bs) must not take finished requests away from
    /metrics' latency histograms."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--log-stats-interval", "0.5")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for _ in range(3):
            stream = client.completions.create(model="tiny", prompt="hello there", max_tokens=48,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            assert sum(len(c.choices[0].text) >= 0 for c in stream) >= 1
            assert requests.get(url + "/serving/get_bs").status_code == 200
        time.sleep(1.2)         # a period with the engine idle: the line saying so
        metrics = requests.get(url + "/metrics").text
        # vLLM's names and labels, so that its dashboards read this server.
        labels = '{engine="0",model_name="tiny"}'
        for sample in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                       "request_prompt_tokens_count"):
            assert f"vllm:{sample}{labels} 3.0" in metrics.splitlines(), sample
        assert metric_value(metrics, "request_generation_tokens_sum") == 3 * 48
        assert metric_value(metrics, "generation_tokens_total") == 3 * 48
    finally:
        assert stop_server(proc) == 0
    log = proc.stderr.read()
    lines = [line for line in log.splitlines() if "Avg prompt throughput" in line]
    assert lines, log[-2000:]
    rates = [re.search(r"Avg prompt throughput: ([0-9.]+) tokens/s, Avg generation "
                       r"throughput: ([0-9.]+) tokens/s", line).groups() for line in lines]
    assert any(float(p) > 0 for p, _ in rates) and any(float(g) > 0 for _, g in rates), lines
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs" in lines[-1]


def _samples(text: str, name: str) -> list[dict]:
    """The labels of /metrics samples named ``name``, each with its value under "value"."""
    from prometheus_client.parser import text_string_to_metric_families
    return [dict(s.labels, value=s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


_NEW_VLLM_SERIES = [
    f"{h}_{suffix}" for h in ("request_prefill_time_seconds", "request_decode_time_seconds",
                              "request_inference_time_seconds", "inter_token_latency_seconds",
                              "request_params_n", "request_params_max_tokens",
                              "request_max_num_generation_tokens", "request_num_preemptions",
                              "request_prefill_kv_computed_tokens", "iteration_tokens_total")
    for suffix in ("count", "sum")] + [
    "time_to_first_token_seconds_sum", "request_queue_time_seconds_sum",
    "e2e_request_latency_seconds_sum", "prompt_tokens_total", "generation_tokens_total",
    "prompt_tokens_cached_total", "prefix_cache_hits_total",
    'prompt_tokens_by_source_total{source="local_compute"}',
    'prompt_tokens_by_source_total{source="local_cache_hit"}',
    'prompt_tokens_by_source_total{source="external_kv_transfer"}',
    *(f'prompt_tokens_cached_by_source_total{{source="{tier}"}}'
      for tier in ("device", "host", "p2p", "disk", "external_unspecified")),
    'request_params_max_tokens_count', 'request_success_total{finished_reason="abort"}',
    "external_prefix_cache_queries_total", "external_prefix_cache_hits_total"]


_N_SERIES = ['request_success_total{finished_reason="length"}', "generation_tokens_total",
             "prompt_tokens_total", "request_generation_tokens_count",
             "request_generation_tokens_sum", "request_prompt_tokens_count",
             "request_prompt_tokens_sum", "time_to_first_token_seconds_count",
             "e2e_request_latency_seconds_count", "request_params_max_tokens_count",
             "request_params_n_count", "request_params_n_sum",
             "request_max_num_generation_tokens_count", "request_max_num_generation_tokens_sum"]


def test_n_sequences_are_counted_as_vllm_counts_them(server, client):
    """vLLM 0.32 counts each of a request's n sequences as a finished request (success,
    prompt and generation tokens per request, TTFT, e2e, max_tokens) and observes n and the
    longest sequence once: a dashboard's tokens per request read the same on both."""
    wait_until(lambda: _gauge(server, "num_requests_running") == 0)
    before = requests.get(server + "/metrics").text
    r = client.completions.create(model="tiny", prompt=f"n {time.monotonic_ns()}", n=3,
                                  max_tokens=5, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 15
    after = requests.get(server + "/metrics").text
    d = {k: metric_value(after, k) - metric_value(before, k) for k in _N_SERIES}
    assert d == {'request_success_total{finished_reason="length"}': 3,
                 "generation_tokens_total": 15, "prompt_tokens_total": 3 * prompt,
                 "request_generation_tokens_count": 3, "request_generation_tokens_sum": 15,
                 "request_prompt_tokens_count": 3, "request_prompt_tokens_sum": 3 * prompt,
                 "time_to_first_token_seconds_count": 3,
                 "e2e_request_latency_seconds_count": 3, "request_params_max_tokens_count": 3,
                 "request_params_n_count": 1, "request_params_n_sum": 3,
                 "request_max_num_generation_tokens_count": 1,
                 "request_max_num_generation_tokens_sum": 5}


def test_vllm_metrics_of_request_phases_steps_and_parameters(server, client):
    """What vLLM's dashboards read besides the basics, from what was sent: request phases
    (queue + prefill = TTFT, prefill + decode = inference, queue + inference = e2e), one
    inter-token latency per token after the first adding up to the decode time, tokens per
    step, n and max_tokens, cached prompt tokens; a series at 0 for each of vLLM's finish
    reasons from the start; the KV cache's configuration."""
    wait_until(lambda: _gauge(server, "num_requests_running") == 0
               and _gauge(server, "num_requests_waiting") == 0)
    text = requests.get(server + "/metrics").text
    reasons = {s["finished_reason"]: s["value"]
               for s in _samples(text, "vllm:request_success_total")}
    assert set(reasons) >= {"stop", "length", "abort", "error", "repetition"}
    assert reasons["error"] == reasons["repetition"] == 0
    outcomes = {s["outcome"]: s["value"] for s in _samples(text, "llm_serving:kv_transfers_total")}
    assert outcomes == {"done": 0, "failed": 0, "timeout": 0}     # a series each from the start
    [info] = _samples(text, "vllm:cache_config_info")
    assert info["value"] == 1 and info["engine"] == "0" and info["num_gpu_blocks"] == "512"
    assert info["enable_prefix_caching"] == "True"
    assert int(info["kv_cache_size_tokens"]) == 512 * int(info["block_size"])
    waiting = {s["reason"]: s["value"]
               for s in _samples(text, "vllm:num_requests_waiting_by_reason")}
    assert waiting == {"capacity": 0, "deferred": 0}
    sleep = {s["sleep_state"]: s["value"] for s in _samples(text, "vllm:engine_sleep_state")}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    refused = {s["reason"]: s["value"] for s in _samples(text, "vllm:admission_rejections_total")}
    assert refused == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}

    before = {name: metric_value(text, name) for name in _NEW_VLLM_SERIES}
    tag = f"metrics {time.monotonic_ns()}"        # a prompt no earlier test cached
    long_prompt = tag + " The quick brown fox jumps over the lazy dog." * 8
    sent = []
    for prompt, max_tokens in ((tag, 5), (long_prompt, 9), (long_prompt, 17)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
        sent.append((r.usage.prompt_tokens, r.usage.completion_tokens, max_tokens))
    text = requests.get(server + "/metrics").text
    d = {name: metric_value(text, name) - before[name] for name in _NEW_VLLM_SERIES}
    prompts, outputs, max_tokens = (sum(col) for col in zip(*sent))
    assert outputs == max_tokens == 31
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_params_n",
                 "request_num_preemptions", "request_max_num_generation_tokens"):
        assert d[f"{name}_count"] == 3, name
    assert d["request_params_n_sum"] == 3 and d["request_num_preemptions_sum"] == 0
    assert d["request_params_max_tokens_count"] == 3
    assert d["request_params_max_tokens_sum"] == max_tokens
    assert d["request_max_num_generation_tokens_sum"] == outputs
    phase = {name: d[f"{name}_sum"] for name in (
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_inference_time_seconds",
        "time_to_first_token_seconds", "e2e_request_latency_seconds",
        "inter_token_latency_seconds")}
    assert all(v > 0 for v in phase.values()), phase
    approx = lambda v: pytest.approx(v, abs=1e-6)   # noqa: E731
    assert phase["request_queue_time_seconds"] + phase["request_prefill_time_seconds"] \
        == approx(phase["time_to_first_token_seconds"])
    assert phase["request_prefill_time_seconds"] + phase["request_decode_time_seconds"] \
        == approx(phase["request_inference_time_seconds"])
    assert phase["request_queue_time_seconds"] + phase["request_inference_time_seconds"] \
        == approx(phase["e2e_request_latency_seconds"])
    assert d["inter_token_latency_seconds_count"] == outputs - 3
    assert phase["inter_token_latency_seconds"] == approx(phase["request_decode_time_seconds"])
    # Every token a step ran: the prompts' computed tokens, and each output token but the
    # last; the third request found the second's prompt blocks in the prefix cache.
    # Prompt tokens as vLLM counts them: each once, split by where they came from.
    source = {k: d[f'prompt_tokens_by_source_total{{source="{k}"}}']
              for k in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert d["prompt_tokens_total"] == prompts == sum(source.values())
    assert source["local_cache_hit"] == d["prompt_tokens_cached_total"] \
        == d["prefix_cache_hits_total"] > 0
    assert source["external_kv_transfer"] == 0
    # no KV connector: nothing looked up through one (vLLM's series at 0)
    assert d["external_prefix_cache_queries_total"] == d["external_prefix_cache_hits_total"] == 0
    tiers = {k: d[f'prompt_tokens_cached_by_source_total{{source="{k}"}}']
             for k in ("device", "host", "p2p", "disk", "external_unspecified")}
    assert tiers == {"device": source["local_cache_hit"], "host": 0, "p2p": 0, "disk": 0,
                     "external_unspecified": 0}
    assert d["iteration_tokens_total_sum"] == (source["local_compute"]
                                               + d["generation_tokens_total"] - 3)
    assert d["iteration_tokens_total_count"] >= outputs - 3 + 1
    assert d["request_prefill_kv_computed_tokens_sum"] == source["local_compute"] \
        == prompts - d["prompt_tokens_cached_total"]

    # An aborted request: counted under "abort", and its parameters observed.
    after = {name: metric_value(text, name) for name in _NEW_VLLM_SERIES}
    body = dict(model="tiny", prompt=tag, max_tokens=900, ignore_eos=True, stream=True)
    with requests.post(server + "/v1/completions", json=body, stream=True, timeout=60) as r:
        chunks = (line for line in r.iter_lines() if line)
        assert next(chunks).startswith(b"data: {") and next(chunks).startswith(b"data: {")
    abort = 'request_success_total{finished_reason="abort"}'
    wait_until(lambda: _abort_count(server) == after[abort] + 1, 10)
    text = requests.get(server + "/metrics").text
    assert metric_value(text, "request_params_max_tokens_count") \
        == after["request_params_max_tokens_count"] + 1
    assert metric_value(text, "request_params_max_tokens_sum") \
        == after["request_params_max_tokens_sum"] + 900


@pytest.mark.parametrize("flag", ["--log-stats-interval", "--response-write-timeout"])
def test_server_intervals_must_be_positive(tiny_model_dir, flag):
    run = subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                          flag, "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"{flag}: expected seconds > 0" in run.stderr, run.stderr


# ---- shutdown with requests in flight; bounded connections ---------------------------------

def _port_closed(url) -> bool:
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def _stopped_clean(proc, agents, err) -> None:
    """Exit 0, no traceback, no WorkAgent and no shared memory left."""
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "Exception in ASGI" not in err, err[-3000:]
    assert not [a for a in agents if os.path.exists(f"/proc/{a}")], "a WorkAgent outlived it"
    assert not segments_of(proc.pid), "the server left shared memory behind"


def test_sigterm_ends_long_requests_with_a_shutdown_error(tmp_path, tiny_model_dir):
    """SIGTERM with long requests running and queued, on every route: once the drain window
    (--shutdown-timeout) is over each ends through its route's error path, saying the server
    is shutting down: a JSON 503 for a whole answer, an error event then [DONE] on an OpenAI
    stream (the openai client raises it), llm-serving's error line on generate_stream. The
    server exits 0 with nothing left behind and nothing but its own lines in the log."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--shutdown-timeout", "0.5",
                                "--max-model-len", "2048", "--max-num-seqs", "3")
    agents = agent_pids(proc.pid)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    long_cmpl = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True}
    long_chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}],
                 "max_tokens": 2000, "ignore_eos": True}
    long_gen = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    results = {}

    def whole(name, path, body):
        r = requests.post(url + path, json=body, timeout=60)
        results[name] = (r.status_code, r.headers.get("content-type"), r.json())

    def raw_stream(name, path, body):
        with requests.post(url + path, json=body, stream=True, timeout=60) as r:
            results[name] = [line for line in r.iter_lines() if line]

    def openai_stream(name):
        try:
            chat = {k: v for k, v in long_chat.items() if k != "ignore_eos"}
            for _ in client.chat.completions.create(stream=True, **chat,
                                                    extra_body={"ignore_eos": True}):
                pass
            results[name] = "finished"
        except openai.APIError as e:
            results[name] = e

    jobs = [(whole, "cmpl", "/v1/completions", long_cmpl),
            (whole, "gen", "/models/llama2/generate", long_gen),
            (raw_stream, "chat_sse", "/v1/chat/completions", {**long_chat, "stream": True}),
            (raw_stream, "gen_stream", "/models/llama2/generate_stream", long_gen),
            (openai_stream, "openai"),
            (whole, "cmpl2", "/v1/completions", long_cmpl),
            (raw_stream, "gen_stream2", "/models/llama2/generate_stream", long_gen)]
    threads = [threading.Thread(target=job, args=args) for job, *args in jobs]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: _gauge(url, "num_requests_running") == 3
                   and _gauge(url, "num_requests_waiting") == 4, 30,
                   "the requests did not start", every=0.05)
        host, port = url.rsplit("/", 1)[1].split(":")
        uploading = socket.create_connection((host, int(port)), timeout=10)
        uploading.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for t in threads:
            t.join(30)
        ended = time.monotonic() - t0
        upload_answer, _ = _read_to_close(uploading)   # a body still coming: a 503 too
        uploading.close()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ended < 5, ended          # the 0.5 s window, not uvicorn's 10 s
    assert upload_answer.startswith(b"HTTP/1.1 503 ") and b"shutting down" in upload_answer
    for name in ("cmpl", "gen", "cmpl2"):
        status, ctype, body = results[name]
        assert (status, ctype) == (503, "application/json"), results[name]
        assert body["error"]["message"] == "the server is shutting down", body
        assert body["error"]["type"] == "service_unavailable"
    assert results["chat_sse"][-1] == b"data: [DONE]"
    event = json.loads(results["chat_sse"][-2][len(b"data: "):])
    assert event["error"]["message"] == "the server is shutting down", event
    assert "shutting down" in str(results["openai"]), results["openai"]
    for name in ("gen_stream", "gen_stream2"):
        assert _generate_stream_error(results[name]) == "the server is shutting down"
    _stopped_clean(proc, agents, err)
    assert "aborting 7 unfinished request(s)" in err, err[-2000:]
    assert _port_closed(url)


def test_sigterm_lets_requests_in_flight_finish_while_ready_says_503(tmp_path, tiny_model_dir):
    """Within the drain window a request in flight finishes as usual; meanwhile the port stays
    open, /ready answers 503 and a new request gets a JSON 503; the server exits as soon as
    the request is done, not at the end of the window."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--shutdown-timeout", "60")
    agents = agent_pids(proc.pid)
    try:
        with requests.post(url + "/v1/completions", stream=True, timeout=60, json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True,
                "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line)
            first = [next(lines)]                       # running
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            ready = requests.get(url + "/ready", timeout=5)
            refused = requests.post(url + "/models/llama2/generate", timeout=5, json={
                "inputs": PROMPTS[1], "parameters": {"max_new_tokens": 4}})
            rest = first + list(lines)
        _, err = proc.communicate(timeout=30)
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ready.status_code == 503 and ready.json() == {"ready": False,
                                                         "reason": "shutting down"}
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["message"] == "the server is shutting down"
    assert rest[-1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: "):]) for line in rest[:-1]]
    assert not any("error" in c for c in chunks), rest[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 100
    assert stopped < 30
    _stopped_clean(proc, agents, err)


def _read_to_close(sock, timeout=10.0) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    sock.settimeout(timeout)
    t0, data = time.monotonic(), b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def _is_closed(sock) -> bool:
    sock.settimeout(0.001)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionError:
        return True


def test_connections_are_bounded(tmp_path, tiny_model_dir):
    """At a small open-file limit (256) the server caps its connections (16 here): a flood
    of idle connections closes the oldest idle ones and a client's request still succeeds;
    when every connection is busy (heads sent, bodies held back) a new one gets a JSON 503 at
    once. A connection that never completes its request is closed after
    --request-read-timeout (408 when part of a request came); an oversized head gets a 431.
    A client that stops reading its stream is cut off after --response-write-timeout, and
    its request aborted. No traceback, and no log flood."""
    import resource

    def low_fd_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--request-read-timeout", "1",
                                "--response-write-timeout", "1",
                                "--max-num-seqs", "8", "--max-waiting-requests", "8",
                                preexec_fn=low_fd_limit)
    host, port = url.rsplit("/", 1)[1].split(":")
    agents = agent_pids(proc.pid)
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4}
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")

    def connect():
        return socket.create_connection((host, int(port)), timeout=10)
    try:
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        # 300 idle connections: the server keeps at most its cap open, a request gets through
        idle = []
        for _ in range(300):
            idle.append(connect())
        t0 = time.monotonic()
        assert requests.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        assert time.monotonic() - t0 < 3
        assert len(os.listdir(f"/proc/{proc.pid}/fd")) < fds + 16 + 70
        assert sum(map(_is_closed, idle)) >= 300 - 16
        for s in idle:
            s.close()
        # every connection busy (a head sent, its body held back): a new one gets a 503 at once
        busy = []
        for _ in range(16):
            busy.append(connect())
            busy[-1].sendall(head)
        time.sleep(0.2)
        t0 = time.monotonic()
        r = requests.post(url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 1, r.text
        assert "connection limit" in r.json()["error"]["message"]
        # ... and after the read timeout they are closed with a 408, and requests get through
        answers = [_read_to_close(s) for s in busy]
        assert all(a.startswith(b"HTTP/1.1 408 ") for a, _ in answers), answers[0]
        assert max(t for _, t in answers) < 3
        assert requests.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        for s in busy:
            s.close()
        # the read timeout: a silent connection, a partial head, a body short of its length
        for sent, answer in ((b"", b""), (b"GET /live HTTP/1.1\r\nHost: x\r\n", b"HTTP/1.1 408 "),
                             (head + b'{"model":', b"HTTP/1.1 408 ")):
            with connect() as s:
                s.sendall(sent)
                data, took = _read_to_close(s)
            assert data.startswith(answer) and (answer or not data), data
            assert 0.5 < took < 3, took
        # the head bounds: 32 KiB, 100 headers
        for extra in (b"X-Big: " + b"a" * 200_000 + b"\r\n",
                      b"".join(b"X-%d: 1\r\n" % i for i in range(10_000)),
                      b"".join(b"X-%d: 1\r\n" % i for i in range(150))):
            with connect() as s:
                s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
                data, took = _read_to_close(s)
            assert data.startswith(b"HTTP/1.1 431 ") and took < 2, data[:200]
        ok = requests.get(url + "/live", headers={f"X-{i}": "1" for i in range(60)}, timeout=5)
        assert ok.status_code == 200
        # a stream the client stops reading: 8 choices of 1000 tokens, 20 logprobs each (about
        # 16 MB, more than the socket buffers hold), read by a socket with a small window. A
        # fast CPU generates them all in under a second, before the write stalls long enough;
        # so once 300 tokens a choice (some 5 MB) were made, the WorkAgent is held: the
        # requests are still running when the stalled write times out.
        aborted = metric(url, 'request_success_total{finished_reason="abort"}')
        generated = metric(url, "generation_tokens_total")
        stream = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                             "n": 8, "max_tokens": 1000, "temperature": 1, "stream": True,
                             "logprobs": True, "top_logprobs": 20,
                             "ignore_eos": True}).encode()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(stream)
                      + stream)
            wait_until(lambda: metric(url, "generation_tokens_total") >= generated + 8 * 300,
                       timeout=60, every=0.01)
            for agent in agents:
                os.kill(agent, signal.SIGSTOP)
            try:
                time.sleep(2)           # the stalled write times out (1 s): the cut comes
            finally:
                for agent in agents:
                    os.kill(agent, signal.SIGCONT)
            wait_until(lambda: metric(url, 'request_success_total{finished_reason="abort"}')
                       == aborted + 8, timeout=60)       # each of its n sequences, as vLLM
            assert metric(url, "num_requests_running") == 0
            data, _ = _read_to_close(s)      # what the buffers held, then the close
        assert data.startswith(b"HTTP/1.1 200 ") and not data.endswith(b"[DONE]\n\n")
        assert 1 << 20 < len(data) < 12 << 20
        assert requests.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
    finally:
        code = stop_server(proc)
    err = proc.stderr.read()
    _stopped_clean(proc, agents, err)
    assert code == 0 and len(err.splitlines()) < 40, err[-3000:]


def test_accept_errors_are_logged_once_a_minute(caplog):
    """asyncio reports a failed accept() (the open-file limit) with a traceback per attempt,
    thousands a second; the server's loop handler says it once a minute."""
    from llm_serving.entrypoints.connections import ConnectionBounds
    bounds = ConnectionBounds(16)
    loop = None
    with caplog.at_level("INFO", logger="llm_serving.server"):
        for _ in range(1000):
            bounds.log_accept_errors(loop, {"message": "socket.accept() out of system resource",
                                            "exception": OSError(24, "Too many open files")})
    assert len(caplog.records) == 1 and "Too many open files" in caplog.text


def test_a_chat_body_of_many_messages_leaves_other_streams_flowing(server):
    """100 000 one-character messages (3.4 MB) take seconds to put through the chat template;
    another client's stream keeps receiving tokens meanwhile (the template runs off the event
    loop), and the request is refused naming messages (too long for the model)."""
    body = json.dumps({"model": "tiny", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "a"}] * 100_000})
    times = []

    def stream():
        with requests.post(server + "/v1/completions", stream=True, timeout=300,
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 900,
                                 "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    times.append(time.monotonic())
    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: len(times) >= 5, 60)
    t0 = time.monotonic()
    big = requests.post(server + "/v1/chat/completions", data=body, timeout=300,
                        headers={"Content-Type": "application/json"})
    t1 = time.monotonic()
    reader.join(300)
    assert big.status_code == 400 and big.json()["error"]["param"] == "messages"
    assert times[-1] > t1, "the stream ended before the big request did; make it longer"
    during = [t for t in times if t0 < t < t1]
    gaps = [b - a for a, b in zip([t0] + during, during + [t1])]
    # Before, the loop was held for the whole request: one gap of (t1 - t0).
    assert max(gaps) < 0.75 * (t1 - t0), (max(gaps), t1 - t0, len(during))


def test_shutdown_answers_every_request_while_a_model_step_hangs(tmp_path, tiny_model_dir):
    """SIGTERM while the WorkAgent is stuck in a step (here stopped): the engine thread cannot
    take the shutdown's abort, yet every request in flight still gets the documented answer
    (a JSON 503 "the server is shutting down"; on a stream an error event, then [DONE]), not
    uvicorn's text/plain 500 or a cut stream; the server exits 0 within docker stop's 10 s
    (the default --shutdown-timeout), the agent killed and the shared memory freed. It took
    about 30 s: the teardown waited 10 s for the engine thread, then 10 s for the agent to
    take its QUIT, so a service manager killed it and /dev/shm kept its segments."""
    proc, url, _ = start_server(tmp_path, tiny_model_dir)
    [agent] = agent_pids(proc.pid)
    results, started = {}, []

    def one(i, stream):
        body = dict(model="tiny", prompt="Hello", max_tokens=1000, ignore_eos=True,
                    stream=stream)
        with requests.post(url + "/v1/completions", json=body, stream=stream,
                           timeout=120) as r:
            if not stream:
                results[i] = (r.status_code, r.headers["content-type"], r.text)
                return
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line.decode())
                    started.append(i)
            results[i] = (r.status_code, "stream", lines[-2:])
    threads = [threading.Thread(target=one, args=(i, i % 2 == 0)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: set(started) == {0, 2}, 60)
        # the non-streamed ones are running too (a fast CPU runs the tiny model's 1000 tokens
        # in under a second: the agent is stopped as soon as all four run)
        wait_until(lambda: metric(url, "num_requests_running") == 4, 30, every=0.01)
        os.kill(agent, signal.SIGSTOP)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(120)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(agent, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # No step ended in the drain window: the aborted requests are answered at once, not
    # after ANSWER_ABORTED_S more (the step would not have ended in it either).
    assert took < SHUTDOWN_TIMEOUT_S + ANSWER_ABORTED_S, f"the server took {took:.1f} s to exit"
    assert not os.path.exists(f"/proc/{agent}"), "the WorkAgent outlived the server"
    assert not segments_of(proc.pid), "the server left shared memory behind"
    for i in (1, 3):
        status, kind, text = results[i]
        assert (status, kind) == (503, "application/json"), results[i]
        assert json.loads(text)["error"]["message"] == "the server is shutting down"
    for i in (0, 2):
        status, _, (error, done) = results[i]
        assert status == 200 and done == "data: [DONE]", results[i]
        assert json.loads(error[len("data: "):])["error"]["message"] == \
            "the server is shutting down"
