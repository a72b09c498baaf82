"""Where a vLLM user's scripts meet the OpenAI routes: the model's generation_config.json
sampling defaults, stop_reason for generation_config's other end ids, the "developer" role,
n > 1 streams, logprobs of tokens that hold part of a character, and fields refused
together. One real server (start.py) on a copy of the tiny model whose generation_config.json
sets sampling defaults."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
import requests

from test_http_server import served

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# The copy's generation_config.json: greedy by default (top_k 1), 7 new tokens for a chat
# without max_tokens; the tokenizer's EOS is 2, and 4 (<|im_end|>) ends a turn too.
GEN_DEFAULTS = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("parity")
    model = tmp / "tiny-with-defaults"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4]
    (model / "generation_config.json").write_text(json.dumps({**gen, **GEN_DEFAULTS}))
    yield from served(tmp, model)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def test_generation_config_sets_what_a_request_leaves_out(client):
    """vLLM's --generation-config auto: the model's temperature/top_k/... apply to a request
    that does not set them, max_new_tokens to a chat without max_tokens; what the request
    sets wins."""
    greedy = client.chat.completions.create(model="tiny", messages=MSG, temperature=0,
                                            max_tokens=7, extra_body={"ignore_eos": True})
    plain = [client.chat.completions.create(model="tiny", messages=MSG, seed=s,
                                            extra_body={"ignore_eos": True})
             for s in range(3)]
    assert {p.choices[0].message.content for p in plain} == {greedy.choices[0].message.content}
    assert [p.usage.completion_tokens for p in plain] == [7, 7, 7]
    own = {client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, seed=s,
                                          temperature=1.0, extra_body={"top_k": 0}
                                          ).choices[0].message.content for s in range(3)}
    assert len(own) > 1                         # the request's own top_k 0: sampled
    done = client.completions.create(model="tiny", prompt="Hi", extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16    # completions keep their own default


def test_stop_reason_names_an_end_id_other_than_the_tokenizers_eos(client):
    """generation_config's eos_token_id [2, 4]: 4 ends the output with stop_reason 4, the
    tokenizer's own EOS (2) with null, as vLLM."""
    for token, reason in ((4, 4), (2, None)):
        r = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0,
                                      logit_bias={str(token): 100})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
        assert r.choices[0].stop_reason == reason


def _tokens(server, messages):
    r = requests.post(server + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_developer_role_is_a_system_message_when_the_template_lacks_it(server):
    """Newer OpenAI SDKs send instructions as "developer"; a template that does not name it
    gets them as "system", every system message merged into the first (vLLM's way)."""
    user = {"role": "user", "content": "Hi"}
    assert _tokens(server, [{"role": "developer", "content": "Be brief."}, user]) == \
        _tokens(server, [{"role": "system", "content": "Be brief."}, user])
    assert _tokens(server, [{"role": "system", "content": "A"}, user,
                            {"role": "developer", "content": "B"}]) == \
        _tokens(server, [{"role": "system", "content": "A\n\nB"}, user])


def _finishes(chunks) -> dict:
    """index -> the finish reasons its chunks carried, in order."""
    seen: dict = {}
    for c in chunks:
        for ch in c.choices:
            if ch.finish_reason is not None:
                seen.setdefault(ch.index, []).append(ch.finish_reason)
    return seen


def test_each_choice_of_an_n_stream_finishes_once(client):
    """n > 1 streamed: a choice that ended sends no more chunks (vLLM); each index's text is
    the non-streamed answer's."""
    body = dict(model="tiny", prompt="Hello", n=3, temperature=1, seed=5, max_tokens=40,
                stop=["e", "a"])
    chunks = list(client.completions.create(**body, stream=True))
    texts: dict = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    finishes = _finishes(chunks)
    assert sorted(finishes) == [0, 1, 2] and all(len(f) == 1 for f in finishes.values())
    for i, f in finishes.items():     # the finishing chunk is the choice's last
        last = max(k for k, c in enumerate(chunks) if any(ch.index == i for ch in c.choices))
        assert chunks[last].choices[0].finish_reason == f[0]
    whole = client.completions.create(**body)
    assert {ch.index: ch.text for ch in whole.choices} == texts
    chat = list(client.chat.completions.create(
        model="tiny", messages=MSG, n=3, temperature=1, seed=5, max_tokens=40,
        stop=["e", "a"], stream=True))
    finishes = _finishes(chat)
    assert sorted(finishes) == [0, 1, 2] and all(len(f) == 1 for f in finishes.values())


def test_a_chat_streams_last_text_comes_in_its_finish_chunk(client):
    """vLLM's chat stream: the chunk that finishes a choice carries the last text, and its
    delta has content ("" when the last token added none), so joining every chunk's
    delta.content works and no chunk after the text is content-less."""
    for extra in ({"max_tokens": 6, "extra_body": {"ignore_eos": True}},
                  {"max_tokens": 40, "stop": ["e", "a"]}):
        body = dict(model="tiny", messages=MSG, temperature=0, logprobs=True, **extra)
        whole = client.chat.completions.create(**body).choices[0]
        chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
        contents = [c.choices[0].delta.content for c in chunks]
        assert all(isinstance(t, str) for t in contents), contents
        assert "".join(contents) == whole.message.content
        last = chunks[-1].choices[0]
        assert last.finish_reason == whole.finish_reason
        assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        # the finish chunk carries the last token (not an empty delta after it)
        tokens = [t.token for c in chunks[1:] for t in c.choices[0].logprobs.content]
        assert tokens == [t.token for t in whole.logprobs.content]
        assert last.logprobs.content[-1].token == tokens[-1]


def test_a_chat_message_has_the_null_fields_vllm_and_openai_send(server):
    """A script reading the JSON as vLLM's (and OpenAI's) answers it finds message["refusal"]
    and the other fields this server never fills, null, next to role and content."""
    r = requests.post(server + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    for field in ("refusal", "annotations", "audio", "function_call", "reasoning"):
        assert msg[field] is None, field


def test_logprob_tokens_of_a_split_character_add_up_to_the_text(server, client):
    """A character made of several byte tokens: the tokens before its last byte are named
    "" and the last carries the character (vLLM's), so the tokens join to the text and each
    text_offset is where its token's text starts; chat's bytes are those of the text."""
    forced = {"structured_outputs": {"regex": "a\U0001F600b\u2603c"}}
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0,
                                  logprobs=0, extra_body=forced)
    c = r.choices[0]
    assert c.text == "a\U0001F600b\u2603c" and c.finish_reason == "stop"
    tokens = c.logprobs.tokens
    assert tokens[-1] == "<|im_end|>"             # the end token: its text is not output
    assert len(tokens) - 1 > len(c.text)            # the emoji and the snowman are split
    assert "".join(tokens[:-1]) == c.text and "\ufffd" not in "".join(tokens)
    starts = [sum(map(len, tokens[:k])) for k in range(len(tokens))]
    assert c.logprobs.text_offset == starts
    streamed = [t for ch in client.completions.create(
        model="tiny", prompt="Hello", max_tokens=20, temperature=0, logprobs=0,
        extra_body=forced, stream=True) for t in (ch.choices[0].logprobs.tokens
                                                  if ch.choices else [])]
    assert streamed == tokens
    chat = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=20, temperature=0, logprobs=True,
        extra_body=forced)
    content = chat.choices[0].logprobs.content[:-1]
    assert b"".join(bytes(t.bytes) for t in content).decode() == chat.choices[0].message.content
    assert [t.token for t in content] == tokens[:-1]


