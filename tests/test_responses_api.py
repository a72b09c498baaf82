"""OpenAI's Responses API (/v1/responses) on the real server with the real `openai` client, as
vLLM 0.32 serves it: the same text as the chat route for the same conversation, vLLM's event
sequence when streamed, status "incomplete" at max_output_tokens, usage, nothing stored, and
function tools (a call forced by tool_choice, read by the hermes parser under "auto",
streamed as vLLM streams it, and its output sent back for the next turn), the reasoning
item of --reasoning-parser qwen3, and every field we cannot honour refused by name."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
import requests

from conftest import metric
from llm_serving.entrypoints.responses_items import OutputItems
from test_http_server import free_port, served, start_server, stop_server

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
# vLLM's order of a streamed text answer.
# Responses' function tools: flat, not nested under "function" as chat's.
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city", "days"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}}}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
ASK = "What is the weather in Paris?"
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    yield from served(tmp_path_factory.mktemp("resp"), tiny_model_dir,
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def _chat(client, messages, n_tokens, **kw):
    return client.chat.completions.create(model="tiny", messages=messages,
                                          max_tokens=n_tokens, **GREEDY, **kw)


def test_text_equals_the_chat_routes(client):
    chat = _chat(client, MESSAGES, 12)
    r = client.responses.create(model="tiny", input=MESSAGES[0]["content"],
                                max_output_tokens=12, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # The parameters echoed as they were applied.
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.model == "tiny"


def test_input_messages_parts_and_instructions(client):
    system = {"role": "system", "content": "Answer in one word."}
    chat = _chat(client, [system, *MESSAGES], 10)
    parts = [{"role": "user", "type": "message",
              "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}]}]
    r = client.responses.create(model="tiny", input=parts, instructions=system["content"],
                                max_output_tokens=10, metadata={"run": "7"}, user="u1",
                                **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens     # the same prompt
    assert r.instructions == system["content"]
    assert r.metadata == {"run": "7"} and r.user == "u1"
    # Without the instructions the prompt is shorter: they were rendered, not dropped.
    bare = client.responses.create(model="tiny", input=parts, max_output_tokens=1, **GREEDY)
    assert bare.usage.input_tokens < r.usage.input_tokens


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=5,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_stream_events_in_vllms_order(client):
    whole = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    events = list(client.responses.create(model="tiny", input="Hello there",
                                          max_output_tokens=8, stream=True,
                                          extra_body={"ignore_eos": True}, **GREEDY))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == []
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage.output_tokens == 8 and final.id == created.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_stream_helper_parses(client):
    with client.responses.stream(model="tiny", input="Hello there", max_output_tokens=6,
                                 extra_body={"ignore_eos": True}, **GREEDY) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and text


def test_structured_output_from_text_format(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 8}}}
    r = client.responses.create(model="tiny", input="Which city?", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "c",
                                                 "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_logprobs_when_included(client):
    kw = dict(model="tiny", input="Hello there", max_output_tokens=6, top_logprobs=2,
              include=["message.output_text.logprobs"], extra_body={"ignore_eos": True},
              **GREEDY)
    r = client.responses.create(**kw)
    scored = r.output[0].content[0].logprobs
    assert len(scored) == 6 and r.top_logprobs == 2
    assert "".join(t.token for t in scored) == r.output_text
    for t in scored:
        assert len(t.top_logprobs) == 2 and bytes(t.bytes).decode() == t.token
        assert t.logprob == max(x.logprob for x in t.top_logprobs)    # greedy: the best one
    events = list(client.responses.create(stream=True, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in scored]
    assert events[-1].response.output[0].content[0].logprobs == scored
    plain = client.responses.create(model="tiny", input="Hello there", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs is None and plain.top_logprobs is None


@pytest.mark.parametrize("field, value", [
    ("background", True),
    ("include", ["reasoning.encrypted_content"]),
    ("truncation", "auto"),
    ("max_tool_calls", 2),
])
def test_unsupported_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_nothing_is_stored(server, client):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True)
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{r.id}' not found."
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_bad_input_names_the_field(server):
    for body in ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]},
                 {"input": [{"type": "web_search_call", "id": "w"}]},
                 {"input": [{"role": "user", "content": [{"type": "input_image",
                                                          "image_url": "http://x/y.png"}]}]},
                 {"input": []}):
        r = requests.post(server + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    # Above the model length is a 400, as vLLM (within it, bounded by what the prompt leaves).
    r = requests.post(server + "/v1/responses", json={"input": "hi", "max_output_tokens": 10**6},
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    with client.responses.create(model="tiny", input="hi", max_output_tokens=1024,
                                 stream=True) as stream:
        created = next(iter(stream)).response
    prompt = requests.post(server + "/tokenize", json={"messages": [
        {"role": "user", "content": "hi"}]}, timeout=60).json()["count"]
    assert created.max_output_tokens == 1024 - prompt


def test_reasoning_items_sent_back_are_the_assistant_turns_thinking():
    """An answer's output sent back as input (reasoning item, then its message; or a
    reasoning item then a call) is one assistant message with its thinking, as vLLM merges
    them; the template gets it as reasoning and reasoning_content."""
    from llm_serving.entrypoints.responses_protocol import ResponsesRequest
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "add them"}]}
    answer = {"type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "4", "annotations": []}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    ask = {"role": "user", "content": "2+2?"}
    msgs, _ = ResponsesRequest(input=[ask, thought, answer, {**ask, "content": "3+3?"}]
                               ).messages()
    assert [m.for_template() for m in msgs] == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "add them",
         "reasoning_content": "add them"},
        {"role": "user", "content": "3+3?"}]
    msgs, _ = ResponsesRequest(input=[ask, {**thought, "content": None, "summary": [
        {"type": "summary_text", "text": "call f"}]}, call]).messages()
    (turn,) = [m.for_template() for m in msgs[1:]]
    assert turn["reasoning"] == "call f" and turn["tool_calls"][0]["id"] == "c1"


def test_client_gone_aborts_the_request(server, client):
    aborted = metric(server, 'request_success_total{finished_reason="abort"}')
    with client.responses.create(model="tiny", input="Hello", max_output_tokens=900,
                                 stream=True, extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    deadline = time.monotonic() + 60
    while metric(server, 'request_success_total{finished_reason="abort"}') == aborted:
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.2)
    assert metric(server, "num_requests_running") == 0


def _as_chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_named_tool_choice_makes_a_function_call(client):
    r = client.responses.create(model="tiny", input=ASK, tools=[WEATHER, TIME],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=100, temperature=1,
                                extra_body={"seed": 3})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.status == "completed" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] == \
        ["get_weather", "get_time"]
    # Streamed, as vLLM: the call added with its name, its arguments in pieces, then done.
    with client.responses.stream(model="tiny", input=ASK, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=100, temperature=1,
                                 extra_body={"seed": 4}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_weather"
    assert added.arguments == "" and added.status == "in_progress"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and done.arguments == "".join(deltas) and done.name == "get_weather"
    (call,) = final.output
    assert (call.id, call.call_id, call.arguments) == (added.id, added.call_id, done.arguments)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_required_tool_choice_calls_one_of_the_tools(client):
    for seed in range(2):
        kw = dict(model="tiny", input=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=200, temperature=1,
                  extra_body={"seed": seed})
        (call,) = client.responses.create(**kw).output
        assert call.type == "function_call"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        events = list(client.responses.create(stream=True, **kw))
        (streamed,) = events[-1].response.output
        assert (streamed.name, json.loads(streamed.arguments)) == \
            (call.name, json.loads(call.arguments))
        assert [e.item.name for e in events if e.type == "response.output_item.added"] == \
            [call.name]


def test_function_call_output_round_trip(client):
    """The call and its output sent back render as the chat route renders an assistant
    tool call and a tool message: the same prompt."""
    r = client.responses.create(model="tiny", input=ASK, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=100, temperature=1,
                                extra_body={"seed": 3})
    (call,) = r.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}
    turn = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    again = client.responses.create(model="tiny", input=turn, tools=[WEATHER],
                                    tool_choice="none", max_output_tokens=4, **GREEDY)
    assert again.output[0].type == "message"
    chat = _chat(client, [{"role": "user", "content": ASK},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function", "function": {
                                  "name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id,
                           "content": "Sunny, 21C"}], 4,
                 tools=[_as_chat_tool(WEATHER)], tool_choice="none")
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.output_text == chat.choices[0].message.content
    # Without the output the prompt is shorter: the tool's answer was rendered.
    fewer = client.responses.create(model="tiny", input=turn[:2], tools=[WEATHER],
                                    tool_choice="none", max_output_tokens=1)
    assert fewer.usage.input_tokens < again.usage.input_tokens


def test_auto_tool_choice_reads_hermes_calls(client):
    # The random model writes no call by itself: a guided choice makes it write one in the
    # hermes format, which --tool-call-parser hermes reads (the text before it is the
    # message, as vLLM's items: the message, then the call).
    text = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 2}}</tool_call>')
    kw = dict(model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=200,
              extra_body={"structured_outputs": {"choice": [text]}})
    message, call = client.responses.create(**kw).output
    assert message.type == "message" and message.content[0].text == "Sure."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    events = list(client.responses.create(stream=True, **kw))
    added = [(e.output_index, e.item.type) for e in events
             if e.type == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call")]
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris", "days": 2}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        .strip() == "Sure."
    # Plain text with tools is the message.
    plain = client.responses.create(model="tiny", input=ASK, tools=[WEATHER],
                                    max_output_tokens=5, **GREEDY)
    assert [o.type for o in plain.output] == ["message"] and plain.output_text


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input"),
])
def test_bad_tool_requests_name_the_field(server, body, field):
    r = requests.post(server + "/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                      **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_items_stream_one_at_a_time_in_vllms_order():
    """Reasoning, then text, then a call: each item closed before the next opens, each at the
    next output_index, as vLLM's SimpleStreamingEventProcessor streams them."""
    items = OutputItems()
    events = items.reasoning("plan ") + items.reasoning("it") + items.content("Sure.") + \
        items.call({"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": ""}}) + \
        items.call({"index": 0, "function": {"arguments": '{"a": '}}) + \
        items.call({"index": 0, "function": {"arguments": "1}"}}) + items.close()
    assert [(k, f.get("output_index")) for k, f in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1),
        ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2)]
    thought, text, call = items.done
    assert thought["type"] == "reasoning" and thought["content"] == [
        {"type": "reasoning_text", "text": "plan it"}]
    assert text["content"][0]["text"] == "Sure."
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')


