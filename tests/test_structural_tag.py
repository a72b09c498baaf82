"""vLLM's structural tags over a real server (response_format, the structural_tag field,
structured_outputs) and offline: the output is the unconstrained output up to a trigger,
then a structure's begin string, JSON valid for its schema (jsonschema) and its end string;
several structures; a special-token trigger; JSON whitespace_pattern; the refusals."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests

from llm_serving import SamplingParams
from llm_serving.sampling_params import StructuredOutputsParams
from test_http_server import served

NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
WORD = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 4}},
        "required": ["w"], "additionalProperties": False}
NO_EOS = {"2": -100, "4": -100}      # the tiny model's EOS ids: long outputs
PROMPT = "Hello"


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_model_dir):
    yield from served(tmp_path_factory.mktemp("stag"), tiny_model_dir)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def free(client):
    """The unconstrained greedy output and a trigger: the text of one of its tokens, there
    first at that token."""
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                  logit_bias=NO_EOS, logprobs=0)
    text, tokens = r.choices[0].text, r.choices[0].logprobs.tokens
    at = 0
    for i, tok in enumerate(tokens):
        if i >= 2 and len(tok.strip()) >= 2 and text.find(tok) == at and "<" not in tok:
            return text, tok
        at += len(tok)
    pytest.fail(f"no trigger in {tokens}")


def _complete(client, max_tokens=60, **extra):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                  temperature=0, logit_bias=NO_EOS, extra_body=extra)
    return r.choices[0].text, r.choices[0].finish_reason


def _tags(text: str, triggers: list[str], structures: list[dict], finished: bool) -> int:
    """Checks that each trigger in ``text`` starts a structure: begin, JSON valid for its
    schema, end (the last one may be cut when not ``finished``); the complete ones."""
    done, at = 0, 0
    while True:
        hits = [(text.find(t, at), t) for t in triggers if text.find(t, at) >= 0]
        if not hits:
            return done
        pos, _ = min(hits)
        rest = text[pos:]
        s = next((s for s in structures if rest.startswith(s["begin"])), None)
        if s is None:
            assert not finished and any(b["begin"].startswith(rest) for b in structures), rest
            return done
        body = rest[len(s["begin"]):]
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            assert not finished, body
            return done
        jsonschema.validate(value, s["schema"])
        if not body[end:].startswith(s["end"]):
            assert not finished and s["end"].startswith(body[end:]), body
            return done
        done += 1
        at = pos + len(s["begin"]) + end + len(s["end"])


def test_free_text_until_the_trigger_then_the_structure_in_every_request_form(client, free):
    base, trig = free
    tag = {"triggers": [trig], "structures": [{"begin": trig + "=n>", "schema": NUMBER,
                                               "end": "</n>"}]}
    forms = [{"response_format": {"type": "structural_tag", **tag}},
             {"structural_tag": json.dumps(tag)},
             {"structured_outputs": {"structural_tag": json.dumps(tag)}}]
    outs = [_complete(client, **form) for form in forms]
    assert outs[0] == outs[1] == outs[2]
    text, reason = outs[0]
    cut = base.find(trig) + len(trig)
    assert text[:cut] == base[:cut] and text != base
    assert _tags(text, [trig], tag["structures"], reason == "stop") >= 1


def _tag_format(trig, begin, schema, end):
    return {"type": "tag", "begin": begin, "end": end,
            "content": {"type": "json_schema", "json_schema": schema}}


def test_the_format_form_as_xgrammar_reads_it(client, free):
    """vLLM's newer form (xgrammar's language): triggered_tags is the older form's tag;
    stop_after_first ends the output after one tag, at_least_one starts it with one;
    tags_with_separator is only tags and separators; a tag's any_text runs to its end."""
    base, trig = free
    structures = [{"begin": trig + "=n>", "schema": NUMBER, "end": "</n>"}]
    tags = [_tag_format(trig, **s) for s in structures]
    older = _complete(client, structural_tag=json.dumps({"triggers": [trig],
                                                         "structures": structures}))
    fmt = {"type": "triggered_tags", "triggers": [trig], "tags": tags}
    assert _complete(client, response_format={"type": "structural_tag", "format": fmt}) == older
    text, reason = _complete(client, structured_outputs={"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {**fmt, "stop_after_first": True}})})
    assert reason == "stop" and text.endswith("</n>") and text.count(trig + "=n>") == 1
    assert text.startswith(base[:base.find(trig)]) and _tags(text, [trig], structures, True) == 1
    text, reason = _complete(client, structural_tag=json.dumps({"format": {
        **fmt, "stop_after_first": True, "at_least_one": True}}))
    assert reason == "stop" and text.startswith(trig + "=n>")
    assert _tags(text, [trig], structures, True) == 1
    text, reason = _complete(client, max_tokens=50, structural_tag=json.dumps({"format": {
        "type": "tags_with_separator", "tags": tags, "separator": ";", "at_least_one": True}}))
    parts = text.split(";")
    assert all(_tags(p, [trig], structures, True) == 1 for p in parts[:-1]) and len(parts) > 1
    text, _ = _complete(client, max_tokens=30, structural_tag=json.dumps({"format": {
        "type": "sequence", "elements": [
            {"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "/"},
            {"type": "const_string", "value": "!"}]}}), logit_bias={**NO_EOS, "19": 10})
    assert re.fullmatch(r"<t>[^/]*/!", text), text     # '/' pushed: the tag ends at the first


def test_several_structures_and_a_chat_stream(client, free):
    """Two structures behind one trigger (the model picks either begin), a trigger that never
    comes, and the same answer streamed on chat as not."""
    _, trig = free
    structures = [{"begin": trig + "=n>", "schema": NUMBER, "end": "</n>"},
                  {"begin": trig + "=w>", "schema": WORD, "end": "</w>"},
                  {"begin": "@@never=", "schema": NUMBER, "end": "@@"}]
    tag = {"type": "structural_tag", "triggers": [trig, "@@never"], "structures": structures}
    text, reason = _complete(client, max_tokens=80, response_format=tag)
    assert _tags(text, [trig, "@@never"], structures, reason == "stop") >= 1
    msgs = [{"role": "user", "content": "Call a tool"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=60, temperature=0, logit_bias=NO_EOS,
              response_format=tag)
    answer = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == answer.message.content
    _tags(answer.message.content, [trig, "@@never"], structures,
          answer.finish_reason == "stop")


def test_a_special_token_trigger_is_matched_as_that_token(client):
    """<|im_start|> is one special token of the tiny model: pushed by logit_bias, it starts
    the structure at once (as text it could never appear)."""
    tag = {"triggers": ["<|im_start|>"], "structures": [
        {"begin": "<|im_start|>tool", "schema": NUMBER, "end": "<|im_end|>"}]}
    text, _ = _complete(client, max_tokens=20, structural_tag=json.dumps(tag),
                        logit_bias={"3": 100}, skip_special_tokens=False)
    assert text.startswith("<|im_start|>tool{")
    value, end = json.JSONDecoder().raw_decode(text[len("<|im_start|>tool"):])
    jsonschema.validate(value, NUMBER)


def test_whitespace_pattern_sets_the_whitespace_between_json_tokens(client):
    """A newline pushed by logit_bias: compact JSON has none; with whitespace_pattern (or
    vLLM's older guided_whitespace_pattern) '\\n?' each gap holds one, and nothing else."""
    bias = {"203": 100, "97": 50}
    so = {"json": NUMBER}
    compact, _ = _complete(client, max_tokens=30, structured_outputs=so, logit_bias=bias)
    newline, _ = _complete(client, max_tokens=30, logit_bias=bias, structured_outputs={
        **so, "whitespace_pattern": "\n?"})
    older, _ = _complete(client, max_tokens=30, logit_bias=bias, guided_json=NUMBER,
                         guided_whitespace_pattern="\n?")
    assert "\n" not in compact and newline == older and "\n" in newline
    assert re.fullmatch(r'\{\n?"n"\n?:\n?\d+\n?\}', newline), newline
    jsonschema.validate(json.loads(newline), NUMBER)


TAG = {"triggers": ["<f="], "structures": [{"begin": "<f=a>", "schema": NUMBER, "end": "</f>"}]}
DEEP = {"type": "const_string", "value": "x"}
for _ in range(100):
    DEEP = {"type": "optional", "content": DEEP}


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "structural_tag", "format": {
        "type": "qwen_xml_parameter", "json_schema": NUMBER}}}, "response_format", "format.type"),
    ({"structural_tag": json.dumps({"format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                               "content": {"type": "json_schema",
                                                           "json_schema": NUMBER,
                                                           "style": "qwen_xml"}}})},
     "structural_tag", "format.content.style"),
    ({"structured_outputs": {"structural_tag": json.dumps({"format": {
        "type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string",
                                                                "value": "x"}]}})}},
     "structured_outputs.structural_tag", "format.elements[0]"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<g="],
                          "structures": TAG["structures"]}}, "response_format", "none of the"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": []}},
     "response_format", "structures"),
    ({"structural_tag": json.dumps({**TAG, "strict": True})}, "structural_tag", "'strict'"),
    ({"structural_tag": "{"}, "structural_tag", "not valid JSON"),
    ({"response_format": {"type": "structural_tag", "format": DEEP}}, "response_format",
     "nested deeper than 80"),
    ({"structural_tag": json.dumps({"triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "integer", "minimum": "x"}, "end": ""}]})},
     "structural_tag", "structural_tag"),
    ({"structural_tag": json.dumps(TAG), "guided_regex": "a"}, "structural_tag", "only one"),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG), "regex": "a"}},
     "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "JSON"),
    ({"structured_outputs": {"json": NUMBER, "whitespace_pattern": "(["}},
     "structured_outputs.whitespace_pattern", "unclosed"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON constraint"),
    ({"guided_json": NUMBER, "guided_whitespace_pattern": "(["}, "guided_whitespace_pattern",
     "unclosed"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "JSON"),
    ({"guided_json": NUMBER, "guided_whitespace_pattern": " ",
      "structured_outputs": {"json": NUMBER, "whitespace_pattern": " "}},
     "structured_outputs", "only one"),
])
def test_bad_structural_tags_and_whitespace_patterns_are_refused_by_name(url, body, param,
                                                                         says):
    r = requests.post(url + "/v1/completions",
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_offline_structural_tag_is_the_server_s(client, free, tiny_llm):
    """LLM.generate with StructuredOutputsParams(structural_tag=...) (text or dict) gives the
    server's output."""
    _, trig = free
    tag = {"triggers": [trig], "structures": [{"begin": trig + "=w>", "schema": WORD,
                                               "end": "</w>"}]}
    served_text, _ = _complete(client, structural_tag=json.dumps(tag))
    for value in (json.dumps(tag), tag):
        params = SamplingParams(max_tokens=60, temperature=0, logit_bias={2: -100, 4: -100},
                                structured_outputs=StructuredOutputsParams(structural_tag=value))
        assert tiny_llm.generate([PROMPT], params)[0].outputs[0].text == served_text
    with pytest.raises(ValueError, match="structured_outputs.structural_tag: .*none of the"):
        StructuredOutputsParams(structural_tag={"triggers": ["x"], "structures": [
            {"begin": "y", "schema": {}, "end": ""}]})
