"""The OpenAI surface against the real server (start.py, the random tiny model in a
WorkAgent, async scheduling) with the real `openai` client: logit_bias, allowed_token_ids,
bad_words, structured outputs, tool calls, and no request field silently dropped.

The tiny model's weights are random: its outputs are valid JSON, match a regex or a schema
only because the grammar forces them to."""
from __future__ import annotations

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest
import requests

from test_http_server import free_port, start_server, stop_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    proc, url, _ = start_server(tmp_path_factory.mktemp("oai"), tiny_model_dir,
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--trust-request-chat-template", "--enable-tokenizer-info-endpoint",
                                agent_ports=(free_port(),))
    logs: list[str] = []
    readers = [threading.Thread(target=lambda f=f: logs.extend(iter(f.readline, "")),
                                daemon=True) for f in (proc.stdout, proc.stderr)]
    for t in readers:
        t.start()
    try:
        yield url, logs
    finally:
        assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none")


def _token_texts(client, **kw) -> list[str]:
    """The generated tokens' texts (completions logprobs), greedy from "Hello there"."""
    r = client.completions.create(model="tiny", prompt="Hello there", logprobs=0,
                                  max_tokens=6, **{"temperature": 0, **kw})
    return r.choices[0].logprobs.tokens


def _text_of(server, ids) -> list[str]:
    return [requests.post(server[0] + "/detokenize", json={"tokens": [t]}).json()["prompt"]
            for t in ids]


# ---- prompt_logprobs (vLLM's field) ------------------------------------------------------

