"""--reasoning-parser qwen3 / deepseek_r1: the thinking split off a chat answer's content, as
vLLM 0.32 splits it, whole and streamed."""
from __future__ import annotations

import json

import pytest

from llm_serving.entrypoints.reasoning import ReasoningStream, split

# (text, parser, thinking, reasoning, content)
CASES = [
    ("<think>\nplan it\n</think>\n\nThe answer.", "qwen3", True, "\nplan it\n",
     "\n\nThe answer."),
    # Qwen3-2507 and DeepSeek-R1 templates put <think> in the prompt: the text starts inside.
    ("plan it</think>The answer.", "qwen3", True, "plan it", "The answer."),
    ("plan it</think>The answer.", "deepseek_r1", True, "plan it", "The answer."),
    ("<think>plan</think>a</think>b", "deepseek_r1", True, "plan", "a</think>b"),
    # no </think>: all reasoning (the answer was cut off while thinking)
    ("<think>still thinking", "qwen3", True, "still thinking", None),
    ("still thinking <", "deepseek_r1", True, "still thinking <", None),
    # empty reasoning, and nothing after it
    ("<think></think>Hi", "qwen3", True, None, "Hi"),
    ("<think>x</think>", "qwen3", True, "x", None),
    # enable_thinking false: all content, for qwen3 only
    # (vLLM's Qwen3 parser absorbs a </think> in the content, and keeps a <think> there)
    ("<think>x</think>y", "qwen3", False, None, "<think>xy"),
    ("<think>plan</think>a</think>b<think>", "qwen3", True, "plan", "ab<think>"),
    ("x</think>y", "deepseek_r1", False, "x", "y"),
    # qwen3: a tool call ends the reasoning and stays for the tool parser
    ('hmm<tool_call>{"name": "f"}</tool_call>', "qwen3", True, "hmm",
     '<tool_call>{"name": "f"}</tool_call>'),
    ("hmm<tool_call>", "deepseek_r1", True, "hmm<tool_call>", None),
]


@pytest.mark.parametrize("text,name,thinking,reasoning,content", CASES)
def test_whole_text_splits_as_vllm(text, name, thinking, reasoning, content):
    assert split(text, name, thinking) == (reasoning, content)


def _streamed(pieces, name, thinking):
    stream = ReasoningStream(name, thinking)
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    held = stream.finish()
    reasoning.append(held[0])
    content.append(held[1])
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("text,name,thinking,reasoning,content", CASES)
def test_stream_split_at_every_boundary_gives_the_whole_split(text, name, thinking, reasoning,
                                                              content):
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]], name, thinking) == (reasoning, content), cut
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            pieces = [text[:a], text[a:b], text[b:]]
            assert _streamed(pieces, name, thinking) == (reasoning, content), (a, b)
    assert _streamed(list(text), name, thinking) == (reasoning, content)


def test_stream_holds_back_only_what_may_start_a_marker():
    stream = ReasoningStream("qwen3")
    assert stream.feed("abc</th") == ("abc", "")
    assert stream.feed("ought") == ("</thought", "")
    assert stream.feed("x<") == ("x", "")
    assert stream.feed("/think> ok") == ("", " ok")
    assert stream.feed(" more<") == ("", " more")      # qwen3: a </think> may follow
    assert stream.finish() == ("", "<")
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("a</think> more<") == ("a", " more<")


@pytest.fixture(scope="module")
def qwen3_servers(tmp_path_factory, qwen3_model_dir):
    """The tiny Qwen3 served with --reasoning-parser qwen3, and without."""
    from test_http_server import free_port, start_server, stop_server
    tmp = tmp_path_factory.mktemp("reasoning")
    plain = start_server(tmp, qwen3_model_dir, agent_ports=(free_port(),))[0:2]
    try:
        parsed = start_server(tmp, qwen3_model_dir, "--reasoning-parser", "qwen3",
                              agent_ports=(free_port(),))[0:2]
    except BaseException:
        stop_server(plain[0])
        raise
    yield plain[1], parsed[1]
    assert stop_server(parsed[0]) == 0
    assert stop_server(plain[0]) == 0


