"""The offline API as a vLLM user calls it, and the errors a user gets for bad input."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from llm_serving import SamplingParams
from llm_serving.errors import ConfigError, ModelLoadError

ROOT = Path(__file__).resolve().parents[1]


def test_generate_accepts_strings_and_token_ids(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text_out, ids_out = tiny_llm.generate(
        ["Give three tips for staying healthy.",
         {"prompt_token_ids": tok.encode("Give three tips for staying healthy.")}], params)
    assert text_out.prompt == "Give three tips for staying healthy."
    assert text_out.prompt_token_ids == ids_out.prompt_token_ids
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert len(text_out.outputs[0].token_ids) == 8
    assert text_out.outputs[0].finish_reason == "length"
    assert text_out.outputs[0].text == tok.decode(text_out.outputs[0].token_ids,
                                                      skip_special_tokens=True)


def test_n_greater_than_one_returns_n_seeded_samples(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = tiny_llm.generate("Hello", params)[0]
    b = tiny_llm.generate("Hello", params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_seeded_request_is_independent_of_batch_companions(tiny_llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate("Tell me a story", params)[0].outputs[0].token_ids
    crowd = tiny_llm.generate(["Other prompt", "Tell me a story", "x y z"],
                              [SamplingParams(temperature=1.0, max_tokens=20), params,
                               SamplingParams(temperature=0.5, max_tokens=5)])
    assert crowd[1].outputs[0].token_ids == alone


def test_logprobs_are_log_probabilities_with_alternatives(tiny_llm):
    out = tiny_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        assert entry[token].rank == 1            # greedy picks the most likely token
        assert entry[token].logprob <= 0.0
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert len(top) == 3
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        assert sum(math.exp(lp.logprob) for lp in top) <= 1.0 + 1e-5
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_stop_strings_and_stop_token_ids(tiny_llm):
    base = tiny_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=24,
                                                     ignore_eos=True))[0].outputs[0]
    # A stop string taken from the middle of the greedy text ends generation there.
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    out = tiny_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                    ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    tid = base.token_ids[5]
    out = tiny_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=24,
                                                    stop_token_ids=[tid], ignore_eos=True))[0]
    first = base.token_ids.index(tid)
    tok = tiny_llm.get_tokenizer()
    assert out.outputs[0].token_ids == base.token_ids[:first + 1]
    assert out.outputs[0].stop_reason == tid
    # The stop id's text is left out, as vLLM does, unless include_stop_str_in_output (and,
    # as vLLM, the bytes of a character the stop cut off: here the text ends in one).
    before = tok.decode(base.token_ids[:first], skip_special_tokens=True)
    assert before.endswith("\ufffd")
    assert out.outputs[0].text == before.rstrip("\ufffd")
    out = tiny_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=24,
                                                    stop_token_ids=[tid], ignore_eos=True,
                                                    include_stop_str_in_output=True))[0]
    assert out.outputs[0].text == tok.decode(base.token_ids[:first + 1],
                                             skip_special_tokens=True)


def test_stop_strings_count_only_after_min_tokens(tiny_llm):
    """vLLM's rule: a stop string that ends within the first min_tokens tokens' text does
    not stop the output; the first one that ends after it does."""
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True, min_tokens=10)
    base = tiny_llm.generate("Hello", SamplingParams(**greedy))[0].outputs[0]
    tok = tiny_llm.get_tokenizer()
    early = tok.decode(base.token_ids[:3])
    stop = early[-2:]
    assert stop.strip() and "\ufffd" not in early
    off = len(tok.decode(base.token_ids[:10]))
    assert base.text.index(stop) + len(stop) <= off      # it would stop within the first 10
    out = tiny_llm.generate("Hello", SamplingParams(**greedy, stop=[stop]))[0]
    later = base.text.find(stop, off - len(stop) + 1)
    if later == -1:
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].text == base.text
    else:
        assert out.outputs[0].stop_reason == stop
        assert out.outputs[0].text == base.text[:later]


def test_repetition_detection_ends_a_repeating_output(tiny_llm):
    """vLLM's repetition_detection: a logit bias makes the output one token over and over; a
    pattern of up to 2 tokens seen 4 times ends it ("repetition", stop_reason
    "repetition_detected"), not before min_tokens; the same request without it runs on."""
    from llm_serving.sampling_params import RepetitionDetectionParams
    base = dict(temperature=0.0, max_tokens=20, logit_bias={7: 100.0})
    rd = RepetitionDetectionParams(max_pattern_size=2, min_count=4)
    outs = tiny_llm.generate(["Hello"] * 3, [
        SamplingParams(**base, repetition_detection=rd),
        SamplingParams(**base, repetition_detection={"max_pattern_size": 2, "min_count": 4},
                       min_tokens=9),
        SamplingParams(**base)])
    got = [(o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].token_ids)
           for o in outs]
    assert got[0] == ("repetition", "repetition_detected", [7] * 4)
    assert got[1] == ("repetition", "repetition_detected", [7] * 9)
    assert got[2] == ("length", None, [7] * 20)


def test_skip_reading_prefix_cache_computes_the_whole_prompt(tiny_llm):
    """vLLM's skip_reading_prefix_cache: the second run of a prompt reuses its cached blocks,
    unless it asks not to; the output is the same either way."""
    prompt = {"prompt_token_ids": list(range(3, 3 + 70))}
    params = SamplingParams(temperature=0.0, max_tokens=3)
    first = tiny_llm.generate(prompt, params)[0]
    again = tiny_llm.generate(prompt, params)[0]
    fresh = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                     skip_reading_prefix_cache=True))[0]
    assert again.num_cached_tokens >= 64 and fresh.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_chat_uses_the_models_chat_template(tiny_llm):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    out = tiny_llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    tok = tiny_llm.get_tokenizer()
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert out.prompt_token_ids == expected
    assert expected.count(tok.bos_token_id) == 1
    assert len(out.outputs[0].token_ids) == 4


def test_an_assistant_turns_reasoning_reaches_the_chat_template(tiny_llm):
    """vLLM hands an assistant message's reasoning to the template as reasoning and
    reasoning_content (Qwen3's template renders the latter); before, it was dropped."""
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>"
                "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for key in ("reasoning", "reasoning_content"):
        msgs = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", key: "add them"},
                {"role": "user", "content": "3+3?"}]
        out = tiny_llm.chat(msgs, params, chat_template=template)[0]
        assert out.prompt == "user:2+2?|assistant:<think>add them</think>4|user:3+3?|", key
    with pytest.raises(ValueError, match="messages: reasoning is an assistant message's"):
        tiny_llm.chat([{"role": "user", "content": "hi", "reasoning": "x"}], params,
                      chat_template=template)