def _check_prompt_logprobs_json(pl, prompt, ref, k):
    """vLLM's JSON: null, then per token id (a string) -> {logprob, rank, decoded_token},
    the prompt's token first and the top k after it; the numbers HF's log_softmax."""
    assert len(pl) == len(prompt) and pl[0] is None
    for i in range(1, len(prompt)):
        row, tok, entry = ref[i - 1], prompt[i], pl[i]
        assert list(entry)[0] == str(tok)
        rank = entry[str(tok)]["rank"]          # 1 + how many are more likely (ties: either)
        assert np.count_nonzero(row > row[tok] + 1e-4) < rank <= np.count_nonzero(
            row >= row[tok] - 1e-4)
        top = np.argsort(-row)[:k]
        assert set(entry) == {str(tok), *map(str, top)}
        got = [entry[str(t)]["logprob"] for t in [tok, *top]]
        np.testing.assert_allclose(got, row[[tok, *top]], atol=1e-4, rtol=0)
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_prompt_logprobs_come_back_as_vllms_field_with_hfs_numbers(server, tiny_hf_logprobs):
    prompts, ref = tiny_hf_logprobs
    prompt, ref = prompts[2], ref[2]            # 30 token ids: no BOS added
    url = server[0] + "/v1"
    r = requests.post(url + "/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "n": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:          # each choice carries its prompt's
        _check_prompt_logprobs_json(choice["prompt_logprobs"], prompt, ref, 3)
    # echo with logprobs scores the prompt with logprobs' top ones (vLLM's)
    r = requests.post(url + "/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 2})
    _check_prompt_logprobs_json(r.json()["choices"][0]["prompt_logprobs"], prompt, ref, 2)
    plain = requests.post(url + "/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    # chat: the answer's, over the templated prompt; echo alone asks for 0 alternatives
    for extra, k in (({"prompt_logprobs": 2}, 2), ({"echo": True}, 0)):
        r = requests.post(url + "/chat/completions", json={
            "model": "tiny", "messages": MSG, "max_tokens": 2, **extra})
        body = r.json()
        pl = body["prompt_logprobs"]
        assert len(pl) == body["usage"]["prompt_tokens"] and pl[0] is None
        assert all(len(entry) in (k, k + 1) for entry in pl[1:])
    # a stream takes only 0 (and shows none), as vLLM; more is refused by name
    r = requests.post(url + "/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0,
        "stream": True})
    assert r.status_code == 200 and "prompt_logprobs" not in r.text
    for body, why in (({"prompt_logprobs": 1, "stream": True}, "stream"),
                      ({"prompt_logprobs": -1}, "max_logprobs (20)"),
                      ({"prompt_logprobs": 21}, "max_logprobs (20)"),
                      ({"prompt_logprobs": -2}, "-1")):
        r = requests.post(url + "/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert why in r.json()["error"]["message"]


# ---- logit_bias, allowed_token_ids, bad_words --------------------------------------------

def test_prompt_embeds_without_the_flag_is_a_400_naming_it(server):
    url, _ = server
    r = requests.post(url + "/v1/completions", json={"model": "tiny", "prompt_embeds": "AAAA"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"
    assert "--enable-prompt-embeds" in r.json()["error"]["message"]


def test_logit_bias_forces_and_bans_tokens(server, client, tiny_llm):
    from llm_serving import SamplingParams
    # +100 on one token: every greedy token is that token (as vLLM does).
    (t300,) = _text_of(server, [300])
    assert _token_texts(client, logit_bias={"300": 100}, extra_body={"ignore_eos": True}) \
        == [t300] * 6
    # -100 on the token greedy decoding chooses first: another one comes first.
    first = tiny_llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=1)
                              )[0].outputs[0].token_ids[0]
    (text,) = _text_of(server, [first])
    assert _token_texts(client)[0] == text
    assert _token_texts(client, logit_bias={str(first): -100})[0] != text


def test_allowed_token_ids_and_bad_words(server, client):
    allowed = [300, 301, 302, 303]
    got = _token_texts(client, temperature=1, seed=7,
                       extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert len(got) == 6 and set(got) <= set(_text_of(server, allowed))
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                      temperature=0).choices[0].text
    word = plain.split()[0]
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [word]})
    assert r.choices[0].text != plain and word not in r.choices[0].text.split()


# ---- structured outputs ------------------------------------------------------------------

def test_json_object_output_parses(client):
    for prompt in ("Give me a JSON object.", "hi"):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                      "content": prompt}],
                                           max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema whose instances are bounded in length."""
    kinds = ["boolean", "null", "integer", "string", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            s = {"type": "string", "pattern": "^[a-z]{1,5}$"}
        return s
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 3, None, True, "x y"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1),
                "maxItems": rng.randint(0, 3)}
    if kind == "object":
        names = rng.sample(["a", "b", "name", "age", "tags", "ok", "id"], rng.randint(1, 4))
        props = {n: _random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n in names if rng.random() < 0.7]}
    return {"type": kind}


def test_json_schema_outputs_validate_on_50_random_schemas(client):
    rng = random.Random(18)
    schemas = [_random_schema(rng) for _ in range(50)]
    schemas = [{"type": "object", "properties": {"v": s}, "required": ["v"],
                "additionalProperties": False} for s in schemas]

    def ask(i):
        s = schemas[i]
        kw = dict(model="tiny", max_tokens=300, temperature=1.0, seed=i,
                  messages=[{"role": "user", "content": f"Schema {i}"}])
        if i % 3 == 0:    # OpenAI's response_format
            r = client.chat.completions.create(
                response_format={"type": "json_schema",
                                 "json_schema": {"name": f"s{i}", "schema": s}}, **kw)
        elif i % 3 == 1:  # vLLM's guided_json on the completions route
            r = client.completions.create(model="tiny", prompt=f"Schema {i}", max_tokens=300,
                                          temperature=1.0, seed=i, extra_body={"guided_json": s})
            return s, [c.text for c in r.choices], [c.finish_reason for c in r.choices]
        else:             # vLLM's structured_outputs, n = 2
            r = client.chat.completions.create(n=2, extra_body={"structured_outputs":
                                                                {"json": s}}, **kw)
        return s, [c.message.content for c in r.choices], [c.finish_reason for c in r.choices]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(schemas))))
    for s, texts, finishes in results:
        for text, finish in zip(texts, finishes):
            assert finish == "stop", (s, text)
            jsonschema.validate(json.loads(text), s)


def test_streamed_json_schema_output_validates(client):
    s = WEATHER["function"]["parameters"]
    stream = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=100, temperature=1, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": s}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), s)


def test_regex_choice_and_grammar_outputs_match(server, client):
    r = client.completions.create(model="tiny", prompt="Call me at", max_tokens=30,
                                  temperature=1, seed=1, n=3,
                                  extra_body={"guided_regex": r"\+?[0-9]{2}-[0-9]{3}-[a-z]{2,4}"})
    for c in r.choices:
        assert re.fullmatch(r"\+?[0-9]{2}-[0-9]{3}-[a-z]{2,4}", c.text), c.text
    choices = ["red", "green", "dark blue"]
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=10,
                                       temperature=1, seed=2, n=4,
                                       extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    grammar = 'start: "(" num (op num)* ")"\nop: "+" | "*"\nnum: /[1-9]/'
    r = client.completions.create(model="tiny", prompt="Sum:", max_tokens=30, temperature=1,
                                  seed=3, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([1-9]([+*][1-9])*\)", r.choices[0].text), r.choices[0].text
    # llm-serving's route: TGI's parameters.grammar.
    body = {"inputs": "Code:", "parameters": {"max_new_tokens": 20, "do_sample": True,
                                              "grammar": {"type": "regex",
                                                          "value": "[A-Z]{3}[0-9]{2}"}}}
    r = requests.post(server[0] + "/models/llama2/generate", json=body)
    assert r.status_code == 200 and re.fullmatch("[A-Z]{3}[0-9]{2}", r.json()["generated_text"])


@pytest.mark.parametrize("body, field", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "whatever": 1}}, "structured_outputs"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, body, field):
    r = requests.post(server[0] + "/v1/completions",
                      json={"model": "tiny", "prompt": "x", "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


# ---- tool calls ----------------------------------------------------------------------------

def test_a_named_tool_choice_forces_a_valid_call(client):
    schema = WEATHER["function"]["parameters"]
    r = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=100, temperature=1, seed=5, n=2,
        tools=[WEATHER, TIME], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and c.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # Streamed: the call's name first, then the arguments as deltas.
    stream = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=100, temperature=1, seed=6, stream=True,
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, args, pieces = [], "", 0
    for chunk in stream:
        for d in chunk.choices:
            for tc in d.delta.tool_calls or ():
                if tc.function.name:
                    names.append(tc.function.name)
                if tc.function.arguments:
                    args += tc.function.arguments
                    pieces += 1
    assert names == ["get_weather"] and pieces > 1
    jsonschema.validate(json.loads(args), schema)


def test_required_tool_choice_calls_one_of_the_tools(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=200,
                                           temperature=1, seed=seed, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_auto_tool_choice_reads_hermes_calls(client):
    # The random model writes no call by itself: a guided choice makes it write one in the
    # hermes format, which the parser then reads (content before it stays content).
    call = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 2}}</tool_call>')
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=200,
                                       tools=[WEATHER], tool_choice="auto",
                                       extra_body={"guided_choice": [call]})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris",
                                                                       "days": 2}
    # Plain text with tools stays content.
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                       tools=[WEATHER], temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def _stream_events(stream):
    """A streamed choice 0 as events in order: ("content", text), ("name", index, name),
    ("args", index, text), ("finish", reason)."""
    events = []
    for chunk in stream:
        for d in chunk.choices:
            if d.delta.content:
                events.append(("content", d.delta.content))
            for tc in d.delta.tool_calls or ():
                if tc.function and tc.function.name:
                    assert tc.id and tc.type == "function"
                    events.append(("name", tc.index, tc.function.name))
                if tc.function and tc.function.arguments:
                    events.append(("args", tc.index, tc.function.arguments))
            if d.finish_reason:
                events.append(("finish", d.finish_reason))
    return events


def _calls_of(events) -> dict:
    """index -> (name, arguments text), from the events; a name comes before its arguments."""
    calls = {}
    for e in events:
        if e[0] == "name":
            assert e[1] not in calls
            calls[e[1]] = [e[2], ""]
        elif e[0] == "args":
            calls[e[1]][1] += e[2]
    return {i: tuple(c) for i, c in calls.items()}


def test_required_tool_calls_stream_name_then_arguments(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(2):
        kw = dict(model="tiny", messages=MSG, max_tokens=200, temperature=1, seed=seed,
                  tools=[WEATHER, TIME], tool_choice="required")
        events = _stream_events(client.chat.completions.create(stream=True, **kw))
        calls = _calls_of(events)
        assert calls and events[-1] == ("finish", "tool_calls")
        assert not [e for e in events if e[0] == "content"]
        # The arguments come in pieces, and the stream says what the whole answer says.
        assert len([e for e in events if e[0] == "args"]) > len(calls)
        whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == \
            [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]
        for name, args in calls.values():
            jsonschema.validate(json.loads(args), schemas[name])


def test_auto_tool_calls_stream_content_then_the_call(client):
    call = ('Sure, let me see. <tool_call>{"name": "get_weather", "arguments": {"city": '
            '"Paris", "days": 2}}</tool_call>')
    events = _stream_events(client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=200, tools=[WEATHER], tool_choice="auto",
        stream=True, extra_body={"guided_choice": [call]}))
    kinds = [e[0] for e in events]
    # The content before the call comes as it is generated, in several pieces, before it.
    assert kinds.index("name") > 1 and kinds[:kinds.index("name")] == ["content"] * \
        kinds.index("name") and "content" not in kinds[kinds.index("name"):]
    assert "".join(e[1] for e in events if e[0] == "content") == "Sure, let me see. "
    assert _calls_of(events) == {0: ("get_weather", '{"city": "Paris", "days": 2}')}
    assert kinds.count("args") > 1 and events[-1] == ("finish", "tool_calls")
    # Plain text with tools streams as content, as it comes, and equals the whole answer.
    kw = dict(model="tiny", messages=MSG, max_tokens=12, tools=[WEATHER], temperature=0)
    events = _stream_events(client.chat.completions.create(stream=True, **kw))
    assert {e[0] for e in events} == {"content", "finish"} and len(events) > 3
    assert "".join(e[1] for e in events if e[0] == "content") == \
        client.chat.completions.create(**kw).choices[0].message.content
    # as vLLM's: the last text comes in the finish chunk, not before an empty one
    assert events[-2][0] == "content" and events[-1] == ("finish", "length")
    last = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices][-1]
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.content


def test_the_chat_template_receives_the_tools(server, client):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if tools %}{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"
                "{% endif %}")
    usage = [client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1, temperature=0, tool_choice="none",
        tools=[WEATHER], extra_body={"chat_template": template}).usage.prompt_tokens]
    usage.append(client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1, temperature=0, tools=[WEATHER, TIME],
        tool_choice="required", extra_body={"chat_template": template}).usage.prompt_tokens)
    tok = lambda s: len(requests.post(server[0] + "/tokenize",    # noqa: E731
                                      json={"prompt": s, "add_special_tokens": False}
                                      ).json()["tokens"])
    # tool_choice "none" still shows the tools, as vLLM (unless
    # --exclude-tools-when-tool-choice-none: tests/test_vllm_serve_flags.py)
    assert usage == [tok(MSG[0]["content"] + "[get_weather]"),
                     tok(MSG[0]["content"] + "[get_weather][get_time]")]


def test_tokenizer_info_is_what_transformers_reads_of_the_tokenizer(server, tiny_model_dir):
    """vLLM's /tokenizer_info (--enable-tokenizer-info-endpoint): the special tokens, added
    tokens, chat template and lengths transformers reads from the model's tokenizer files
    (vLLM returns transformers' init_kwargs), each token written as its text."""
    transformers = pytest.importorskip("transformers")
    info = requests.get(server[0] + "/tokenizer_info", timeout=30).json()
    ref = transformers.AutoTokenizer.from_pretrained(tiny_model_dir).init_kwargs
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in
                                            ref["added_tokens_decoder"].items()}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template",
                "model_max_length", "clean_up_tokenization_spaces"):
        assert info[key] == (getattr(ref[key], "content", ref[key])), key
    assert info["tokenizer_class"].endswith("Fast") and info["name_or_path"]
    assert "vocab_file" not in info and "merges_file" not in info


