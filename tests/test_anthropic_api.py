"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on the real server with
the real `anthropic` client, as vLLM 0.32 serves it: the chat route's answer for the same
conversation (whose tokens are transformers' greedy ones), stop_reason and usage, vLLM's
event sequence when streamed, tool_use blocks (a forced call, its tool_result sent back),
thinking blocks, and every block or field we cannot honour refused by name in Anthropic's
error shape."""
from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import openai
import pytest
import requests

from conftest import metric
from llm_serving.entrypoints.anthropic_routes import _events, _message
from test_http_server import served, wait_until

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city", "days"],
                            "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}}}}
SYSTEM = "You answer briefly."
# Anthropic's conversation, and the same as chat messages
MESSAGES = [{"role": "user", "content": "Give three tips for staying healthy."},
            {"role": "assistant", "content": "One: sleep."},
            {"role": "user", "content": [{"type": "text", "text": "More"},
                                         {"type": "text", "text": "please"}]}]
CHAT = [{"role": "system", "content": SYSTEM}, MESSAGES[0], MESSAGES[1],
        {"role": "user", "content": "More\nplease"}]
N = 16
# the SDK has no temperature argument: sent as an extra field
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    yield from served(tmp_path_factory.mktemp("anthropic"), tiny_model_dir,
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def chat_client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    """transformers' prompt ids of CHAT and its greedy continuation (N tokens or to EOS)."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                              dtype=torch.float32)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
    gen = out[0, len(ids):].tolist()
    if tok.eos_token_id in gen:
        gen = gen[:gen.index(tok.eos_token_id) + 1]
    return ids, gen, tok


def _sse(text: str) -> list[tuple[str, dict]]:
    """(event, data) of each server-sent event."""
    out = []
    for block in text.strip().split("\n\n"):
        event, data = block.split("\n")
        out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_message_is_the_chat_answer_and_transformers_greedy(client, chat_client, server,
                                                            hf_greedy):
    prompt, gen, tok = hf_greedy
    eos = tok.eos_token_id
    chat = chat_client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=N, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    chat_ids = [int(t.token.split(":")[1]) for t in chat.choices[0].logprobs.content]
    assert [t for t in chat_ids if t != eos] == [t for t in gen if t != eos]
    msg = client.messages.create(model="tiny", max_tokens=N, system=SYSTEM, messages=MESSAGES,
                                 extra_body=GREEDY)
    text = tok.decode(gen, skip_special_tokens=True)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content == text
    assert msg.stop_reason == ("end_turn" if gen[-1] == eos else "max_tokens")
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens == chat.usage.prompt_tokens == len(prompt)
    assert msg.usage.output_tokens == chat.usage.completion_tokens == len(gen)
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == len(prompt)

    # Streamed: the same text in vLLM's event sequence, and the SDK's final message.
    kw = dict(model="tiny", max_tokens=N, system=SYSTEM, extra_body=GREEDY, messages=MESSAGES)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        msg.stop_reason, len(prompt), len(gen))
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True}
    r = requests.post(server + "/v1/messages", json=body, timeout=60)
    events = _sse(r.text)
    kinds = [e for e, _ in events]
    assert kinds == ["message_start", "content_block_start",
                     *["content_block_delta"] * (len(kinds) - 5), "content_block_stop",
                     "message_delta", "message_stop"]
    assert all(data["type"] == event for event, data in events)
    assert events[0][1]["message"]["usage"] == {"input_tokens": len(prompt),
                                                "output_tokens": 0}
    assert events[1][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert events[-2][1] == {"type": "message_delta", "delta": {
        "stop_reason": msg.stop_reason, "stop_sequence": None},
        "usage": {"input_tokens": len(prompt), "output_tokens": len(gen)}}


def test_stop_sequence_ends_the_message(client, hf_greedy):
    _, gen, tok = hf_greedy
    text = tok.decode(gen, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    kw = dict(model="tiny", max_tokens=N, system=SYSTEM, extra_body=GREEDY, messages=MESSAGES,
              stop_sequences=["\x00never", stop])
    msg = client.messages.create(**kw)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == text[:text.index(stop)]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == msg.content[0].text


def test_forced_tool_use_and_its_result_sent_back(client, chat_client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="tiny", max_tokens=80, extra_body=GREEDY, messages=ask, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"})
    msg = client.messages.create(**kw)
    (call,) = msg.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert msg.stop_reason == "tool_use"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", call.input)]
    assert final.stop_reason == "tool_use"
    # any: a call is required; disable_parallel_tool_use: one call
    one = client.messages.create(**{**kw, "tool_choice": {
        "type": "any", "disable_parallel_tool_use": True}})
    assert [b.type for b in one.content] == ["tool_use"] and one.stop_reason == "tool_use"

    # The call and its result sent back: the chat route's answer to the same turn.
    turn = ask + [{"role": "assistant", "content": [
                      {"type": "text", "text": "Let me look."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                       "input": {"city": "Paris", "days": 1}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1",
                       "content": [{"type": "text", "text": "Sunny, 21C"}]},
                      {"type": "text", "text": "And tomorrow?"}]}]
    again = client.messages.create(model="tiny", max_tokens=8, messages=turn, tools=[WEATHER],
                                   extra_body=GREEDY)
    chat = chat_client.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0, tools=[{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}],
        messages=ask + [{"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21C"},
            {"role": "user", "content": "And tomorrow?"}])
    assert again.content[0].text == chat.choices[0].message.content
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    without = client.messages.count_tokens(model="tiny", messages=turn[:2] + [
        {"role": "user", "content": "And tomorrow?"}], tools=[WEATHER])
    assert without.input_tokens < client.messages.count_tokens(
        model="tiny", messages=turn, tools=[WEATHER]).input_tokens == chat.usage.prompt_tokens


def test_reasoning_is_a_thinking_block(tmp_path_factory, qwen3_model_dir):
    """--reasoning-parser qwen3 with a template that opens <think> (unless enable_thinking is
    false: then it closes it, as Qwen3's): the chat route's reasoning is a thinking block,
    streamed as thinking deltas closed by a signature; thinking disabled is the template's
    enable_thinking false, and the text a text block."""
    template = tmp_path_factory.mktemp("think") / "template.jinja"
    # ChatML (SYSTEM_FIRST's), its generation prompt opening <think>
    template.write_text(SYSTEM_FIRST.replace("assistant\\n'", (
        "assistant\\n<think>\\n' + ('\\n</think>\\n\\n' if enable_thinking is defined "
        "and not enable_thinking else '')")))
    other = served(tmp_path_factory.mktemp("think-srv"), qwen3_model_dir,
                   "--chat-template", str(template), "--reasoning-parser", "qwen3")
    url = next(other)
    try:
        kw = dict(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "Why?"}])
        chat = openai.OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            **kw, temperature=0)
        thought = chat.choices[0].message.model_extra["reasoning"]
        assert thought and chat.choices[0].message.content is None
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        msg = client.messages.create(**kw, extra_body=GREEDY)
        (block,) = msg.content
        assert block.type == "thinking" and block.thinking == thought and block.signature
        with client.messages.stream(**kw, extra_body=GREEDY) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert {d.type for d in deltas} == {"thinking_delta", "signature_delta"}
        assert deltas[-1].type == "signature_delta"
        assert "".join(d.thinking for d in deltas[:-1]) == thought
        assert final.content[0].thinking == thought and final.stop_reason == "max_tokens"
        off = client.messages.create(**kw, thinking={"type": "disabled"}, extra_body=GREEDY)
        plain = openai.OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            **kw, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert [b.type for b in off.content] == ["text"]
        assert off.content[0].text == plain.choices[0].message.content
        assert off.usage.input_tokens == plain.usage.prompt_tokens > msg.usage.input_tokens
        assert client.messages.count_tokens(
            model="tiny", messages=kw["messages"], thinking={"type": "disabled"}
        ).input_tokens == plain.usage.prompt_tokens
    finally:
        next(other, None)


