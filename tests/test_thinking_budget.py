"""thinking_token_budget (vLLM 0.32's) on the tiny Qwen3 under a chat template that opens
<think>: once the reasoning (the template's "\\n" after <think> included) has the budget's
tokens, the reasoning config's end text is forced token by token and the output goes on,
parsed as content by --reasoning-parser. Checked against transformers' greedy tokens with the
end text put in by hand, offline (LLM.chat, LLM.generate, with n-gram speculative decoding)
and on the real server (async scheduling) with the openai and anthropic clients; the
--reasoning-config values refused by name."""
from __future__ import annotations

import anthropic
import openai
import pytest
import requests

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ConfigError
from test_http_server import served
from test_vllm_serve_flags import _settings

# ChatML, its generation prompt opening <think> (closing it with enable_thinking false)
TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
ASK = [{"role": "user", "content": "Why?"}]
TIME_UP = "Time is up.\n</think>"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("think") / "template.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def _reference(model_dir):
    """transformers' tokenizer, the prompt ids of ASK, and ``forced(prompt_ids, free, forced,
    total)``: ``free`` greedy tokens, then the ``forced`` ids, then greedy tokens up to
    ``total`` in all."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = tok.apply_chat_template(ASK, chat_template=TEMPLATE, add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids

    def greedy(ids, n):
        if n <= 0:
            return []
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 min_new_tokens=n)
        return out[0, len(ids):].tolist()

    def forced(ids, free, end, total):
        out = greedy(ids, free) + list(end)
        return (out + greedy(ids + out, total - len(out)))[:total]
    return tok, prompt, forced


@pytest.fixture(scope="module")
def hf(qwen3_model_dir):
    """The tiny Qwen3's reference (_reference): <think> and </think> are one token each."""
    return _reference(qwen3_model_dir)


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_offline_the_end_is_forced_after_the_budget(qwen3_model_dir, template, hf):
    """LLM.chat and LLM.generate: budget b leaves b - 1 tokens after the template's "\\n",
    then </think>, then the greedy continuation (transformers' with the token put in)."""
    tok, prompt, forced = hf
    (end,) = _ids(tok, "</think>")
    llm = LLM(qwen3_model_dir, reasoning_parser="qwen3", chat_template=template, num_blocks=64)
    for budget in (0, 1, 3, 6):
        params = SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=budget)
        ids = list(llm.chat(ASK, params)[0].outputs[0].token_ids)
        assert ids == forced(prompt, max(budget - 1, 0), [end], 12), budget
        assert ids.index(end) == max(budget - 1, 0)
        assert list(llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids) == ids
    unlimited = SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=-1)
    assert end not in llm.chat(ASK, unlimited)[0].outputs[0].token_ids


def test_offline_an_end_text_of_many_tokens_and_speculative_decoding(qwen3_model_dir, template,
                                                                     hf):
    """reasoning_config's reasoning_end_str is forced token by token; with n-gram drafts
    (which a budgeted request does not take) the tokens are the same."""
    tok, prompt, forced = hf
    llm = LLM(qwen3_model_dir, reasoning_parser="qwen3", chat_template=template, num_blocks=64,
              reasoning_config={"reasoning_end_str": TIME_UP},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 2})
    params = SamplingParams(max_tokens=16, temperature=0, thinking_token_budget=3)
    out = llm.chat(ASK, params)[0].outputs[0]
    assert list(out.token_ids) == forced(prompt, 2, _ids(tok, TIME_UP), 16)
    assert TIME_UP in out.text


def test_offline_texts_of_many_tokens(tiny_model_dir, template):
    """A tokenizer that spells <think> and </think> in several tokens (the tiny Llama's), set
    by reasoning_config without a parser: the start text is found in the prompt and its
    tokens after it count, the end text is forced token by token."""
    tok, prompt, forced = _reference(tiny_model_dir)
    end = _ids(tok, "</think>")
    assert len(_ids(tok, "<think>")) > 1 and len(end) > 1
    llm = LLM(tiny_model_dir, chat_template=template, num_blocks=64, reasoning_config={
        "reasoning_start_str": "<think>", "reasoning_end_str": "</think>"})
    for budget in (1, 2, 5):
        params = SamplingParams(max_tokens=14, temperature=0, thinking_token_budget=budget)
        ids = list(llm.chat(ASK, params)[0].outputs[0].token_ids)
        assert ids == forced(prompt, budget - 1, end, 14), budget


def test_offline_a_budget_without_reasoning_config_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="^thinking_token_budget: .*--reasoning-parser"):
        tiny_llm.generate("hi", SamplingParams(max_tokens=4, thinking_token_budget=4))


