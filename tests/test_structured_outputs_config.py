"""vLLM's --structured-outputs-config (LLM(structured_outputs_config=...), the YAML key): the
JSON it lets through (backend guidance's whitespace, disable_any_whitespace,
disable_additional_properties), its reasoning_parser and enable_in_reasoning on a served
Qwen3, and the values refused by name. A logit_bias pushing ',' or a newline shows what the
grammar allows at each point."""
from __future__ import annotations

import json

import openai
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ConfigError
from llm_serving.sampling_params import StructuredOutputsParams
from test_reasoning import SCHEMA as OK_SCHEMA, _chat, _of_schema, _think_end_id
from test_vllm_serve_flags import _settings

# "a" required, other keys allowed (JSON Schema's default)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _json_outputs(model_dir, config, *texts):
    """The output of one greedy JSON request per text, whose token (of the tiny model's
    vocabulary) gets a bias of 100 and '}' one of 50."""
    llm = LLM(model_dir, structured_outputs_config=config, num_blocks=64)
    ids = lambda s: llm.get_tokenizer().encode(s, add_special_tokens=False)  # noqa: E731
    outs = []
    for text in texts:
        (tid,), (close,) = ids(text), ids("}")
        params = SamplingParams(max_tokens=20, temperature=0, logit_bias={tid: 100, close: 50},
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
        outs.append(llm.generate(["hi"], params)[0].outputs[0].text)
    return outs


def test_json_whitespace_and_closed_objects_as_the_config_asks(tiny_model_dir):
    # by default compact JSON whatever the model prefers, and other keys allowed
    newline, comma = _json_outputs(tiny_model_dir, None, "\n", ",")
    assert json.loads(newline) == {"a": 7} and "\n" not in newline
    assert comma.startswith('{"a":7,"')
    # vLLM's guidance backend: any whitespace
    newline, = _json_outputs(tiny_model_dir, {"backend": "guidance"}, "\n")
    assert newline.startswith("{\n\n\n")
    # disable_any_whitespace: compact again; disable_additional_properties: no other key
    newline, comma = _json_outputs(tiny_model_dir, {
        "backend": "guidance", "disable_any_whitespace": True,
        "disable_additional_properties": True}, "\n", ",")
    assert json.loads(newline) == json.loads(comma) == {"a": 7}
    assert "\n" not in newline


@pytest.mark.parametrize("value, key", [
    ('{"backend": "xgrammar"}', "structured_outputs_config.backend"),
    ('{"backend": "foo"}', "structured_outputs_config.backend"),
    ('{"disable_fallback": true}', "structured_outputs_config.disable_fallback"),
    ('{"disable_any_whitespace": true}', "structured_outputs_config.disable_any_whitespace"),
    ('{"disable_additional_properties": true}',
     "structured_outputs_config.disable_additional_properties"),
    ('{"enable_in_reasoning": "yes"}', "structured_outputs_config.enable_in_reasoning"),
    ('{"reasoning_parser": "granite"}', "structured_outputs_config.reasoning_parser"),
    ('{"reasoning_parser_plugin": "p.py"}', "structured_outputs_config.reasoning_parser_plugin"),
    ('[1]', "structured_outputs_config"),
])
def test_values_vllm_refuses_or_we_cannot_honour_are_refused_naming_them(
        tiny_model_dir, value, key):
    with pytest.raises((ConfigError, SystemExit)) as e:
        _settings(tiny_model_dir, "--structured-outputs-config", value)
    if value != "[1]":       # not an object: argparse's usage error, naming the flag
        assert e.value.key == key and key.rsplit(".", 1)[-1] in str(e.value)


def test_reasoning_parser_in_the_config_is_the_flags_which_wins(tiny_model_dir):
    args = _settings(tiny_model_dir, "--structured-outputs-config",
                     '{"reasoning_parser": "qwen3"}')[0]
    assert args.reasoning_parser == "qwen3"
    args = _settings(tiny_model_dir, "--structured-outputs-config",
                     '{"reasoning_parser": "qwen3"}', "--reasoning-parser", "deepseek_r1")[0]
    assert args.reasoning_parser == "deepseek_r1"


def test_enable_in_reasoning_holds_the_grammar_while_the_model_thinks(tmp_path,
                                                                     qwen3_model_dir):
    """Served with the config's reasoning_parser and enable_in_reasoning, a schema holds from
    the first token of an answer still inside <think>: a </think> pushed by logit_bias cannot
    be sampled, the thinking is the schema's JSON (without the option, that </think> ends the
    thinking at once and the content is the JSON: tests/test_reasoning.py)."""
    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, qwen3_model_dir, "--structured-outputs-config",
                                '{"reasoning_parser": "qwen3", "enable_in_reasoning": true}',
                                agent_ports=(free_port(),))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": OK_SCHEMA}}
        msg = _chat(client, max_tokens=40, response_format=fmt,
                    logit_bias={str(_think_end_id(qwen3_model_dir)): 100}).choices[0].message
        assert msg.content is None and _of_schema(msg.model_extra["reasoning"])
    finally:
        assert stop_server(proc) == 0
