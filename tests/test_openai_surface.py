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


# ---- logit_bias, allowed_token_ids, bad_words --------------------------------------------

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
    assert usage == [tok(MSG[0]["content"]), tok(MSG[0]["content"] + "[get_weather][get_time]")]


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
    "skip_special_tokens": False, "include_stop_str_in_output": True,
    "spaces_between_special_tokens": False, "allowed_token_ids": list(range(3, 900)),
    "bad_words": ["zzz"], "guided_regex": "[a-z]{1,4}", "safety_identifier": "s1",
    "stream_options": {"include_usage": True}, "guided_decoding_backend": "llguidance",
}
_COMMON_REFUSED = {
    "use_beam_search": True, "length_penalty": 2.0, "truncate_prompt_tokens": 5,
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "guided_whitespace_pattern": " ", "structural_tag": "{}", "kv_transfer_params": {},
    "cache_salt": "s", "vllm_xargs": {"a": 1}, "request_id": "r1", "prompt_logprobs": 1,
    "mm_processor_kwargs": {}, "store": True, "metadata": {"a": "b"}, "service_tier": "flex",
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
    "guided_decoding_backend": "xgrammar",
}
COMPLETIONS = {
    "honoured": {**_COMMON_HONOURED, "prompt": "Hello", "echo": True, "logprobs": 2,
                 "best_of": 1, "suffix": None, "response_format": {"type": "json_object"},
                 "guided_json": {"type": "string", "maxLength": 3},
                 "guided_choice": ["a", "b"], "guided_grammar": 'start: "x"',
                 "structured_outputs": {"regex": "a+"}},
    "refused": {**_COMMON_REFUSED, "best_of": 2, "suffix": "end"},
}
CHAT = {
    "honoured": {**_COMMON_HONOURED, "messages": MSG, "logprobs": True, "top_logprobs": 2,
                 "max_completion_tokens": 4, "response_format": {"type": "json_object"},
                 "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
                 "add_generation_prompt": True, "chat_template": "{{ messages[0].content }}",
                 "chat_template_kwargs": {"x": 1}, "add_special_tokens": True,
                 "modalities": ["text"], "structured_outputs": {"choice": ["a", "b"]}},
    "refused": {**_COMMON_REFUSED, "audio": {"voice": "alloy", "format": "wav"},
                "modalities": ["text", "audio"], "function_call": "auto",
                "functions": [WEATHER["function"]], "reasoning_effort": "low",
                "web_search_options": {}, "verbosity": "low", "documents": [{"a": "b"}],
                "continue_final_message": True, "echo": True},
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
        r = requests.post(url, json=body)
        assert r.status_code == 200, (field, r.text)
    for field, value in spec["refused"].items():
        r = requests.post(url, json={"model": "tiny", "max_tokens": 4, **base, field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_unknown_fields_are_accepted_and_named_once_in_the_log(server, client):
    url, logs = server
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                       extra_body={"frobnicate": 1, "zorp": "a"},
                                       stream=True, stream_options={"include_usage": True,
                                                                    "blorp": 2})
    r = list(r)[-2]          # the last choice chunk (before the usage chunk)
    assert r.choices[0].finish_reason in ("stop", "length")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("frobnicate" in x for x in list(logs)):
        time.sleep(0.1)
    warned = [line for line in list(logs) if "frobnicate" in line]
    assert len(warned) == 1 and "zorp" in warned[0] and "ignored" in warned[0]
    assert "stream_options.blorp" in warned[0]
