"""--reasoning-parser qwen3 / deepseek_r1: the thinking split off a chat answer's content, as
vLLM 0.32 splits it, whole and streamed."""
from __future__ import annotations

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
    ("<think>x</think>y", "qwen3", False, None, "<think>x</think>y"),
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
    reasoning.append(stream.finish()[0])
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
    assert stream.feed(" more<") == ("", " more<")


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
        model="tiny", max_tokens=12, temperature=0, stream=stream,
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
