"""vLLM's prompt embeddings (--enable-prompt-embeds): a prompt given as its input embeddings
generates what transformers generates from the same ``inputs_embeds`` (greedy tokens and their
logprobs), offline and on the server (base64 of torch.save, read without torch), in chunks,
after preemption, beside token prompts, through the prefix cache (keyed by the embeddings, not
the placeholder ids); bad embeddings and what vLLM refuses with them are 400s naming the field,
and the server goes on serving."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import requests

from conftest import hf_causal_lm
from llm_serving import LLM, EmbedsPrompt, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.errors import ConfigError
from llm_serving.sampling_params import BeamSearchParams

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.numpy")

NEW = 24


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Four prompts' embeddings (rows of the embedding table, nudged so that they are no
    token's), transformers' greedy tokens from them and those tokens' logprobs."""
    table = safetensors.load_file(f"{tiny_model_dir}/model.safetensors")[
        "model.embed_tokens.weight"]
    rng = np.random.default_rng(3)
    embeds = [(table[rng.integers(3, 1024, n)]
               + rng.normal(0, 0.01, (n, table.shape[1]))).astype(np.float32)
              for n in (1, 7, 40, 70)]
    model = hf_causal_lm(tiny_model_dir)
    return embeds, [_hf_greedy(model, e) for e in embeds]


def _hf_greedy(model, embeds: np.ndarray) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens from ``inputs_embeds`` and their logprobs."""
    x, ids, lps = torch.from_numpy(embeds)[None], [], []
    with torch.no_grad():
        for _ in range(NEW):
            logp = torch.log_softmax(model(inputs_embeds=x).logits[0, -1], -1)
            t = int(logp.argmax())
            ids.append(t)
            lps.append(float(logp[t]))
            x = torch.cat([x, model.get_input_embeddings()(torch.tensor([[t]]))], 1)
    return ids, lps


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, reference):
    """A prompt mixing token ids with two runs of embeddings (vLLM's mixed form: the rows of
    the whole prompt, token ids, and the mask of the positions whose token id is used), and
    transformers' greedy tokens from the same inputs_embeds."""
    table = safetensors.load_file(f"{tiny_model_dir}/model.safetensors")[
        "model.embed_tokens.weight"]
    ids = np.random.default_rng(5).integers(3, 1024, 60)
    full = table[ids].astype(np.float32)
    mask = np.ones(60, bool)
    for a, e in ((5, reference[0][1]), (19, reference[0][2][:30])):    # 7 and 30 rows
        full[a:a + len(e)], mask[a:a + len(e)] = e, False
    return ids.tolist(), mask, full, _hf_greedy(hf_causal_lm(tiny_model_dir), full)


GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


def _check(out, want):
    got = out.outputs[0]
    assert list(got.token_ids) == want[0]
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)],
                               want[1], atol=2e-4)