def test_api_key_as_the_sdk_sends_it(tmp_path_factory, tiny_model_dir):
    """--api-key: an Anthropic client's api_key (x-api-key) or auth_token (Bearer, vLLM's)
    open /v1/messages; a wrong one is the SDK's AuthenticationError. x-api-key opens nothing
    else."""
    other = served(tmp_path_factory.mktemp("key"), tiny_model_dir, "--api-key", "sesame")
    url = next(other)
    try:
        for auth in ({"api_key": "sesame"}, {"auth_token": "sesame"}):
            client = anthropic.Anthropic(base_url=url, max_retries=0, **auth)
            assert client.messages.create(**ASK).type == "message"
            assert client.messages.count_tokens(model="tiny", messages=ASK["messages"]) \
                .input_tokens > 0
        wrong = anthropic.Anthropic(base_url=url, api_key="open", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(**ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = requests.post(url + "/v1/chat/completions", headers={"x-api-key": "sesame"},
                          json={"messages": ASK["messages"], "max_tokens": 1}, timeout=60)
        assert r.status_code == 401
    finally:
        next(other, None)


ASK = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


def test_a_stream_the_client_leaves_is_aborted(server):
    aborted = 'request_success_total{finished_reason="abort"}'
    before = metric(server, aborted)
    r = requests.post(server + "/v1/messages", json={**ASK, **GREEDY, "max_tokens": 1000,
                                                     "stream": True},
                      stream=True, timeout=60)
    lines = r.iter_lines()
    for _ in range(8):      # message_start, a block started, deltas
        next(lines)
    r.close()
    wait_until(lambda: metric(server, aborted) == before + 1,
               message="the request ran on after its client left")
    assert requests.get(server + "/load", timeout=10).json()["server_load"] == 0


# Qwen's rule: a system message only first
SYSTEM_FIRST = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m['role'] == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
INLINE = [{"role": "user", "content": "Hi"},
          {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
          {"role": "user", "content": "Go on"}]


def test_inline_system_messages_stand_or_join_the_first_as_the_template_takes(
        server, chat_client, tmp_path_factory, tiny_model_dir):
    """Claude Code's reminders: system messages among the others stay where they are when
    the template takes them there, and join the leading one (vLLM's probe) for a template
    that takes a system message first only."""
    def messages(url):
        return requests.post(url + "/v1/messages", json={
            "model": "tiny", "max_tokens": 6, "system": SYSTEM, "messages": INLINE, **GREEDY},
            timeout=60).json()

    def chat(url, conversation):
        return requests.post(url + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 6, "messages": conversation, **GREEDY},
            timeout=60).json()
    in_place = [{"role": "system", "content": SYSTEM}, INLINE[0],
                {"role": "system", "content": "Reminder."}, INLINE[2]]
    msg, answer = messages(server), chat(server, in_place)
    assert msg["content"][0]["text"] == answer["choices"][0]["message"]["content"]
    assert msg["usage"]["input_tokens"] == answer["usage"]["prompt_tokens"]
    template = tmp_path_factory.mktemp("system-first") / "template.jinja"
    template.write_text(SYSTEM_FIRST)
    other = served(tmp_path_factory.mktemp("system-first-srv"), tiny_model_dir,
                   "--chat-template", str(template))
    url = next(other)
    try:
        assert chat(url, in_place)["error"]["message"].startswith("messages: the chat template")
        merged = [{"role": "system", "content": SYSTEM + "Reminder."}, INLINE[0], INLINE[2]]
        msg, answer = messages(url), chat(url, merged)
        assert msg["content"][0]["text"] == answer["choices"][0]["message"]["content"]
        assert msg["usage"]["input_tokens"] == answer["usage"]["prompt_tokens"]
        counted = requests.post(url + "/v1/messages/count_tokens", json={
            "model": "tiny", "system": SYSTEM, "messages": INLINE}, timeout=60).json()
        assert counted["input_tokens"] == answer["usage"]["prompt_tokens"]
    finally:
        next(other, None)


@pytest.mark.parametrize("body, named", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "messages[0].content[0]: image"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "messages[0].content[0]: document"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0]"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1000}}, "thinking.budget_tokens"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search",
                 "input_schema": {}}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"container": "c1"}, "container"),
    ({"cache_salt": "a/b"}, "cache_salt"),     # vLLM's checks (a good one is taken)
    ({"temperature": 3}, "temperature"),
    ({"stop_sequences": "x"}, "stop_sequences"),
])
def test_what_we_cannot_serve_is_refused_by_name(server, body, named):
    r = requests.post(server + "/v1/messages", json={**ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(named), err


def test_errors_have_anthropics_shape_for_the_sdk(client):
    with pytest.raises(anthropic.NotFoundError, match="nope"):
        client.messages.create(**{**ASK, "model": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])


def _chunk(delta=None, finish=None, stop=None, usage=None, choices=True) -> bytes:
    body = {"id": "chatcmpl-1", "model": "m", "usage": usage,
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                         "stop_reason": stop}] if choices else []}
    return f"data: {json.dumps(body)}\n\n".encode()