def test_bad_model_path_names_the_path(tmp_path):
    from llm_serving import LLM
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    from llm_serving import LLM
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLM(str(bad))


@pytest.mark.parametrize("kwargs, key", [({"block_size": 0}, "block_size"),
                                         ({"max_num_seqs": "many"}, "max_num_seqs"),
                                         ({"no_such_knob": 1}, "no_such_knob"),
                                         ({"enforce_eager": "yes"}, "enforce_eager"),
                                         ({"max_capture_batch": -1}, "max_capture_batch"),
                                         ({"override_generation_config": {"temprature": 1}},
                                          "override_generation_config"),
                                         ({"generation_config": "/no/such/dir"},
                                          "generation_config")])
def test_bad_engine_argument_names_the_key(tiny_model_dir, kwargs, key):
    from llm_serving import LLM
    with pytest.raises(ConfigError) as e:
        LLM(tiny_model_dir, **kwargs)
    assert e.value.key == key


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    """vLLM's --generation-config: the sampling keys of generation_config.json (others, such
    as eos_token_id, are not defaults), an override over them, max_new_tokens as max_tokens
    capped at the model length; "vllm" reads nothing; a bad value names the key."""
    from llm_serving.config import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 4], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
         "max_new_tokens": 5000}))
    got = generation_defaults(str(tmp_path), "auto", {"top_k": 20}, 4096)
    assert got == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 4096}
    assert generation_defaults(str(tmp_path), "vllm", None, 4096) == {}
    assert generation_defaults("/no/such/model", "auto", None, 4096) == {}
    assert SamplingParams(**got).top_k == 20
    with pytest.raises(ConfigError) as e:
        generation_defaults(str(tmp_path), "auto", {"temperature": 9}, 4096)
    assert e.value.key == "override_generation_config"


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_prompt_longer_than_model_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="maximum model length"):
        tiny_llm.generate({"prompt_token_ids": [5] * 5000}, SamplingParams(max_tokens=4))
    # The engine is still usable afterwards.
    assert tiny_llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs


def test_vllm_prompt_dicts_and_one_priority(tiny_llm):
    """A vLLM script passes TextPrompt / TokensPrompt dicts (imported from the package, as
    from vllm) and may give one priority for every prompt."""
    from llm_serving import TextPrompt, TokensPrompt
    tok = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain, text, ids = tiny_llm.generate(
        ["Hello there", TextPrompt(prompt="Hello there"),
         TokensPrompt(prompt_token_ids=tok.encode("Hello there"))], params, priority=0)
    assert text.prompt == plain.prompt == "Hello there"
    assert text.prompt_token_ids == plain.prompt_token_ids == ids.prompt_token_ids
    assert text.outputs[0].token_ids == plain.outputs[0].token_ids == ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="TextPrompt"):
        tiny_llm.generate({"text": "Hello"}, params)


def test_chat_takes_vllms_arguments(tiny_llm):
    """vLLM's LLM.chat arguments: use_tqdm third, OpenAI text parts, continue_final_message,
    tools and chat_template_kwargs (both reach the template)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    conv = [{"role": "user", "content": "Hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    plain = tiny_llm.chat(conv, params, False)[0]
    assert tiny_llm.chat(parts, params)[0].prompt == plain.prompt.replace("Hi there", "Hi\nthere")
    cont = tiny_llm.chat(conv + [{"role": "assistant", "content": "Well,"}], params,
                         add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("<|im_start|>assistant\nWell,")
    template = ("{% for m in messages %}{{ m['content'] }}|{% endfor %}"
                "{{ tools[0]['function']['name'] }}|{{ flavour }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = tiny_llm.chat(conv, params, chat_template=template, tools=tools,
                        chat_template_kwargs={"flavour": "plain"})[0]
    assert out.prompt == "Hi there|get_weather|plain"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tiny_llm.chat(conv, params, continue_final_message=True)


def test_vllm_arguments_without_effect_are_accepted_and_named(tiny_model_dir, caplog):
    """LLM(model, gpu_memory_utilization=0.9, trust_remote_code=True), as vLLM scripts write
    it, runs (with one warning naming what has no effect); a misspelt argument is refused."""
    from llm_serving import LLM
    with caplog.at_level("WARNING", logger="llm_serving.config"):
        llm = LLM(tiny_model_dir, num_blocks=64, gpu_memory_utilization=0.9,
                  trust_remote_code=True, disable_log_stats=True)
    warned = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(warned) == 1
    assert all(k in warned[0] for k in ("gpu_memory_utilization", "trust_remote_code"))
    assert "disable_log_stats" not in warned[0]         # it has one: get_metrics
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ConfigError) as e:
        LLM(tiny_model_dir, gpu_memory_utilisation=0.9)
    assert e.value.key == "gpu_memory_utilisation"


def test_detokenize_false_gives_ids_without_text(tiny_llm):
    """SamplingParams(detokenize=False), as vLLM: the same tokens, no text, logprobs' and
    prompt logprobs' decoded_token None; stop strings (matched on text) are refused."""
    kw = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with_text = tiny_llm.generate("Hello there", SamplingParams(**kw))[0]
    ids_only = tiny_llm.generate("Hello there", SamplingParams(detokenize=False, **kw))[0]
    out = ids_only.outputs[0]
    assert out.token_ids == with_text.outputs[0].token_ids and with_text.outputs[0].text
    assert out.text == ""
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    assert all(lp.decoded_token is None for entry in ids_only.prompt_logprobs[1:]
               for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(with_text.outputs[0].cumulative_logprob)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_output_cut_inside_a_character_drops_its_bytes(tiny_llm):
    """An output that ends inside a multi-byte character (max_tokens after some of its byte
    tokens) ends before it, as vLLM's: no trailing U+FFFD; those tokens are named ""."""
    tok = tiny_llm.get_tokenizer()
    lead = tok.encode("日", add_special_tokens=False)[0]      # a first byte of three
    assert tok.decode([lead]) == "\ufffd"
    params = SamplingParams(temperature=0.0, max_tokens=3, allowed_token_ids=[lead], logprobs=0)
    out = tiny_llm.generate("Hello", params)[0].outputs[0]
    assert out.token_ids == [lead] * 3 and out.finish_reason == "length"
    assert out.text == ""
    assert [entry[lead].decoded_token for entry in out.logprobs] == ["", "", ""]


def test_empty_prompt_is_the_bos_alone(tiny_llm):
    """generate("") as vLLM's: the prompt is the tokenizer's special tokens alone (the BOS),
    and generates; a prompt of no token ids at all is refused."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    bos = tiny_llm.get_tokenizer().bos_token_id
    empty, from_bos = tiny_llm.generate(["", {"prompt_token_ids": [bos]}], params)
    assert empty.prompt_token_ids == [bos]
    assert empty.outputs[0].token_ids == from_bos.outputs[0].token_ids
    assert len(empty.outputs[0].token_ids) == 4
    assert tiny_llm.generate({"prompt": ""}, params)[0].prompt_token_ids == [bos]
    with pytest.raises(ValueError, match="prompt: it is empty"):
        tiny_llm.generate({"prompt_token_ids": []}, params)


def test_llm_engine_as_vllm_scripts_use_it(tiny_llm, tiny_model_dir):
    """llm.llm_engine, vLLM's: the tokenizer, model_config and the add_request / step loop
    (request id first); an attribute it does not map is an AttributeError naming it."""
    eng = tiny_llm.llm_engine
    assert eng.get_tokenizer() is tiny_llm.get_tokenizer() is eng.tokenizer
    mc = eng.model_config
    hf = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert mc.max_model_len == tiny_llm.engine.max_model_len and mc.model == str(tiny_model_dir)
    assert mc.hf_config.num_hidden_layers == hf["num_hidden_layers"]
    assert mc.get_vocab_size() == hf["vocab_size"] and mc.dtype == "float32"
    assert mc.architecture == hf["architectures"][0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("a", "Hello", params)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert eng.get_num_unfinished_requests() == 0
    assert done["a"].outputs[0].token_ids == \
        tiny_llm.generate("Hello", params)[0].outputs[0].token_ids
    with pytest.raises(AttributeError, match="llm_engine.vllm_config"):
        eng.vllm_config
    with pytest.raises(AttributeError, match="model_config.hf_text_config"):
        mc.hf_text_config


def test_reset_prefix_cache(tiny_llm):
    """llm.reset_prefix_cache(), as vLLM's (its prefix-caching benchmarks call it between
    runs): a repeated prompt is served from the cache, and after a reset it is not."""
    prompt = {"prompt_token_ids": list(range(5, 5 + 40))}       # more than two 16-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    tiny_llm.generate(prompt, params)
    assert tiny_llm.generate(prompt, params)[0].num_cached_tokens >= 32
    assert tiny_llm.reset_prefix_cache() is True
    again = tiny_llm.generate(prompt, params)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == tiny_llm.generate(prompt, params)[0].outputs[0].token_ids


def test_dtype_takes_vllms_names(tiny_model_dir):
    """dtype="float" and torch.float32, as vLLM scripts write them, are float32; "half" is
    float16 (refused on CPU by that name)."""
    import torch
    from llm_serving import EngineArgs
    assert EngineArgs(model=tiny_model_dir, dtype="float").dtype == "float32"
    assert EngineArgs(model=tiny_model_dir, dtype=torch.float32).dtype == "float32"
    assert EngineArgs(model=tiny_model_dir, dtype=torch.bfloat16).dtype == "bfloat16"
    assert EngineArgs(model=tiny_model_dir, dtype="half").dtype == "float16"
    with pytest.raises(ConfigError, match="float64"):
        EngineArgs(model=tiny_model_dir, dtype=torch.float64)


def test_generate_takes_more_prompts_than_the_waiting_queue(tiny_model_dir):
    """vLLM's offline API takes any number of prompts; max_waiting_requests bounds the
    server's queue, not a generate() call: the prompts beyond it wait their turn."""
    from llm_serving import LLM
    llm = LLM(tiny_model_dir, num_blocks=64, max_waiting_requests=3, max_num_seqs=2)
    prompts = [f"Prompt number {i}" for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)
    assert outs[7].outputs[0].token_ids == llm.generate(prompts[7], params)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt"):       # checked before any runs
        llm.generate(prompts[:5] + [{"prompt_token_ids": []}], params)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("method, args", [("encode", ("Hello",)), ("embed", ("Hello",)),
                                          ("classify", ("Hello",)), ("reward", ("Hello",)),
                                          ("score", ("a", "b"))])