def test_tokenize_counts_the_prompt_chat_will_use(server, client):
    """vLLM's /tokenize on messages renders them as the chat route does: the generation
    prompt, a request's own template and its kwargs, and the tools, so its count is chat's
    prompt_tokens. An option it does not know is refused by name."""
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if tools %}{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"
                "{% endif %}{% if add_generation_prompt %}>{{ who }}{% endif %}")
    for gen_prompt in (True, False):
        opts = {"chat_template": template, "chat_template_kwargs": {"who": "bot"},
                "add_generation_prompt": gen_prompt}
        chat = client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=1, temperature=0, tools=[WEATHER],
            tool_choice="required", extra_body=opts).usage.prompt_tokens
        r = requests.post(server[0] + "/tokenize", json={"messages": MSG, "tools": [WEATHER],
                                                         "return_token_strs": True, **opts})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == chat
        assert len(r.json()["token_strs"]) == chat
        text = MSG[0]["content"] + "[get_weather]" + (">bot" if gen_prompt else "")
        plain = requests.post(server[0] + "/tokenize",
                              json={"prompt": text, "add_special_tokens": False}).json()
        assert plain["tokens"] == r.json()["tokens"]
    r = requests.post(server[0] + "/tokenize", json={"prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


@pytest.mark.parametrize("body, field", [
    ({"tool_choice": "required"}, "tool_choice"),                        # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools"),                          # a schema it cannot use
    ({"tools": [WEATHER], "chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(server, body, field):
    r = requests.post(server[0] + "/v1/chat/completions",
                      json={"model": "tiny", "messages": MSG, "max_tokens": 3, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---- no silent drops -----------------------------------------------------------------------

# Every request field of OpenAI's API reference (2026) and of vLLM's extensions, with a value
# that asks for something. HONOURED: the server does it (200). REFUSED: a 400 naming it.
_COMMON_HONOURED = {
    "model": "tiny", "n": 2, "stream": False, "stop": ["\n\n"], "seed": 3, "temperature": 0.5,
    "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"7": -5},
    "user": "u1", "max_tokens": 4, "top_k": 5, "min_p": 0.1, "min_tokens": 1,
    "ignore_eos": True, "repetition_penalty": 1.1, "stop_token_ids": [2], "priority": 0,
    "return_tokens_as_token_ids": True,
    "skip_special_tokens": False, "include_stop_str_in_output": True,
    "spaces_between_special_tokens": False, "allowed_token_ids": list(range(3, 900)),
    "bad_words": ["zzz"], "guided_regex": "[a-z]{1,4}", "safety_identifier": "s1",
    "stream_options": {"include_usage": True}, "guided_decoding_backend": "llguidance",
    "stream_interval": 3, "watermarking": False, "truncate_prompt_tokens": 3,
    "thinking_token_budget": -1, "repetition_detection": {"max_pattern_size": 2, "min_count": 3},
    "prompt_logprobs": 1, "request_id": "r1", "structural_tag": json.dumps({
        "triggers": ["<f="], "structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>"}]}),
    "cache_salt": "s",
}
_COMMON_REFUSED = {
    "logits_processors": ["x"],
    "kv_transfer_params": {},
    "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {}, "store": True, "metadata": {"a": "b"}, "service_tier": "flex",
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
    "guided_decoding_backend": "xgrammar", "watermarking": True,
    "thinking_token_budget": 8,     # this server has no reasoning config (as vLLM refuses)
}
COMPLETIONS = {
    "honoured": {**_COMMON_HONOURED, "prompt": "Hello", "echo": True, "logprobs": 2,
                 "best_of": 1, "suffix": None, "response_format": {"type": "json_object"},
                 "guided_json": {"type": "string", "maxLength": 3},
                 "guided_choice": ["a", "b"], "guided_grammar": 'start: "x"',
                 "structured_outputs": {"regex": "a+"}, "return_token_ids": True},
    "refused": {**_COMMON_REFUSED, "best_of": 2, "suffix": "end"},
}
CHAT = {
    "honoured": {**_COMMON_HONOURED, "messages": MSG, "logprobs": True, "top_logprobs": 2,
                 "max_completion_tokens": 4, "response_format": {"type": "json_object"},
                 "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
                 "add_generation_prompt": True, "chat_template": "{{ messages[0].content }}",
                 "chat_template_kwargs": {"x": 1}, "add_special_tokens": True,
                 "modalities": ["text"], "structured_outputs": {"choice": ["a", "b"]},
                 "continue_final_message": True, "echo": True, "reasoning_effort": "low",
                 "return_prompt_text": True, "return_token_ids": True},
    "refused": {**_COMMON_REFUSED, "audio": {"voice": "alloy", "format": "wav"},
                "modalities": ["text", "audio"], "function_call": "auto",
                "functions": [WEATHER["function"]], "reasoning_effort": "ultra",
                "web_search_options": {}, "verbosity": "low", "documents": [{"a": "b"}]},
}
# Each field is sent alone (structured outputs and forced tools exclude each other).
@pytest.mark.parametrize("path, spec, base", [
    ("/v1/completions", COMPLETIONS, {"prompt": "Hello"}),
    ("/v1/chat/completions", CHAT, {"messages": MSG}),
], ids=["completions", "chat"])
def test_every_spec_field_is_honoured_or_refused_by_name(server, path, spec, base):
    url = server[0] + path
    for field, value in spec["honoured"].items():
        body = {"model": "tiny", "max_tokens": 4, **base, field: value}
        if field == "tool_choice":
            body["tools"] = [WEATHER]
        if field == "stream_options":
            body["stream"] = True
        if field == "top_logprobs":
            body["logprobs"] = True
        if field == "continue_final_message":
            body["add_generation_prompt"] = False
        r = requests.post(url, json=body)
        assert r.status_code == 200, (field, r.text)
    for field, value in spec["refused"].items():
        r = requests.post(url, json={"model": "tiny", "max_tokens": 4, **base, field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_a_request_stream_interval_sends_its_tokens_in_chunks_of_that_many(server):
    """vLLM's per-request stream_interval (the server's is 1 here): after the first chunk,
    chunks of at least 5 tokens but the last (each chunk's logprobs list its tokens), the same
    tokens as an unchunked stream; below 1 it is a 400 naming it."""
    def chunks(**kw):
        r = requests.post(server[0] + "/v1/completions", stream=True, json={
            "model": "tiny", "prompt": "Once upon", "max_tokens": 17, "ignore_eos": True,
            "temperature": 0, "logprobs": 0, "stream": True, **kw})
        assert r.status_code == 200, r.text
        got = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
               if line.startswith("data: {")]
        return [c["choices"][0]["logprobs"]["tokens"] for c in got]
    chunked, plain = chunks(stream_interval=5), chunks()
    assert [t for c in chunked for t in c] == [t for c in plain for t in c]
    assert sum(map(len, plain)) == 17 and 1 < len(chunked) <= 5
    assert all(len(c) >= 5 for c in chunked[1:-1]), [len(c) for c in chunked]
    r = requests.post(server[0] + "/v1/completions",
                      json={"model": "tiny", "prompt": "Hi", "stream_interval": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval"


def test_truncate_prompt_tokens_keeps_the_last_tokens_or_the_first(server, tiny_model_dir):
    """vLLM's truncate_prompt_tokens on completions and chat: the BOS and the last N-1 tokens
    of a text by default (a generating model's tokenizer truncates on the left, and
    transformers' truncation keeps special tokens), the first N with truncation_side
    "right"; a token-id prompt is cut as it is; -1 keeps the model's length less one. The
    echo is the prompt as sent, as vLLM's. add_special_tokens false leaves the BOS out.
    Checked against transformers' tokenization of the same text."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    url = server[0]
    text = "The quick brown fox jumps over the lazy dog near the river bank"
    ids, plain = hf(text).input_ids, hf(text, add_special_tokens=False).input_ids

    def complete(prompt=text, **kw):
        r = requests.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, **kw})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        seen = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"][:-1]]
        assert len(seen) == r.json()["usage"]["prompt_tokens"]
        return choice["text"], seen
    echoed, seen = complete(truncate_prompt_tokens=5)
    assert seen == ids[:1] + plain[-4:] and echoed.startswith(text)
    assert complete(truncate_prompt_tokens=5, truncation_side="right")[1] == ids[:5]
    assert complete(prompt=ids, truncate_prompt_tokens=3)[1] == ids[-3:]
    assert complete(add_special_tokens=False)[1] == plain
    assert complete(truncation_side="left")[1] == ids     # alone it changes nothing (vLLM)
    chat = requests.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": MSG, "max_tokens": 1, "truncate_prompt_tokens": 7})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 7, chat.text
    limit = requests.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    long = requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "fox " * (limit * 2), "max_tokens": 1,
        "truncate_prompt_tokens": -1})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == limit - 1
    r = requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": limit + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_logprob_token_ids_show_those_tokens_scored_as_transformers_does(server,
                                                                         tiny_model_dir):
    """vLLM's logprob_token_ids (with logprobs set) on completions and chat: each position's
    top_logprobs are the chosen token and the asked ids, in that order, with transformers'
    log_softmax; without logprobs, or with beam search, a 400 names the field."""
    import numpy as np
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32).eval()
    prompt, asked = [1, 52, 311, 97, 640, 18], [5, 900, 17]
    common = {"model": "tiny", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
              "logprob_token_ids": asked, "return_tokens_as_token_ids": True}
    r = requests.post(server[0] + "/v1/completions",
                      json={**common, "prompt": prompt, "logprobs": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    gen = [int(t.split(":")[1]) for t in lp["tokens"]]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + gen])).logits[0], -1).numpy()
    for i, (tok, top) in enumerate(zip(gen, lp["top_logprobs"])):
        want = [tok] + [t for t in asked if t != tok]
        assert list(top) == [f"token_id:{t}" for t in want]
        np.testing.assert_allclose(list(top.values()), ref[len(prompt) - 1 + i][want],
                                   atol=1e-4, rtol=0)
    chat = requests.post(server[0] + "/v1/chat/completions",
                         json={**common, "messages": MSG, "logprobs": True})
    assert chat.status_code == 200, chat.text
    for pos in chat.json()["choices"][0]["logprobs"]["content"]:
        tok = int(pos["token"].split(":")[1])
        assert [e["token"] for e in pos["top_logprobs"]] == [
            f"token_id:{t}" for t in [tok] + [t for t in asked if t != tok]]
    for path, body in (("/v1/completions", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": prompt, "logprobs": 1,
                                            "use_beam_search": True, "n": 2})):
        r = requests.post(server[0] + path, json={**common, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text


def test_repetition_detection_and_return_prompt_text(server, tiny_model_dir):
    """vLLM's repetition_detection ends a repeating output with finish_reason "repetition"
    (stop_reason "repetition_detected"), streamed or not; return_prompt_text puts the chat
    template's text (transformers' rendering of the same messages) in the answer and in a
    stream's first chunk only; a bad pattern is a 400 naming the field."""
    from transformers import AutoTokenizer
    url = server[0]
    body = {"model": "tiny", "max_tokens": 20, "temperature": 0, "logit_bias": {"7": 100},
            "repetition_detection": {"max_pattern_size": 3, "min_count": 3}}
    r = requests.post(url + "/v1/completions", json={**body, "prompt": "Hello"}).json()
    c = r["choices"][0]
    assert (c["finish_reason"], c["stop_reason"], r["usage"]["completion_tokens"]) == (
        "repetition", "repetition_detected", 3)
    events = [json.loads(line[6:]) for line in requests.post(
        url + "/v1/chat/completions", stream=True,
        json={**body, "messages": MSG, "stream": True, "return_prompt_text": True}
        ).iter_lines(decode_unicode=True) if line.startswith("data: {")]
    rendered = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        MSG, tokenize=False, add_generation_prompt=True)
    assert [e.get("prompt_text") for e in events] == [rendered] + [None] * (len(events) - 1)
    assert events[-1]["choices"][0]["finish_reason"] == "repetition"
    chat = requests.post(url + "/v1/chat/completions",
                         json={"model": "tiny", "messages": MSG, "max_tokens": 1,
                               "return_prompt_text": True}).json()
    assert chat["prompt_text"] == rendered
    bad = requests.post(url + "/v1/completions", json={
        **body, "prompt": "Hi", "repetition_detection": {"max_pattern_size": 2, "min_count": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection"


def test_generative_scoring_scores_items_as_transformers_does(server, tiny_model_dir):
    """vLLM's /generative_scoring: each item after the query (before it with item_first) is
    scored by its first label's probability as the next token, a softmax over the labels
    or (apply_softmax false) over the vocabulary, checked against transformers' log_softmax
    of the same token ids; the field at fault is named in a 400."""
    import numpy as np
    import torch
    import transformers
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32).eval()
    query, items, labels = "Is it true? Answer:", [" yes", " no way"], [5, 900, 17]
    q_ids = hf_tok(query).input_ids

    def expected(joined, apply_softmax):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([joined])).logits[0, -1], -1).numpy()
        chosen = lp[labels]
        return float(np.exp(chosen[0]) / np.exp(chosen).sum() if apply_softmax
                     else np.exp(chosen[0]))
    for apply_softmax, item_first in ((True, False), (False, True)):
        r = requests.post(server[0] + "/generative_scoring", json={
            "model": "tiny", "query": query, "items": items, "label_token_ids": labels,
            "apply_softmax": apply_softmax, "item_first": item_first,
            "cache_salt": "tenant-a", "request_id": "gs-1"})      # vLLM's, taken
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["id"] == "generative-scoring-gs-1"
        joined = [hf_tok(i, add_special_tokens=False).input_ids for i in items]
        joined = [i + q_ids if item_first else q_ids + i for i in joined]
        assert [d["index"] for d in got["data"]] == [0, 1]
        np.testing.assert_allclose([d["score"] for d in got["data"]],
                                   [expected(j, apply_softmax) for j in joined], rtol=1e-3)
        assert got["usage"]["prompt_tokens"] == sum(map(len, joined))
    for body, field in (({"label_token_ids": []}, "label_token_ids"),
                        ({"items": []}, "items"),
                        ({"label_token_ids": [10**6]}, "label_token_ids"),
                        ({"label_token_ids": list(range(30))}, "label_token_ids"),
                        ({"cache_salt": ""}, "cache_salt")):
        r = requests.post(server[0] + "/generative_scoring", json={
            "model": "tiny", "query": query, "items": items, "label_token_ids": labels, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_invocations_answers_as_the_route_the_body_is_for(server):
    """vLLM's SageMaker /invocations on a generative model: a body with messages is a chat
    completion, one with a prompt a completion (greedy: the same answer as the route's own);
    a malformed body is a 400 naming its field, one of neither kind a 400 naming body."""
    url = server[0]
    for path, body in (("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": "Once upon"})):
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
        direct = requests.post(url + path, json=body).json()
        via = requests.post(url + "/invocations", json=body).json()
        assert via["object"] == direct["object"] and via["usage"] == direct["usage"]
        assert via["choices"] == direct["choices"]
    for body, field in (({"messages": 5}, "messages"), ({"input": "x"}, "body"),
                        ([1, 2], "body")):
        r = requests.post(url + "/invocations", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_batch_chat_answers_each_conversation_as_one_choice(server):
    """vLLM 0.32's /v1/chat/completions/batch: conversation i is choice i, the answer the
    chat route gives it alone (greedy), the usage summed; streaming, tools, beam search and
    n > 1 are a 400 naming them, as vLLM, and so is an empty conversation."""
    url = server[0]
    talks = [MSG, [{"role": "user", "content": "Once upon a time"}]]
    common = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    alone = [requests.post(url + "/v1/chat/completions", json={**common, "messages": m}).json()
             for m in talks]
    batch = requests.post(url + "/v1/chat/completions/batch",
                          json={**common, "messages": talks}).json()
    assert batch["object"] == "chat.completion"
    assert batch["choices"] == [{**a["choices"][0], "index": i} for i, a in enumerate(alone)]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)
    for body, field in (({"stream": True}, "stream"), ({"n": 2}, "n"),
                        ({"tools": [WEATHER]}, "tools"),
                        ({"use_beam_search": True}, "use_beam_search"),
                        ({"messages": [MSG, []]}, "messages"),
                        ({"prompt_logprobs": 1}, "prompt_logprobs")):
        r = requests.post(url + "/v1/chat/completions/batch",
                          json={**common, "messages": talks, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # one conversation's prompt fields are not the batch's (vLLM's batch answer has none)
    echoed = requests.post(url + "/v1/chat/completions/batch", json={
        **common, "messages": talks, "echo": True, "return_token_ids": True,
        "ignore_eos": True}).json()
    assert "prompt_logprobs" not in echoed and "prompt_token_ids" not in echoed
    assert [len(c["token_ids"]) for c in echoed["choices"]] == [5, 5]


def test_chat_return_token_ids_gives_the_prompt_and_output_ids(server, tiny_model_dir):
    """vLLM's return_token_ids on chat: the answer's prompt_token_ids are transformers'
    tokenization of the rendered template, each choice's token_ids the tokens of its text;
    streamed, each choice's first chunk has the prompt's ids and the other chunks their own
    tokens, the same ids in all."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = {"model": "tiny", "messages": MSG, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    whole = requests.post(server[0] + "/v1/chat/completions", json=body).json()
    rendered = hf.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)
    assert whole["prompt_token_ids"] == hf(rendered, add_special_tokens=False).input_ids
    out = whole["choices"][0]
    assert len(out["token_ids"]) == 6
    assert hf.decode(out["token_ids"], skip_special_tokens=True) == out["message"]["content"]
    events = [json.loads(line[6:]) for line in requests.post(
        server[0] + "/v1/chat/completions", json={**body, "stream": True}, stream=True
        ).iter_lines(decode_unicode=True) if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == out["token_ids"]


def test_unknown_fields_are_accepted_and_named_once_in_the_log(server, client):
    url, logs = server
    r = client.chat.completions.create(model="tiny", messages=[{**MSG[0], "mood": "x"}],
                                       max_tokens=2, extra_body={"frobnicate": 1, "zorp": "a"},
                                       stream=True, stream_options={"include_usage": True,
                                                                    "blorp": 2})
    r = list(r)[-2]          # the last choice chunk (before the usage chunk)
    assert r.choices[0].finish_reason in ("stop", "length")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("frobnicate" in x for x in list(logs)):
        time.sleep(0.1)
    warned = [line for line in list(logs) if "frobnicate" in line]
    assert len(warned) == 1 and "zorp" in warned[0] and "ignored" in warned[0]
    assert "stream_options.blorp" in warned[0] and "messages[0].mood" in warned[0]


# ---- where vLLM's answer differs from a strict reading of OpenAI's: vLLM's ------------------

def test_max_tokens_beyond_the_context_is_lowered_as_vllm_does(server, client):
    """A max_tokens that fits the model but not after the prompt is lowered to what is left
    (scripts set max_tokens to the context size); one above max_model_len is a 400."""
    longest = client.models.list().data[0].max_model_len
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=longest,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == longest
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=longest,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == longest
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions",
                                                                 {"messages": MSG})):
        r = requests.post(server[0] + path, json={**body, "max_tokens": longest + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert str(longest) in r.json()["error"]["message"]


def test_stop_reason_names_what_ended_each_choice(client):
    """vLLM's stop_reason: the stop string or stop token id that ended the choice, null for
    EOS and for length; on every stream chunk (null until the last)."""
    free = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert free.choices[0].stop_reason is None and free.choices[0].finish_reason == "length"
    stop = text[4:7]
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].stop_reason == stop and r.choices[0].finish_reason == "stop"
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=12, temperature=0, stop=[stop],
        stream=True, extra_body={"ignore_eos": True}) if c.choices]
    assert [c.stop_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].stop_reason == stop
    chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    content = chat.choices[0].message.content
    assert chat.choices[0].stop_reason is None
    cut = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12,
                                         temperature=0, stop=[content[3:6]],
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].stop_reason == content[3:6]
    last = [c for c in client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=12, temperature=0, stop=[content[3:6]],
        stream=True, extra_body={"ignore_eos": True}) if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.stop_reason == content[3:6]


def test_a_stop_token_id_is_named_and_its_text_left_out(server, client):
    """stop_token_ids: stop_reason is the id; its text is not in the output unless
    include_stop_str_in_output (vLLM)."""
    ids = requests.post(server[0] + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    free = requests.post(server[0] + "/v1/completions", json={
        "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "logprobs": 0}).json()["choices"][0]
    tokens = free["logprobs"]["tokens"]
    out = requests.post(server[0] + "/tokenize", json={
        "prompt": free["text"], "add_special_tokens": False}).json()["tokens"]
    k = next(i for i in range(2, len(out)) if out[i] not in out[:i])   # its first occurrence
    for include in (False, True):
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [out[k]],
                                                  "include_stop_str_in_output": include})
        c = r.choices[0]
        assert c.stop_reason == out[k] and c.finish_reason == "stop"
        assert r.usage.completion_tokens == k + 1
        assert c.text == "".join(tokens[:k + 1 if include else k])


def test_completions_max_tokens_null_is_the_default(server):
    r = requests.post(server[0] + "/v1/completions", json={
        "prompt": "Hi", "max_tokens": None, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_completion_logprobs_hold_the_chosen_token_and_go_to_20(client):
    """Legacy completions' top_logprobs (OpenAI's and vLLM's): the chosen token and the k most
    likely at each position, so a sampled token is always there; logprobs up to 20."""
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=16,
                                  temperature=2.0, seed=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert all(tok in top and top[tok] == chosen and 1 <= len(top) <= 2
               for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)       # sampled outside the top 1
    zero = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4,
                                     temperature=0, logprobs=0).choices[0].logprobs
    assert [list(t) for t in zero.top_logprobs] == [[t] for t in zero.tokens]
    wide = client.completions.create(model="tiny", prompt="Hello there", max_tokens=2,
                                     temperature=0, logprobs=20).choices[0].logprobs
    assert all(len(t) >= 19 for t in wide.top_logprobs)        # texts of ids may coincide
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=21)


def test_detokenize_keeps_special_tokens(server, tiny_model_dir):
    """vLLM's /detokenize decodes every id, special ones included (as the tokenizer library
    does by default)."""
    from tokenizers import Tokenizer as HFTokenizer
    ref = HFTokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    ids = requests.post(server[0] + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    ids = ids + [2]
    got = requests.post(server[0] + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert got == ref.decode(ids, skip_special_tokens=False)
    assert got != ref.decode(ids, skip_special_tokens=True)


def test_text_parts_of_a_message_are_joined_by_newlines(server):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    joined = requests.post(server[0] + "/tokenize", json={
        "messages": [{"role": "user", "content": "Hello\nthere"}]}).json()
    got = requests.post(server[0] + "/tokenize", json={
        "messages": [{"role": "user", "content": parts}]}).json()
    assert got["tokens"] == joined["tokens"]


def test_x_request_id_names_the_response(server):
    """vLLM takes a client's X-Request-Id as the response's id; two requests sent with the
    same one at once are both served."""
    def post(path, body):
        return requests.post(server[0] + path, headers={"X-Request-Id": "trace-42"},
                             json={**body, "max_tokens": 4})
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: post("/v1/completions", {"prompt": "Hi"}), range(2)))
    assert [r.status_code for r in got] == [200, 200]
    assert {r.json()["id"] for r in got} == {"cmpl-trace-42"}
    assert post("/v1/chat/completions", {"messages": MSG}).json()["id"] == "chatcmpl-trace-42"
    r = requests.post(server[0] + "/v1/completions", headers={"X-Request-Id": "x" * 300},
                      json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    # vLLM's request_id field names it when no header does; the header wins
    def ids(path, body, **headers):
        return requests.post(server[0] + path, headers=headers, json={
            **body, "max_tokens": 2, "request_id": "mine-7"}).json()["id"]
    assert ids("/v1/completions", {"prompt": "Hi"}) == "cmpl-mine-7"
    assert ids("/v1/chat/completions", {"messages": MSG}) == "chatcmpl-mine-7"
    assert ids("/v1/completions", {"prompt": "Hi"}, **{"X-Request-Id": "h"}) == "cmpl-h"
    r = requests.post(server[0] + "/v1/completions",
                      json={"prompt": "Hi", "max_tokens": 2, "request_id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_any_role_reaches_the_chat_template(server, client):
    """Roles beyond OpenAI's (Llama 3's "ipython" tool results) go to the template, as vLLM
    hands them over; the template decides."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "Hi"}, {"role": "ipython", "content": "42"}]
    got = requests.post(server[0] + "/tokenize", json={
        "messages": msgs, "chat_template": template, "add_generation_prompt": False}).json()
    want = requests.post(server[0] + "/tokenize", json={
        "prompt": "<user>Hi<ipython>42", "add_special_tokens": False}).json()
    assert got["tokens"] == want["tokens"]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                       extra_body={"chat_template": template})
    assert r.usage.prompt_tokens == want["count"]
    r = requests.post(server[0] + "/v1/chat/completions", json={
        "messages": [{"role": "", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 400 and "role" in r.json()["error"]["param"]


def test_continue_final_message_and_echo_carry_on_an_assistant_reply(server, client):
    """vLLM's assistant prefill: with continue_final_message the prompt ends inside the last
    message (no end-of-turn after it), and echo puts that message's text before the reply."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    msgs = [{"role": "user", "content": "Name a colour"},
            {"role": "assistant", "content": "My favourite is"}]
    opts = {"chat_template": template, "add_generation_prompt": False}
    want = requests.post(server[0] + "/tokenize", json={
        "prompt": "<user>Name a colour</s><assistant>My favourite is",
        "add_special_tokens": False}).json()
    got = requests.post(server[0] + "/tokenize", json={
        "messages": msgs, "continue_final_message": True, **opts}).json()
    assert got["tokens"] == want["tokens"]
    free = client.completions.create(model="tiny", prompt=want["tokens"], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    body = {"continue_final_message": True, "ignore_eos": True, **opts}
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                       temperature=0, extra_body=body)
    assert r.usage.prompt_tokens == want["count"]
    assert r.choices[0].message.content == free.choices[0].text
    echo = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                          temperature=0, extra_body={**body, "echo": True})
    assert echo.choices[0].message.content == "My favourite is" + free.choices[0].text
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                            temperature=0, stream=True,
                                            extra_body={**body, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        "My favourite is" + free.choices[0].text
    # Both at once cannot be: the generation prompt would close the message.
    r = requests.post(server[0] + "/v1/chat/completions", json={
        "messages": msgs, "continue_final_message": True, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_a_client_leaving_a_non_streaming_request_is_not_an_error(server):
    """A client that gives up on a long non-streaming request (one prompt, several, chat)
    aborts it quietly: no 'unexpected error' and no traceback in the server's log."""
    url, logs = server
    before = len(logs)
    long = {"max_tokens": 1000, "ignore_eos": True, "n": 16}        # seconds of work
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/completions", {"prompt": ["Hello", "there"]}),
                       ("/v1/chat/completions", {"messages": MSG})):
        with pytest.raises(requests.Timeout):
            requests.post(url + path, json={**body, **long}, timeout=0.3)
    deadline = time.monotonic() + 30
    while requests.get(url + "/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests.get(url + "/load").json() == {"server_load": 0}     # all aborted
    time.sleep(0.5)
    new = list(logs)[before:]
    assert not [line for line in new if "unexpected error" in line or "Traceback" in line], new


def test_a_grammar_the_parser_cannot_follow_is_an_error_not_a_stop(server, client):
    """llguidance gives up on a grammar too large for its parser (thousands of choices)
    only while generating. The request then fails with a 400 naming why, instead of ending
    as a "stop" with text outside its grammar; the log says so in one short line."""
    url, logs = server
    before = len(logs)
    body = {"prompt": "Pick:", "max_tokens": 10, "temperature": 0,
            "guided_choice": [f"opt{i}" for i in range(3000)]}
    r = requests.post(url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice", r.text
    assert r.json()["error"]["message"].startswith("guided_choice: the grammar could "
                                                   "not be followed")
    events = [json.loads(line[len(b"data: "):]) for line in requests.post(
        url + "/v1/completions", json={**body, "stream": True}).iter_lines()
        if line.startswith(b"data: {")]
    assert events[-1]["error"]["code"] == 400
    assert events[-1]["error"]["param"] == "guided_choice"
    assert all(c["choices"][0]["text"] in ("", "o", "op", "opt") for c in events[:-1])
    time.sleep(0.5)
    said = [line for line in list(logs)[before:] if "could not be followed" in line]
    assert said and all(len(line) < 600 for line in said)
    assert client.completions.create(model="tiny", prompt="Pick:", max_tokens=4,
                                     extra_body={"guided_choice": ["yes", "no"]}
                                     ).choices[0].text in ("yes", "no")
    # A grammar that ends is no error: with ignore_eos the output stays the choice (EOS,
    # the only token then allowed, is generated up to max_tokens and not shown).
    done = client.completions.create(model="tiny", prompt="Pick:", max_tokens=8,
                                     extra_body={"guided_choice": ["yes", "no"],
                                                 "ignore_eos": True}).choices[0]
    assert done.text in ("yes", "no") and done.finish_reason == "length"


@pytest.mark.parametrize("path, body, field", [
    # 20 prompts x n 64 = 1280 sequences, beyond the waiting-queue bound (1024)
    ("/v1/completions", {"prompt": ["Hi"] * 20, "n": 64}, "n"),
    ("/tokenize", {"prompt": "Hi", "messages": MSG}, "messages"),
    # every allowed token ends the output, yet min_tokens asks for 3 first
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [2], "min_tokens": 3},
     "allowed_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "bad_words": ["\ud800"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["a\udfff"]}, "stop"),
    # a 60-byte regex beyond llguidance's lexer limits: named, and quick to fail
    ("/v1/completions", {"prompt": "x", "guided_regex": "a{1000}{1000}"}, "guided_regex"),
    # 64 choices x 1000 tokens x 21 log-probabilities: a 140 MB answer
    ("/v1/chat/completions", {"messages": MSG, "n": 64, "max_tokens": 1000, "logprobs": True,
                              "top_logprobs": 20}, "logprobs"),
])
def test_requests_the_server_cannot_do_are_a_400_naming_the_field(server, path, body, field):
    r = requests.post(server[0] + path, json={"max_tokens": 5, **body}
                      if path != "/tokenize" else body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("path, body, field, wanted", [
    ("/v1/completions", {"prompt": "Hi", "stop": 5}, "stop",
     ["a valid string", "a valid list"]),
    ("/v1/completions", {"prompt": [[1, "a"]]}, "prompt",
     ["a valid string", "at 0.1: Input should be a valid integer"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content", ["a valid string", "a valid list"]),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": 5}, "tool_choice",
     ["'none', 'auto' or 'required'", "a valid dictionary"]),
])
def test_a_field_of_several_types_is_named_with_what_each_wanted(server, path, body, field,
                                                                  wanted):
    """A value of none of a field's types: the error names the request's field (not
    pydantic's stop.str) and says every type it could have been."""
    r = requests.post(server[0] + path, json={"model": "tiny", "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field, r.text
    assert error["message"].startswith(field + ": ")
    assert all(w in error["message"] for w in wanted), error["message"]


def test_a_large_answer_is_built_off_the_event_loop(server):
    """A non-streamed answer with many log-probabilities (here 8 x 600 x 21: 100k entries,
    ~7 MB) takes seconds to build; meanwhile other clients are answered."""
    body = {"messages": MSG, "n": 8, "max_tokens": 600, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 20}
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(requests.post, server[0] + "/v1/chat/completions", json=body)
        waits = []
        while not big.done():
            t0 = time.monotonic()
            assert requests.get(server[0] + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
    r = big.result()
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert sum(len(c["logprobs"]["content"]) for c in r.json()["choices"]) == 8 * 600
    assert max(waits) < 1.0, max(waits)


def test_bad_words_banning_every_allowed_token_are_a_400(server):
    """allowed_token_ids that bad_words leave empty would be sampled from a row of -inf (a
    token outside them): refused, naming allowed_token_ids."""
    url = server[0]
    word = next(w for w in ("the", "and", "a", "is") if len(requests.post(
        url + "/tokenize", json={"prompt": w, "add_special_tokens": False}).json()["tokens"]) == 1)
    tid = requests.post(url + "/tokenize", json={"prompt": word, "add_special_tokens": False}
                        ).json()["tokens"][0]
    body = {"prompt": "Hi", "max_tokens": 3, "allowed_token_ids": [tid]}
    assert requests.post(url + "/v1/completions", json=body).status_code == 200
    r = requests.post(url + "/v1/completions", json={**body, "bad_words": [word]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_vllms_development_routes_are_off_without_dev_mode(server):
    """vLLM serves /reset_prefix_cache, /server_info, /sleep ... only with
    VLLM_SERVER_DEV_MODE=1 (tests/test_kv_events.py uses them); without it they are a 404."""
    for method, path in (("post", "/reset_prefix_cache"), ("get", "/server_info"),
                         ("get", "/is_sleeping"), ("post", "/sleep"),
                         ("post", "/collective_rpc")):
        assert getattr(requests, method)(server[0] + path).status_code == 404, path