async def _chunks(items):
    for item in items:
        yield item


def test_thinking_text_and_calls_stream_as_blocks_in_vllms_order():
    """A chat stream of reasoning, text, a call with text after it (the hermes parser's
    order): a thinking block closed by its signature, a text block, the tool_use block, then
    the text held during the call in a block of its own, and stop_reason tool_use."""
    usage = {"prompt_tokens": 7, "completion_tokens": 5}
    chunks = [_chunk({"role": "assistant", "content": ""}, usage={**usage,
                                                                  "completion_tokens": 0}),
              _chunk({"reasoning": "plan "}), _chunk({"reasoning": "it"}),
              _chunk({"content": "Sure."}),
              _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
              _chunk({"content": " done"}, finish="tool_calls"),
              _chunk(usage=usage, choices=False), b": keep-alive\n\n", b"data: [DONE]\n\n"]

    async def run():
        return [e async for e in _events(_chunks(chunks))]
    out = asyncio.run(run())
    assert b": keep-alive\n\n" in out
    events = _sse(b"".join(e for e in out if not e.startswith(b":")).decode())
    assert [(e, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type"))
            for e, d in events] == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "text"), ("content_block_delta", 3, "text_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert events[7][1]["delta"]["text"] == "Sure." and events[13][1]["delta"]["text"] == " done"
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"input_tokens": 7, "output_tokens": 5}


def test_whole_answer_blocks_and_cached_tokens():
    body = {"id": "chatcmpl-1", "model": "m", "usage": {
        "prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {
            "cached_tokens": 6}},
        "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None,
                     "message": {"role": "assistant", "content": "Sure.",
                                 "reasoning": "plan", "tool_calls": [
                                     {"id": "call_1", "type": "function", "function": {
                                         "name": "f", "arguments": '{"a": 1}'}}]}}]}
    msg = _message(body)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][0]["thinking"] == "plan" and msg["content"][0]["signature"]
    assert msg["content"][2] == {"type": "tool_use", "id": "call_1", "name": "f",
                                 "input": {"a": 1}}
    assert msg["stop_reason"] == "tool_use" and "stop_sequence" not in msg
    # as vLLM: input_tokens leave out the prefix-cached ones
    assert msg["usage"] == {"input_tokens": 4, "output_tokens": 4,
                            "cache_read_input_tokens": 6}