@pytest.fixture(scope="module")
def qwen3_client(tmp_path_factory, qwen3_model_dir):
    proc, url, _ = start_server(tmp_path_factory.mktemp("resp-qwen3"), qwen3_model_dir,
                                "--reasoning-parser", "qwen3", agent_ports=(free_port(),))
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none")
    finally:
        assert stop_server(proc) == 0


# Continuing an answer still inside <think> (test_reasoning's way to make the tiny Qwen3
# think): all the text it writes is reasoning.
THINKING = [{"role": "user", "content": "Why?"},
            {"type": "message", "role": "assistant", "content": "<think>\nLet me see",
             "status": "in_progress"}]


def test_reasoning_item_as_vllm(qwen3_client):
    client = qwen3_client
    chat = client.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "<think>\nLet me see"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    thought = chat.choices[0].message.model_extra["reasoning"]
    assert thought and chat.choices[0].message.content is None
    kw = dict(model="tiny", input=THINKING, max_output_tokens=12, **GREEDY)
    r = client.responses.create(**kw)
    (item,) = r.output          # no message: there is no text after the reasoning (vLLM)
    assert item.type == "reasoning" and item.id.startswith("rs_")
    assert item.content[0].type == "reasoning_text" and item.content[0].text == thought
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    # Streamed with vLLM's reasoning events.
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == thought
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == thought
    assert final.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens
    # enable_thinking false: the text is the message; include_reasoning false: no item.
    plain = client.responses.create(**kw, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    assert [o.type for o in plain.output] == ["message"] and plain.output_text == thought
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    # reasoning.effort "none" (vLLM's): enable_thinking false, as chat's reasoning_effort
    effortless = client.responses.create(**kw, reasoning={"effort": "none"})
    assert [o.type for o in effortless.output] == ["message"]
    assert effortless.output_text == thought
    assert client.responses.create(**kw, reasoning={"effort": "high"}).output[0].type == \
        "reasoning"
    with pytest.raises(openai.BadRequestError, match="summar"):
        client.responses.create(**kw, reasoning={"effort": "low", "summary": "auto"})
    hidden = client.responses.create(**kw, extra_body={"include_reasoning": False})
    assert hidden.output == [] and hidden.usage.output_tokens_details.reasoning_tokens > 0