def test_output_cut_inside_a_character_drops_its_bytes(client):
    """max_tokens cuts the output after 2 of an emoji's 4 byte tokens: the text ends before
    it (vLLM drops the bytes; it was "a\ufffd"), the same in a stream, where no delta is
    lost; the cut tokens are named "" in logprobs, as vLLM names them."""
    forced = {"structured_outputs": {"regex": "a\U0001F600b"}}
    kw = dict(model="tiny", prompt="Hello", temperature=0, extra_body=forced)
    cut = client.completions.create(max_tokens=3, logprobs=0, **kw).choices[0]
    assert (cut.text, cut.finish_reason) == ("a", "length")
    assert cut.logprobs.tokens == ["a", "", ""]
    deltas = [ch.choices[0].text for ch in client.completions.create(max_tokens=3, stream=True,
                                                                     **kw) if ch.choices]
    assert "".join(deltas) == "a" and "\ufffd" not in "".join(deltas)
    whole = client.completions.create(max_tokens=5, **kw).choices[0].text
    assert whole == "a\U0001F600"
    deltas = [ch.choices[0].text for ch in client.completions.create(max_tokens=5, stream=True,
                                                                     **kw) if ch.choices]
    assert "".join(deltas) == whole
    chat = dict(model="tiny", messages=MSG, max_tokens=3, temperature=0, extra_body=forced)
    assert client.chat.completions.create(**chat).choices[0].message.content == "a"
    streamed = [ch.choices[0].delta.content or "" for ch in
                client.chat.completions.create(stream=True, **chat) if ch.choices]
    assert "".join(streamed) == "a"


def test_empty_prompt_as_vllm_serves_it(server):
    """/v1/completions as vLLM's: prompt "" is a 400 naming the prompt, but a list holding
    "" is that prompt's BOS alone, and generates (as offline generate(""))."""
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = requests.post(server + "/v1/completions", json={**body, "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = requests.post(server + "/v1/completions", json={**body, "prompt": ["", "Hi"]})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["finish_reason"] == "length"
    bos = requests.post(server + "/v1/completions", json={**body, "prompt": [1]}).json()
    assert choices[0]["text"] == bos["choices"][0]["text"]


@pytest.mark.parametrize("route,body,field", [
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": MSG, "stream": False,
                              "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_fields_vllm_refuses_are_a_400_naming_them(server, route, body, field):
    r = requests.post(server + route, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