def test_offline_embeds_generate_as_transformers(tiny_model_dir, reference, mixed):
    embeds, want = reference
    # 16-token chunks and a pool small enough to preempt (and recompute) sequences
    llm = LLM(tiny_model_dir, enable_prompt_embeds=True, num_blocks=24, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=8, preemption_mode="recompute")
    prompts = [EmbedsPrompt(prompt_embeds=e) for e in embeds] + [
        {"prompt_embeds": torch.from_numpy(e)[None]} for e in embeds]
    outs = llm.generate(prompts + [{"prompt_token_ids": [1, 450, 49]}], GREEDY)
    for out, w, e in zip(outs, want * 2, embeds * 2):
        _check(out, w)
        assert out.prompt_token_ids == [0] * len(e) and out.prompt is None
    assert llm.engine.get_stats().num_preemptions > 0
    # the prefix cache: the same embeddings hit it, others of the same length do not
    again = llm.generate([{"prompt_embeds": embeds[3]}], GREEDY)[0]
    _check(again, want[3])
    assert again.num_cached_tokens > 0
    other = llm.generate([{"prompt_embeds": embeds[3][::-1].copy()}], GREEDY)[0]
    assert other.num_cached_tokens == 0
    for bad, field in ((np.zeros((3, 5), np.float32), "hidden size 5"),
                       (np.zeros((2, 3, 64), np.float32), "2-D"),
                       (np.zeros((0, 64), np.float32), "empty"),
                       (np.zeros((3, 64), np.int64), "floating-point"),
                       (np.full((3, 64), np.nan, np.float32), "not finite")):
        with pytest.raises(ValueError, match=f"prompt_embeds: .*{field}"):
            llm.generate([{"prompt_embeds": bad}], GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([{"prompt_embeds": embeds[0]}], SamplingParams(prompt_logprobs=1))
    # vLLM's mixed form: its chunks cut through both runs of embeddings; the prefix cache
    # holds its blocks, and one row changed misses from its block on
    ids, mask, full, want_mixed = mixed
    prompt = {"prompt_embeds": full, "prompt_token_ids": ids, "prompt_is_token_ids": mask}
    outs = llm.generate([prompt, prompt], GREEDY)
    for out in outs:
        _check(out, want_mixed)
        assert out.prompt_token_ids == [t if m else 0 for t, m in zip(ids, mask)]
    nudged = full.copy()
    nudged[30] += 0.5
    again, other = llm.generate([prompt, {**prompt, "prompt_embeds": nudged}], GREEDY)
    _check(again, want_mixed)
    assert again.num_cached_tokens == 56 and other.num_cached_tokens == 24
    for extra, field in (({"prompt_is_token_ids": mask[1:]}, "prompt_is_token_ids"),
                         ({"prompt_is_token_ids": None}, "prompt_is_token_ids")):
        bad = {k: v for k, v in {**prompt, **extra}.items() if v is not None}
        with pytest.raises(ValueError, match=field):
            llm.generate([bad], GREEDY)


def test_tensor_parallel_ranks_take_the_embeddings(tiny_model_dir, reference):
    """Two ranks: each sums its vocabulary shard's gathers, then sets the embedded rows."""
    embeds, want = reference
    llm = LLM(tiny_model_dir, enable_prompt_embeds=True, tensor_parallel_size=2,
              num_blocks=64, max_num_batched_tokens=32)
    try:
        outs = llm.generate([{"prompt_embeds": e} for e in embeds[1:3]], GREEDY)
    finally:
        llm.engine.shutdown()
    for out, w in zip(outs, want[1:3]):
        _check(out, w)


def test_offline_embeds_need_the_flag(tiny_model_dir, tiny_llm, reference):
    with pytest.raises(ValueError, match="prompt_embeds: .*--enable-prompt-embeds"):
        tiny_llm.generate([{"prompt_embeds": reference[0][0]}], GREEDY)
    with pytest.raises(ValueError, match="prompt_embeds: beam search"):
        tiny_llm.beam_search([{"prompt_embeds": reference[0][0]}],
                             BeamSearchParams(beam_width=2, max_tokens=2))
    for other in ({"runner": "pooling"},
                  {"kv_transfer_config": {"kv_connector": "InProcessConnector",
                                          "kv_role": "kv_both"}}):
        with pytest.raises(ConfigError, match="enable_prompt_embeds: not with"):
            EngineArgs(tiny_model_dir, enable_prompt_embeds=True,
                       **other).create_engine_config()


def _b64(t) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_server_embeds_generate_as_transformers(tmp_path, tiny_model_dir, reference):
    from test_http_server import free_port, start_server, stop_server
    embeds, want = reference
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--enable-prompt-embeds",
                                agent_ports=(free_port(),))
    try:
        body = {"model": "tiny", "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_token_ids": True}
        # a list of embeddings and a text prompt: one choice each, the embeddings first
        r = requests.post(url + "/v1/completions", json={
            **body, "prompt_embeds": [_b64(torch.from_numpy(e)) for e in embeds[1:3]]
            + [_b64(torch.from_numpy(embeds[3]).bfloat16()[None])],
            "prompt": "Hello"})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 4
        for c, w, e in zip(choices, want[1:3], embeds[1:3]):
            assert c["token_ids"] == w[0] and c["prompt_token_ids"] == [0] * len(e)
            np.testing.assert_allclose(c["logprobs"]["token_logprobs"], w[1], atol=2e-4)
        assert r.json()["usage"]["prompt_tokens"] == 7 + 40 + 70 + len(
            choices[3]["prompt_token_ids"])
        one = _b64(torch.from_numpy(embeds[0]))
        refused = [({"prompt_embeds": _b64(torch.zeros(3, 5))}, "prompt_embeds"),
                   ({"prompt_embeds": _b64(torch.zeros(2, 3, 64))}, "prompt_embeds"),
                   ({"prompt_embeds": _b64(torch.zeros(0, 64))}, "prompt_embeds"),
                   ({"prompt_embeds": _b64(torch.zeros(1024, 64))}, "prompt_embeds"),
                   ({"prompt_embeds": _b64(torch.ones(3, 64, dtype=torch.int32))},
                    "prompt_embeds"),
                   ({"prompt_embeds": _b64({"t": torch.ones(3, 64)})}, "prompt_embeds"),
                   ({"prompt_embeds": "not base64!"}, "prompt_embeds"),
                   ({"prompt_embeds": base64.b64encode(b"hello").decode()}, "prompt_embeds"),
                   ({"prompt_embeds": []}, "prompt_embeds"),
                   ({"prompt_embeds": one, "echo": True}, "echo"),
                   ({"prompt_embeds": one, "prompt_logprobs": 1}, "prompt_logprobs"),
                   ({"prompt_embeds": one, "use_beam_search": True, "n": 2},
                    "use_beam_search"),
                   ({}, "prompt")]
        for extra, field in refused:
            r = requests.post(url + "/v1/completions", json={**body, **extra})
            assert r.status_code == 400, (extra.keys(), r.text)
            assert r.json()["error"]["param"] == field, r.text
        _chat_mixes_text_and_embeds(url, tiny_model_dir, body)
        # truncate_prompt_tokens cuts the rows as it cuts tokens (vLLM's)
        cut = requests.post(url + "/v1/completions", json={
            **body, "prompt_embeds": _b64(torch.from_numpy(embeds[2])),
            "truncate_prompt_tokens": 7}).json()
        last = requests.post(url + "/v1/completions", json={
            **body, "prompt_embeds": _b64(torch.from_numpy(embeds[2][-7:]))}).json()
        assert cut["usage"]["prompt_tokens"] == 7
        assert cut["choices"][0]["token_ids"] == last["choices"][0]["token_ids"]
        r = requests.post(url + "/v1/completions", json={**body, "prompt_embeds": one})
        assert r.json()["choices"][0]["token_ids"] == want[0][0]
    finally:
        stop_server(proc)