def _chat(client, stream=False, **kw):
    return client.chat.completions.create(
        model="tiny", max_tokens=kw.pop("max_tokens", 12), temperature=0, stream=stream,
        messages=[{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "<think>\nLet me see"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    **kw.pop("extra_body", {})}, **kw)


def test_server_puts_the_thinking_in_reasoning_not_content(qwen3_servers):
    """Continuing an answer still inside <think>: without the parser the text is the content;
    with it, the same text is the message's reasoning (vLLM's field), streamed as reasoning
    deltas; enable_thinking false keeps it content; include_reasoning false drops it."""
    import openai
    plain_url, parsed_url = qwen3_servers
    plain = openai.OpenAI(base_url=plain_url + "/v1", api_key="none")
    parsed = openai.OpenAI(base_url=parsed_url + "/v1", api_key="none")
    raw = _chat(plain).choices[0].message.content
    assert raw and "</think>" not in raw

    msg = _chat(parsed).choices[0].message
    assert msg.content is None
    assert msg.model_extra["reasoning"] == raw

    reasoning, content = "", ""
    for chunk in _chat(parsed, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (raw, "")

    msg = _chat(parsed, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                ).choices[0].message
    assert msg.content == raw and msg.model_extra["reasoning"] is None

    r = _chat(parsed, logprobs=True, extra_body={"include_reasoning": False})
    assert r.choices[0].message.model_extra["reasoning"] is None
    assert r.choices[0].logprobs is None


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def _of_schema(content):
    value = json.loads(content)
    return set(value) == {"ok"} and isinstance(value["ok"], bool)


def _think_end_id(model_dir):
    from llm_serving.tokenizer import Tokenizer
    ids = Tokenizer.from_pretrained(model_dir).encode("</think>", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_a_grammar_holds_from_the_end_of_the_thinking(qwen3_servers, qwen3_model_dir):
    """With --reasoning-parser, a json_schema response_format (or a forced tool call) lets the
    model think freely and holds from the token after </think>, as vLLM 0.32: the reasoning is
    the thinking, the content valid JSON of the schema, whole and streamed. A logit_bias on the
    </think> token ends the tiny model's thinking at once (no reasoning) or after a while."""
    import openai
    parsed = openai.OpenAI(base_url=qwen3_servers[1] + "/v1", api_key="none")
    end = str(_think_end_id(qwen3_model_dir))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    answers = {}
    for bias in (100, 8, 6, 4):
        msg = _chat(parsed, max_tokens=40, logit_bias={end: bias},
                    response_format=fmt).choices[0].message
        answers[bias] = (msg.model_extra["reasoning"], msg.content)
        assert msg.content is None or _of_schema(msg.content), (bias, msg)
    assert answers[100][0] is None and _of_schema(answers[100][1])
    both = [b for b, (r, c) in answers.items() if r and c]
    assert both, answers

    bias = both[0]
    reasoning, content = "", ""
    for chunk in _chat(parsed, stream=True, max_tokens=40, logit_bias={end: bias},
                       response_format=fmt):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == answers[bias]

    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    msg = _chat(parsed, max_tokens=40, logit_bias={end: bias}, tools=tools,
                tool_choice={"type": "function", "function": {"name": "f"}}).choices[0].message
    assert msg.model_extra["reasoning"] == answers[bias][0]
    assert _of_schema(msg.tool_calls[0].function.arguments)


def test_a_grammar_holds_from_the_first_token_when_there_is_no_thinking(qwen3_servers,
                                                                        qwen3_model_dir):
    """enable_thinking false, or a prompt whose thinking is closed: the schema holds from the
    first token (vLLM's is_reasoning_end on the prompt), so a </think> cannot be sampled."""
    import openai
    parsed = openai.OpenAI(base_url=qwen3_servers[1] + "/v1", api_key="none")
    end = str(_think_end_id(qwen3_model_dir))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    msg = _chat(parsed, max_tokens=40, logit_bias={end: 100}, response_format=fmt,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                ).choices[0].message
    assert msg.model_extra["reasoning"] is None and _of_schema(msg.content)
    msg = parsed.chat.completions.create(
        model="tiny", max_tokens=40, temperature=0, logit_bias={end: 100}, response_format=fmt,
        messages=[{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "<think>\nI see.\n</think>\n\n"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True}
    ).choices[0].message
    assert msg.model_extra["reasoning"] is None and _of_schema(msg.content)


def test_the_end_of_the_thinking_is_its_token_or_else_its_text(qwen3_model_dir, tiny_model_dir):
    """The grammar's start (engine/reasoning_end.py): the token after the </think> token where
    the tokenizer has one (Qwen3's), so that the same text spelled in other tokens is not an
    end; in the decoded text where it has none (the tiny Llama)."""
    from llm_serving.engine.reasoning_end import ReasoningEnd, marker_token_id
    from llm_serving.entrypoints.reasoning import ended_in_prompt
    from llm_serving.tokenizer import Tokenizer
    qwen3 = Tokenizer.from_pretrained(qwen3_model_dir)
    llama = Tokenizer.from_pretrained(tiny_model_dir)
    end = marker_token_id(qwen3, "</think>")
    assert end is not None and marker_token_id(llama, "</think>") is None

    def pieces(tok, *texts):
        return [i for t in texts for i in tok.encode(t, add_special_tokens=False)]
    spelled = pieces(qwen3, "so </", "thi", "nk", ">", " {")
    assert qwen3.decode(spelled) == "so </think> {"
    assert ReasoningEnd(qwen3, "</think>", end).feed(spelled) is None
    ids = pieces(qwen3, "so", "</think>", "{")
    gate = ReasoningEnd(qwen3, "</think>", end)
    assert gate.feed(ids[:1]) is None and gate.feed(ids[1:]) == ids[1:].index(end) + 1
    spelled = pieces(llama, "so </", "thi", "nk", ">", " {")
    gate = ReasoningEnd(llama, "</think>", None)
    assert gate.feed(spelled[:2]) is None
    at = gate.feed(spelled[2:])
    assert llama.decode(spelled[2:][at:]) == " {"

    asked = "<|im_start|>user\nWhat is </think>?<|im_end|>\n<|im_start|>assistant\n"
    closed = asked + "<think>\nI see.\n</think>\n\n"
    for tok in (qwen3, llama):
        for name, thinking, prompt, ended in [
                ("qwen3", True, asked, False), ("qwen3", True, closed, True),
                ("qwen3", True, asked + "<think>\n", False), ("qwen3", False, asked, True),
                ("deepseek_r1", True, closed, True),
                ("deepseek_r1", False, closed + "<think>", False)]:
            ids = tok.encode(prompt, add_special_tokens=False)
            assert ended_in_prompt(name, thinking, prompt, ids, tok) == ended, (name, prompt)


def test_usage_counts_the_reasoning_tokens(qwen3_servers, qwen3_model_dir):
    """With --reasoning-parser, usage.completion_tokens_details.reasoning_tokens (vLLM 0.32's):
    the tokens before </think> (all of them when it never comes, none with enable_thinking
    false), in the final usage of a stream too; without a parser there are no details."""
    import openai
    plain = openai.OpenAI(base_url=qwen3_servers[0] + "/v1", api_key="none")
    parsed = openai.OpenAI(base_url=qwen3_servers[1] + "/v1", api_key="none")
    end = str(_think_end_id(qwen3_model_dir))
    assert _chat(plain).usage.completion_tokens_details is None

    usage = _chat(parsed).usage
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 12
    usage = _chat(parsed, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage
    assert usage.completion_tokens_details.reasoning_tokens == 0

    counts = {}
    for bias in (100, 8, 6, 4):
        r = _chat(parsed, max_tokens=40, logit_bias={end: bias})
        thought = r.choices[0].message.model_extra["reasoning"]
        counts[bias] = r.usage.completion_tokens_details.reasoning_tokens
        if thought is None:
            assert counts[bias] == 0
        else:
            assert 0 < counts[bias] <= r.usage.completion_tokens
            assert counts[bias] < r.usage.completion_tokens or r.choices[0].message.content is None
    assert counts[100] == 0 and max(counts.values()) > 0
    bias = max(counts, key=counts.get)
    last = list(_chat(parsed, stream=True, max_tokens=40, logit_bias={end: bias},
                      stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == counts[bias]


def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off(qwen3_servers):
    """reasoning_effort is taken as vLLM 0.32 takes it: the chat template's reasoning_effort
    variable, and enable_thinking = (effort != "none") unless chat_template_kwargs sets it; so
    "none" makes a qwen3 answer content. A value outside vLLM's list is a 400 naming it."""
    import openai
    import requests
    from llm_serving.entrypoints.openai_protocol import ChatCompletionRequest
    parsed = openai.OpenAI(base_url=qwen3_servers[1] + "/v1", api_key="none")
    raw = _chat(parsed).choices[0].message.model_extra["reasoning"]
    assert raw
    msg = _chat(parsed, reasoning_effort="none").choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == (None, raw)
    msg = _chat(parsed, reasoning_effort="high").choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == (raw, None)
    msg = _chat(parsed, reasoning_effort="none",
                extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == (raw, None)

    r = requests.post(qwen3_servers[1] + "/v1/chat/completions",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                            "reasoning_effort": "ultra"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                reasoning_effort="low", chat_template_kwargs={"a": 1})
    assert req.template_vars() == {"a": 1, "reasoning_effort": "low", "enable_thinking": True}


@pytest.fixture(scope="module")
def qwen3_tokenizer(qwen3_model_dir):
    from llm_serving.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(qwen3_model_dir)


def _pieces(tok, ids):
    """The text each token adds, as a stream gives it."""
    texts = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    return [texts[k + 1][len(texts[k]):] for k in range(len(ids))]


@pytest.mark.parametrize("text,name,thinking,reasoning,content", CASES)
def test_by_token_the_same_split_whole_and_streamed(qwen3_tokenizer, text, name, thinking,
                                                    reasoning, content):
    """With a tokenizer whose markers are single tokens (the tiny Qwen3's, as Qwen3's), the
    markers are found by token id: the cases split as by text, whole and token by token."""
    tok = qwen3_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert split(text, name, thinking, ids, tok) == (reasoning, content)
    stream = ReasoningStream(name, thinking, tok)
    got = [stream.feed(p, [i]) for p, i in zip(_pieces(tok, ids), ids)] + [stream.finish()]
    assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got) or None) == \
        (reasoning, content)


def test_a_spelled_marker_is_text_where_the_tokenizer_has_the_marker_token(qwen3_tokenizer):
    """vLLM finds the markers by token id: "</think>" spelled in other tokens (the user's words
    repeated, a JSON string) neither ends the reasoning nor is dropped from the content; the
    marker token does and is (qwen3), whole and streamed."""
    tok = qwen3_tokenizer
    end = tok.encode("</think>", add_special_tokens=False)
    spelled = [i for t in ("</", "thi", "nk", ">") for i in tok.encode(t, add_special_tokens=False)]
    plain = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    ids = plain("I read ") + spelled + plain(" here") + end + plain("Say ") + spelled + end
    text = tok.decode(ids)
    assert text == "I read </think> here</think>Say </think></think>"
    expected = ("I read </think> here", "Say </think>")
    assert split(text, "qwen3", True, ids, tok) == expected
    assert split(text, "deepseek_r1", True, ids, tok) == (expected[0], "Say </think></think>")
    stream = ReasoningStream("qwen3", True, tok)
    got = [stream.feed(p, [i]) for p, i in zip(_pieces(tok, ids), ids)] + [stream.finish()]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == expected
    # by text (a tokenizer without the tokens), the first spelling ends the reasoning
    assert split(text, "qwen3") == ("I read ", " hereSay ")


def test_server_drops_a_repeated_end_of_thinking_token_from_the_content(qwen3_servers,
                                                                        qwen3_model_dir):
    """qwen3: a </think> token after the thinking ended is dropped (vLLM's Qwen3 parser absorbs
    it), whole and streamed: a logit_bias that makes the model repeat the token leaves no
    content."""
    import openai
    parsed = openai.OpenAI(base_url=qwen3_servers[1] + "/v1", api_key="none")
    end = str(_think_end_id(qwen3_model_dir))
    r = _chat(parsed, logit_bias={end: 100})
    assert r.usage.completion_tokens == 12
    assert (r.choices[0].message.model_extra["reasoning"], r.choices[0].message.content) == \
        (None, None)
    content = "".join(choice.delta.content or ""
                      for chunk in _chat(parsed, stream=True, logit_bias={end: 100})
                      for choice in chunk.choices)
    assert content == ""


def test_responses_give_a_reasoning_item_before_the_message(qwen3_servers, qwen3_model_dir):
    """/v1/responses with --reasoning-parser, as vLLM 0.32: the thinking is a reasoning item
    (a reasoning_text part) before the message, which holds the content; streamed, the
    reasoning item's events come first (output_index 0) and the message's at output_index 1;
    usage.output_tokens_details.reasoning_tokens counts it. The same answer as chat's."""
    import openai
    import requests
    plain_url, parsed_url = qwen3_servers
    parsed = openai.OpenAI(base_url=parsed_url + "/v1", api_key="none")
    end = str(_think_end_id(qwen3_model_dir))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    chats = {bias: _chat(parsed, max_tokens=40, logit_bias={end: bias}, response_format=fmt)
             for bias in (8, 6, 4)}
    bias = next(b for b, r in chats.items() if r.choices[0].message.content
                and r.choices[0].message.model_extra["reasoning"])
    chat = chats[bias]
    body = {"model": "tiny", "max_output_tokens": 40, "temperature": 0,
            "logit_bias": {end: bias},
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
            "input": [{"role": "user", "content": "Why?"},
                      {"type": "message", "role": "assistant", "status": "in_progress",
                       "content": [{"type": "output_text", "text": "<think>\nLet me see"}]}]}
    r = requests.post(parsed_url + "/v1/responses", json=body).json()
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
    thought = r["output"][0]["content"][0]
    assert thought == {"type": "reasoning_text",
                       "text": chat.choices[0].message.model_extra["reasoning"]}
    assert r["output"][1]["content"][0]["text"] == chat.choices[0].message.content
    reasoning_tokens = chat.usage.completion_tokens_details.reasoning_tokens
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens > 0

    events = [json.loads(line[6:]) for line in
              requests.post(parsed_url + "/v1/responses", json={**body, "stream": True},
                            stream=True).iter_lines() if line.startswith(b"data: ")]
    kinds = [(e["type"], e.get("output_index")) for e in events]
    first_text = kinds.index(("response.output_text.delta", 1))
    assert kinds[2:4] == [("response.output_item.added", 0), ("response.content_part.added", 0)]
    assert kinds[first_text - 5:first_text - 2] == [
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0)]
    said = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert said == thought["text"]
    done = events[-1]["response"]
    assert done["output"][0]["content"] == [thought] and done["output"][1]["content"][0][
        "text"] == chat.choices[0].message.content
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens

    plain = requests.post(plain_url + "/v1/responses", json=body).json()
    assert [o["type"] for o in plain["output"]] == ["message"]
    assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
