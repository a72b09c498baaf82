"""vLLM's --chat-template-content-format (LLM.chat's chat_template_content_format): a message's
content reaches the chat template as a string (text parts joined with newlines) or as OpenAI's
list of parts, as the flag says or, with auto, as the template reads it. The prompts are the
ones vLLM 0.32 renders for the same templates and messages."""
from __future__ import annotations

import pytest
import requests

from llm_serving.chat_content_format import detect_content_format

# loops over the parts; prints the content; sets variables from messages and content first
LOOP = ("{% for m in messages %}[{{ m['role'] }}:{% for p in m['content'] %}{{ p['text'] }}|"
        "{% endfor %}]{% endfor %}")
PRINT = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
SETLOOP = ("{% set msgs = messages %}{% for m in msgs | reverse %}{% set c = m.content %}["
           "{% if c is string %}S:{{ c }}{% else %}{% for p in c %}{{ p.text }}|{% endfor %}"
           "{% endif %}]{% endfor %}")
# a variable named content, and a macro given the content: vLLM reads both as loops over it
NAMED = ("{% for m in messages %}{% set content = m['content'] %}[{% for p in content %}"
         "{{ p.text }}|{% endfor %}]{% endfor %}")
MACRO = ("{% macro parts(c) %}{% for p in c %}{{ p.text }}|{% endfor %}{% endmacro %}"
         "{% for m in messages %}[{{ parts(m.content) }}]{% endfor %}")
MESSAGES = [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
PARTS = "[{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]"
# (template, format) -> the prompt vLLM 0.32's LLM.chat renders
EXPECTED = {
    (LOOP, "auto"): "[system:s|][user:a|b|][assistant:]",
    (LOOP, "openai"): "[system:s|][user:a|b|][assistant:]",
    (LOOP, "string"): "[system:|][user:|||][assistant:]",
    (PRINT, "auto"): "[system:s][user:a\nb][assistant:]",
    (PRINT, "string"): "[system:s][user:a\nb][assistant:]",
    (PRINT, "openai"): f"[system:[{{'type': 'text', 'text': 's'}}]][user:{PARTS}][assistant:[]]",
    (SETLOOP, "auto"): "[S:][S:a\nb][S:s]",     # vLLM follows no other variable set from it
    (SETLOOP, "openai"): "[][a|b|][s|]",
    (SETLOOP, "string"): "[S:][S:a\nb][S:s]",
    (NAMED, "auto"): "[s|][a|b|][]",
    (MACRO, "auto"): "[s|][a|b|][]",
}


def test_auto_detects_a_loop_over_a_messages_content():
    assert [detect_content_format(t) for t in (LOOP, PRINT, SETLOOP, NAMED, MACRO, None,
                                               "{% for")] == \
        ["openai", "string", "string", "openai", "openai", "string", "string"]


@pytest.mark.parametrize("template, fmt", list(EXPECTED))
def test_llm_chat_gives_the_content_in_the_form_asked(tiny_llm, template, fmt):
    from llm_serving import SamplingParams
    out = tiny_llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template=template,
                        chat_template_content_format=fmt, add_generation_prompt=False)[0]
    assert out.prompt == EXPECTED[template, fmt]


def test_a_bad_format_is_refused_naming_it(tiny_llm):
    with pytest.raises(ValueError, match="chat_template_content_format"):
        tiny_llm.chat(MESSAGES, chat_template=LOOP, chat_template_content_format="json")


def test_the_server_flag_sets_the_form(tmp_path, tiny_model_dir):
    """--chat-template-content-format string on a template looping over the parts: the
    loop sees a string, on /tokenize and on a chat request alike; auto is refused nothing."""
    from test_http_server import free_port, start_server, stop_server
    from test_vllm_serve_flags import _settings
    from llm_serving.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    template = tmp_path / "loop.jinja"
    template.write_text(LOOP)
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--chat-template", str(template),
                                "--chat-template-content-format", "string",
                                agent_ports=(free_port(),))
    try:
        body = {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": False}
        ids = requests.post(url + "/tokenize", json=body).json()["tokens"]
        assert tok.decode(ids) == EXPECTED[LOOP, "string"]
        r = requests.post(url + "/v1/chat/completions", json={**body, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        assert stop_server(proc) == 0
    with pytest.raises(SystemExit):
        _settings(tiny_model_dir, "--chat-template-content-format", "json")