def _chat_mixes_text_and_embeds(url: str, model_dir: str, body: dict) -> None:
    """A chat message of text parts around a prompt_embeds part (vLLM's): the part's rows
    (the model's own embedding rows of a text) stand where the part does in the template's
    text, and the answer is transformers' from those inputs_embeds; what is not taken with
    such parts is refused by name."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    table = safetensors.load_file(f"{model_dir}/model.safetensors")[
        "model.embed_tokens.weight"]
    rows = table[tok("a red fox jumps", add_special_tokens=False).input_ids]
    text = tok.apply_chat_template([{"role": "user", "content":
                                     "Describe this:\n<prompt_embeds>\nin a word."}],
                                   tokenize=False, add_generation_prompt=True)
    before, after = (tok(t, add_special_tokens=False).input_ids
                     for t in text.split("<prompt_embeds>"))
    want = _hf_greedy(hf_causal_lm(model_dir),
                      np.concatenate([table[before], rows, table[after]]).astype(np.float32))
    part = {"type": "prompt_embeds", "data": _b64(torch.from_numpy(rows))}
    chat = {**body, "logprobs": True, "top_logprobs": 0, "messages": [{"role": "user",
            "content": [{"type": "text", "text": "Describe this:"}, part,
                        {"type": "text", "text": "in a word."}]}]}
    r = requests.post(url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["token_ids"] == want[0]
    np.testing.assert_allclose([e["logprob"] for e in got["choices"][0]["logprobs"]["content"]],
                               want[1], atol=2e-4)
    assert got["prompt_token_ids"] == before + [0] * len(rows) + after
    assert got["usage"]["prompt_tokens"] == len(before) + len(rows) + len(after)
    # the rows of a text's tokens answer as that text does
    same = requests.post(url + "/v1/chat/completions", json={**chat, "messages": [
        {"role": "user", "content": "Describe this:\na red fox jumps\nin a word."}]}).json()
    assert same["choices"][0]["token_ids"] == want[0]
    # streamed with two choices (openai's client): each streams the same greedy answer
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    texts = {0: "", 1: ""}
    for c in client.chat.completions.create(
            model=body["model"], messages=chat["messages"], n=2, stream=True,
            max_tokens=body["max_tokens"], temperature=0, extra_body={"ignore_eos": True}):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] == got["choices"][0]["message"]["content"] != ""
    text_part = {"type": "text", "text": "x"}
    for extra, content, field in (
            ({"echo": True}, [part], "echo"),
            ({"truncate_prompt_tokens": 5}, [part], "truncate_prompt_tokens"),
            ({}, [{"type": "text", "text": "<prompt_embeds>"}, part], "messages"),
            ({}, [text_part, {"type": "prompt_embeds"}], "prompt_embeds"),
            ({}, [text_part, {"type": "prompt_embeds", "data": "not base64!"}],
             "prompt_embeds"),
            ({}, [{"type": "prompt_embeds", "data": _b64(torch.zeros(3, 5))}],
             "prompt_embeds")):
        r = requests.post(url + "/v1/chat/completions", json={
            **chat, **extra, "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    # /tokenize renders no embeddings: the part is refused there
    r = requests.post(url + "/tokenize", json={"model": "tiny", "messages": [
        {"role": "user", "content": [part]}]})
    assert r.status_code == 400 and "prompt_embeds" in r.json()["error"]["message"]
