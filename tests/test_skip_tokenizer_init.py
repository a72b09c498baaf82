"""vLLM's --skip-tokenizer-init (LLM(skip_tokenizer_init=True)): token ids in, token ids out.
As vLLM 0.32 (checked side by side on the 97 M model): outputs carry no text, the greedy ids
are the ones served without the flag, stop strings never match, logprobs offline carry no
decoded tokens; text prompts, chat and get_tokenizer are refused, and on the server /tokenize,
/detokenize, chat, echo, logprobs and structured outputs too, each naming its field;
/v1/completions' return_token_ids gives the ids out."""
from __future__ import annotations

import pytest
import requests

from llm_serving import LLM, SamplingParams

IDS = [1, 450, 49, 300, 12]


def test_offline_token_ids_in_and_out(tiny_model_dir, tiny_llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = tiny_llm.generate([{"prompt_token_ids": IDS}], greedy)[0].outputs[0]
    assert want.text
    llm = LLM(tiny_model_dir, skip_tokenizer_init=True, num_blocks=64)
    out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, stop=[want.text[:2]], logprobs=1))[0]
    got = out.outputs[0]
    assert (got.text, list(got.token_ids), got.finish_reason) == \
        ("", list(want.token_ids), "length")
    assert all(lp.decoded_token is None for step in got.logprobs for lp in step.values())
    for call in (lambda: llm.generate(["Hello"]), lambda: llm.generate([{"prompt": "Hi"}]),
                 lambda: llm.chat([{"role": "user", "content": "hi"}]), llm.get_tokenizer):
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            call()


def test_server_takes_ids_and_returns_ids(tmp_path, tiny_model_dir, tiny_llm):
    from test_http_server import free_port, start_server, stop_server
    want = tiny_llm.generate([{"prompt_token_ids": IDS}], SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--skip-tokenizer-init",
                                agent_ports=(free_port(),))
    try:
        body = {"model": "tiny", "prompt": IDS, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        (choice,) = requests.post(url + "/v1/completions", json=body).json()["choices"]
        assert choice["text"] == "" and "token_ids" not in choice
        (choice,) = requests.post(url + "/v1/completions",
                                  json={**body, "return_token_ids": True}).json()["choices"]
        assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == \
            ("", list(want), IDS)
        refused = [("/v1/completions", {**body, "prompt": "Hello"}, "prompt"),
                   ("/v1/completions", {**body, "echo": True}, "echo"),
                   ("/v1/completions", {**body, "logprobs": 1}, "logprobs"),
                   ("/v1/completions", {**body, "use_beam_search": True, "n": 2},
                    "use_beam_search"),
                   ("/v1/completions", {**body, "response_format": {"type": "json_object"}},
                    "response_format"),
                   ("/v1/chat/completions", {"model": "tiny", "messages": [
                       {"role": "user", "content": "hi"}]}, "messages"),
                   ("/tokenize", {"prompt": "hi"}, "prompt"),
                   ("/detokenize", {"tokens": IDS}, "tokens")]
        for path, req, field in refused:
            r = requests.post(url + path, json=req)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)
            assert "skip_tokenizer_init" in r.json()["error"]["message"]
    finally:
        assert stop_server(proc) == 0