def test_pooling_methods_are_refused_by_name(tiny_llm, method, args):
    """vLLM's pooling methods exist and refuse with a ValueError naming the method, as vLLM
    does on a generative model, instead of an AttributeError that reads like a typo (embed
    serves a pooling runner: tests/test_embeddings.py)."""
    with pytest.raises(ValueError, match=f"LLM.{method}\\(\\) is for pooling models"):
        getattr(tiny_llm, method)(*args)


def test_the_builtin_model_by_name(tmp_path, monkeypatch):
    """LLM("builtin:tiny-llama"), as start.py's --model takes it: the built-in model is
    generated under LLM_SERVING_HOME on first use and served."""
    from llm_serving import LLM
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path))
    llm = LLM("builtin:tiny-llama", num_blocks=32)
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert (tmp_path / "models" / "tiny-llama" / "config.json").is_file()
    llm.engine.shutdown()


def test_lora_request_none_is_taken_as_vllm_takes_it(tiny_llm):
    """vLLM scripts pass lora_request=None (no adapter), by name or 4th in vLLM's order; an
    adapter without enable_lora is refused naming lora_request (tests/test_lora.py serves
    them)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain = tiny_llm.generate("Hello", params)[0].outputs[0].token_ids
    assert tiny_llm.generate("Hello", params, lora_request=None)[0].outputs[0].token_ids == plain
    assert tiny_llm.generate(["Hello"], params, False, None, [0])[0].outputs[0].token_ids == plain
    chat = [{"role": "user", "content": "Hi"}]
    assert tiny_llm.chat(chat, params, lora_request=None)[0].outputs[0].token_ids == \
        tiny_llm.chat(chat, params)[0].outputs[0].token_ids
    eng = tiny_llm.llm_engine         # vLLM's add_request: lora_request 5th, before priority
    eng.add_request("lora-none", "Hello", params, None, None)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert done["lora-none"].outputs[0].token_ids == plain
    for call in (lambda: tiny_llm.generate("Hello", params, lora_request=object()),
                 lambda: tiny_llm.chat(chat, params, lora_request=object()),
                 lambda: eng.add_request("lora", "Hello", params, lora_request=object())):
        with pytest.raises(ValueError, match="lora_request: LoRA adapters are served with "
                                             "enable_lora"):
            call()


def test_minus_one_logprobs_are_the_whole_vocabulary_under_max_logprobs_minus_one(
        tiny_model_dir, tiny_llm):
    """vLLM's -1: every token's logprob, generated and prompt; a server whose max_logprobs is
    not -1 refuses it naming max_logprobs."""
    from llm_serving import LLM
    with pytest.raises(ValueError, match=r"prompt_logprobs: .*-1.*max_logprobs \(20\)"):
        tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    llm = LLM(tiny_model_dir, max_logprobs=-1, num_blocks=16, max_num_seqs=2)
    vocab = llm.get_tokenizer().vocab_size
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(
        temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert out.prompt_logprobs[0] is None and len(entries) == 3 + 2
    for entry in entries:       # all of them: the probabilities sum to one
        assert len(entry) >= vocab
        lp = np.array([v.logprob for v in entry.values()])
        np.testing.assert_allclose(np.logaddexp.reduce(lp), 0.0, atol=1e-4)


def test_enqueue_then_wait_for_completion_runs_what_was_enqueued(tiny_model_dir, tiny_llm):
    """vLLM 0.32's enqueue / enqueue_chat / wait_for_completion: requests are checked when
    enqueued (a bad one raises then, and nothing runs), run together by wait_for_completion,
    and come back in the order enqueued with the outputs generate and chat give them;
    from_engine_args and get_world_size as vLLM's."""
    from llm_serving import LLM, EngineArgs
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    talk = [{"role": "user", "content": "Hi there"}]
    ids = tiny_llm.enqueue(["Hello", "Once upon"], greedy, use_tqdm=False)
    ids += tiny_llm.enqueue_chat(talk, greedy, use_tqdm=False)
    assert len(set(ids)) == 3
    with pytest.raises(ValueError, match="max_logprobs"):
        tiny_llm.enqueue(["x", "y"], [greedy, SamplingParams(logprobs=50)], use_tqdm=False)
    outs = tiny_llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    want = tiny_llm.generate(["Hello", "Once upon"], greedy) + tiny_llm.chat(talk, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    assert tiny_llm.wait_for_completion(use_tqdm=False) == []
    llm = LLM.from_engine_args(EngineArgs(tiny_model_dir, num_blocks=64))
    assert llm.get_world_size() == 1
    assert (llm.generate("Hello", greedy)[0].outputs[0].token_ids
            == want[0].outputs[0].token_ids)


def test_get_metrics_reads_the_engines_counts_as_vllms_classes(tiny_model_dir, tiny_llm):
    """vLLM's LLM(disable_log_stats=False).get_metrics(): counters, gauges, histograms and the
    accepted drafts per position (a Vector), which count what the requests did; later calls
    advance them; without the flag, a ValueError naming it."""
    from llm_serving import LLM
    from llm_serving.entrypoints.metrics_reader import Counter, Gauge, Histogram, Vector
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        tiny_llm.get_metrics()
    llm = LLM(tiny_model_dir, num_blocks=64, disable_log_stats=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_max": 2, "prompt_lookup_min": 1})

    def read():
        ms = llm.get_metrics()
        assert all(m.labels.get("model_name") == tiny_model_dir for m in ms
                   if m.name.startswith("vllm:") and "model_name" in m.labels)
        return {(type(m), m.name, m.labels.get("finished_reason")): m for m in ms}
    outs = llm.generate(["Hello", "Once upon a time there was"],
                        [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                         SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == 19
    m = read()
    assert m[Counter, "vllm:prompt_tokens", None].value == prompt
    assert m[Counter, "vllm:generation_tokens", None].value == generated
    assert m[Counter, "vllm:request_success", "length"].value == 2
    assert m[Counter, "vllm:request_success", "stop"].value == 0
    assert m[Gauge, "vllm:num_requests_running", None].value == 0
    e2e = m[Histogram, "vllm:e2e_request_latency_seconds", None]
    assert e2e.count == 2 and e2e.buckets["+Inf"] == 2 and e2e.sum > 0
    counts = list(e2e.buckets.values())
    assert counts == sorted(counts)             # cumulative, in bound order
    lengths = m[Histogram, "vllm:request_generation_tokens", None]
    assert (lengths.count, lengths.sum) == (2, generated)
    accepted = m[Vector, "vllm:spec_decode_num_accepted_tokens_per_pos", None]
    assert len(accepted.values) == 2
    assert sum(accepted.values) == m[Counter, "vllm:spec_decode_num_accepted_tokens", None].value
    llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    m = read()
    assert m[Counter, "vllm:generation_tokens", None].value == generated + 3
    assert m[Histogram, "vllm:e2e_request_latency_seconds", None].count == 3