@pytest.mark.parametrize("value, key", [
    ('{"reasoning_end": "x"}', "reasoning_config.reasoning_end"),
    ('{"reasoning_parser": "granite"}', "reasoning_config.reasoning_parser"),
    ('{"reasoning_start_str": 3}', "reasoning_config.reasoning_start_str"),
])
def test_bad_reasoning_config_is_refused_naming_the_key(qwen3_model_dir, value, key):
    with pytest.raises(ConfigError) as e:
        _settings(qwen3_model_dir, "--reasoning-config", value)
    assert e.value.key == key


def test_reasoning_parser_is_the_configs_parser(qwen3_model_dir):
    args = _settings(qwen3_model_dir, "--reasoning-parser", "deepseek_r1", "--reasoning-config",
                     '{"reasoning_parser": "qwen3", "reasoning_end_str": "ok</think>"}')[0]
    assert args.reasoning_config == {"reasoning_parser": "deepseek_r1",
                                     "reasoning_start_str": "", "reasoning_end_str": "ok</think>"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen3_model_dir, template):
    yield from served(tmp_path_factory.mktemp("budget"), qwen3_model_dir,
                      "--reasoning-parser", "qwen3", "--chat-template", template,
                      "--reasoning-config", '{"reasoning_end_str": "Time is up.\\n</think>"}',
                      "--anthropic-disabled-thinking-effort", "low", "--max-model-len", "2048")


def _split(chunks):
    reasoning, content = "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    return reasoning, content


def test_server_chat_and_completions(server, hf):
    """Over the real server (async scheduling: the budget's forcing waits for the step in
    flight): the reasoning is the budget's tokens and the end text up to </think>, the rest
    content, whole and streamed; completions take the budget too; beam search refuses it."""
    tok, prompt, forced = hf
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    expected = forced(prompt, 3, _ids(tok, TIME_UP), 16)
    at = expected.index(_ids(tok, "</think>")[0])
    kw = dict(model="tiny", messages=ASK, max_tokens=16, temperature=0,
              extra_body={"thinking_token_budget": 4, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].model_extra["token_ids"] == expected
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] == tok.decode(expected[:at])
    assert msg.model_extra["reasoning"].endswith("Time is up.\n")
    assert msg.content == tok.decode(expected[at + 1:])
    assert r.usage.completion_tokens_details.reasoning_tokens == at
    assert _split(client.chat.completions.create(**kw, stream=True)) == \
        (msg.model_extra["reasoning"], msg.content)

    two = client.chat.completions.create(**{**kw, "temperature": 1, "seed": 5, "n": 2,
                                            "extra_body": {**kw["extra_body"],
                                                           "ignore_eos": True}})
    for choice in two.choices:      # each sequence has its own budget
        assert choice.model_extra["token_ids"][3:10] == expected[3:10]

    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                  temperature=0, extra_body={"thinking_token_budget": 4})
    assert c.choices[0].text == tok.decode(expected)

    body = {"model": "tiny", "messages": ASK, "use_beam_search": True, "n": 2,
            "thinking_token_budget": 4}
    bad = requests.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
    body = {"model": "tiny", "messages": ASK, "thinking_token_budget": -2}
    bad = requests.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"


def _blocks(message):
    """A message's blocks as (type, text) (a thinking block's signature is its own)."""
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_server_anthropic_budget_tokens(server, hf):
    """/v1/messages thinking enabled: budget_tokens is the chat route's thinking_token_budget
    (a thinking block of the reasoning, then a text block of the content), streamed the same;
    budget_tokens below 1024, missing, or not below max_tokens is a 400 naming it, as vLLM's;
    thinking disabled is reasoning_effort low under --anthropic-disabled-thinking-effort low
    (the template still opens <think>: a thinking block)."""
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)
    chat = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", max_tokens=1040, messages=ASK)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    ref = chat.chat.completions.create(**kw, temperature=0, extra_body={
        "thinking_token_budget": 1024, "return_token_ids": True})
    ids = ref.choices[0].model_extra["token_ids"]
    assert ids[1023:1030] == _ids(hf[0], TIME_UP)
    msg = client.messages.create(**kw, thinking=thinking, extra_body={"temperature": 0})
    assert _blocks(msg) == [("thinking", ref.choices[0].message.model_extra["reasoning"]),
                            ("text", ref.choices[0].message.content)]
    with client.messages.stream(**kw, thinking=thinking, extra_body={"temperature": 0}) as s:
        assert _blocks(s.get_final_message()) == _blocks(msg)

    for budget, named in ((1000, "thinking.budget_tokens"), (1040, "thinking.budget_tokens"),
                          (None, "thinking.budget_tokens")):
        body = {**kw, "thinking": {"type": "enabled", "budget_tokens": budget}}
        if budget is None:
            del body["thinking"]["budget_tokens"]
        r = requests.post(server + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(named), r.text

    short = dict(model="tiny", max_tokens=8, messages=ASK, extra_body={"temperature": 0})
    off = client.messages.create(**short, thinking={"type": "disabled"})
    assert _blocks(off) == _blocks(client.messages.create(**short))
    assert [b.type for b in off.content] == ["thinking"]
