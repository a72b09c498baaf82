"""vLLM's cache_salt: a salted request reuses prefix-cache blocks only of requests with the
same salt (the usage's cached_tokens over a real server, on completions, chat, the Responses
API and Anthropic's Messages API; RequestOutput.num_cached_tokens offline, beam search's
steps included), and a salt vLLM refuses is a 400 naming it."""
from __future__ import annotations

import anthropic
import openai
import pytest
import requests

from llm_serving import LLM, BeamSearchParams, SamplingParams
from test_http_server import free_port, serve_model, stop_server

TEXT = "Hello there, what is a prefix cache for? " * 4


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    proc, url = serve_model(tiny_model_dir, "--enable-prompt-tokens-details",
                            "--served-model-name", "x", port=free_port(), num_blocks=64)
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


def test_completions_share_blocks_only_within_a_salt(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompt = list(range(700, 740))          # two full blocks of 16, and 8 tokens

    def cached(salt):
        return client.completions.create(
            model="x", prompt=prompt, max_tokens=1, temperature=0,
            extra_body={"cache_salt": salt} if salt else None
        ).usage.prompt_tokens_details.cached_tokens
    assert [cached(s) for s in (None, "tenant-a", "tenant-a", "tenant-b", None, "tenant-b")] \
        == [0, 0, 32, 0, 32, 32]


def test_chat_responses_and_messages_take_it(url):
    chat = openai.OpenAI(base_url=url + "/v1", api_key="none").chat.completions
    first, again, other = (chat.create(
        model="x", messages=[{"role": "user", "content": TEXT}], max_tokens=1,
        extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens
        for salt in ("t", "t", "t2"))
    assert first == 0 and again > 0 and other == 0

    def responses(salt):
        r = requests.post(url + "/v1/responses", json={"model": "x", "input": TEXT + "!",
                                                       "max_output_tokens": 1,
                                                       "cache_salt": salt}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert responses("u") == 0 and responses("u") > 0 and responses("u2") == 0
    messages = anthropic.Anthropic(base_url=url, api_key="none").messages

    def claude(salt):
        return messages.create(model="x", max_tokens=1, extra_body={"cache_salt": salt},
                               messages=[{"role": "user", "content": TEXT + "?"}]
                               ).usage.cache_read_input_tokens
    assert claude("v") == 0 and claude("v") > 0 and claude("v2") == 0


@pytest.mark.parametrize("salt", ["", "a/b", "x@y", "a\\b", "x" * 129, 7])
def test_a_salt_vllm_refuses_is_a_400_naming_it(url, salt):
    for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}]}),
                        ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        r = requests.post(url + route, json={**body, "model": "x", "cache_salt": salt},
                          timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "cache_salt", (route, r.text)
        assert err["message"].startswith("cache_salt: must "), err
    assert requests.post(url + "/v1/completions", json={
        "model": "x", "prompt": "hi", "max_tokens": 1, "cache_salt": "x" * 128},
        timeout=30).status_code == 200


def test_offline_prompt_dicts_and_beam_search_take_it(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=64)
    p = list(range(300, 340))
    params = SamplingParams(max_tokens=1, temperature=0)

    def cached(**salt):
        return llm.generate([{"prompt_token_ids": p, **salt}], params)[0].num_cached_tokens
    assert [cached(), cached(cache_salt="a"), cached(cache_salt="a"), cached()] == [0, 0, 32, 32]
    text = llm.generate([{"prompt": TEXT, "cache_salt": "b"}], params)[0]
    assert llm.generate([{"prompt": TEXT, "cache_salt": "b"}], params)[0].num_cached_tokens \
        == (len(text.prompt_token_ids) - 1) // 16 * 16
    # beam search's steps keep the prompt's salt: its blocks are that salt's
    q = list(range(400, 433))
    llm.beam_search([{"prompt_token_ids": q, "cache_salt": "c"}],
                    BeamSearchParams(beam_width=2, max_tokens=2))
    assert llm.generate([{"prompt_token_ids": q, "cache_salt": "d"}],
                        params)[0].num_cached_tokens == 0
    assert llm.generate([{"prompt_token_ids": q, "cache_salt": "c"}],
                        params)[0].num_cached_tokens == 32
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": p, "cache_salt": ""}], params)
