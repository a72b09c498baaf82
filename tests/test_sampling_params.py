"""SamplingParams: vLLM's names and defaults, normalization, and validation that names the field."""
import math
import re

import pytest

from llm_serving.outputs import CompletionOutput, Logprob, RequestOutput
from llm_serving.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.max_tokens, p.min_tokens) == (False, 16, 0)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens) == (True, True)
    assert (p.include_stop_str_in_output, p.detokenize) == (False, True)


def test_keyword_names_are_vllms():
    p = SamplingParams(n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                       temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3, stop="###",
                       stop_token_ids=[7], ignore_eos=True, max_tokens=100, min_tokens=5,
                       logprobs=5, prompt_logprobs=1, skip_special_tokens=False,
                       spaces_between_special_tokens=False, include_stop_str_in_output=True,
                       detokenize=True)   # False with stop: refused, as vLLM
    assert p.top_k == 40 and p.stop == ["###"] and p.max_tokens == 100


def test_normalization():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_greedy_resets_filters_and_reports_its_type():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams().sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=0).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=5)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


def test_output_text_buffer_length():
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0


@pytest.mark.parametrize("kwargs, field, allowed", [
    (dict(n=0), "n", ">= 1"),
    (dict(n=1.5), "n", "integer"),
    (dict(temperature=-1), "temperature", ">= 0"),
    (dict(temperature=math.nan), "temperature", ">= 0"),
    (dict(temperature=math.inf), "temperature", ">= 0"),
    (dict(temperature="hot"), "temperature", "number"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.01), "top_p", "(0, 1]"),
    (dict(top_k=-2), "top_k", ">= 1"),
    (dict(top_k=2.5), "top_k", "integer"),
    (dict(min_p=-0.1), "min_p", "[0, 1]"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty", "> 0"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(presence_penalty=-2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    (dict(frequency_penalty=math.nan), "frequency_penalty", "[-2, 2]"),
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens", "<= max_tokens"),
    (dict(logprobs=-2), "logprobs", ">= 0, -1"),
    (dict(prompt_logprobs=-2), "prompt_logprobs", ">= 0, -1"),
    (dict(seed="abc"), "seed", "integer"),
    (dict(stop=[""]), "stop", "empty"),
    (dict(stop=[1]), "stop", "string"),
    (dict(stop=[f"s{i}" for i in range(101)]), "stop", "at most 100 strings"),
    (dict(stop=["x" * 2049, "y" * 2048]), "stop", "at most 4096 characters"),
    (dict(stop_token_ids=list(range(101))), "stop_token_ids", "at most 100 ids"),
    (dict(bad_words=[f"w{i}" for i in range(101)]), "bad_words", "at most 100 words"),
    (dict(bad_words=["x" * 2049, "y" * 2048]), "bad_words", "at most 4096 characters"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", ">= 0"),
    (dict(stop_token_ids=["a"]), "stop_token_ids", ">= 0"),
    (dict(ignore_eos="yes"), "ignore_eos", "True or False"),
])
def test_invalid_values_name_the_field_and_the_allowed_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(field + " "), message
    assert allowed in message, message


def test_error_message_shows_the_bad_value():
    with pytest.raises(ValueError, match=re.escape("temperature must be >= 0, got -1.0")):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("kwargs", [
    dict(top_p=1.0), dict(top_p=1e-3), dict(min_p=0.0), dict(min_p=1.0), dict(top_k=1),
    dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=0.01),
    dict(logprobs=0), dict(logprobs=20), dict(prompt_logprobs=0), dict(seed=-7),
    dict(min_tokens=16, max_tokens=16), dict(temperature=0.0), dict(temperature=5.0),
    dict(stop=[f"s{i:03}" for i in range(100)]), dict(stop=["x" * 4096]),
    dict(stop_token_ids=list(range(100))),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_request_output_is_vllm_shaped():
    lp = {5: Logprob(logprob=-0.1, rank=1, decoded_token="hi")}
    c = CompletionOutput(index=0, text="hi", token_ids=[5], cumulative_logprob=-0.1,
                         logprobs=[lp], finish_reason="length", stop_reason=None)
    r = RequestOutput(request_id="r0", prompt="say", prompt_token_ids=[1, 2], outputs=[c],
                      finished=True)
    assert c.finished() and r.outputs[0].text == "hi" and r.prompt_logprobs is None
    assert not CompletionOutput(0, "", [], None, None).finished()
    assert "text='hi'" in repr(c) and "request_id='r0'" in repr(r)


# vLLM 0.32's SamplingParams keywords beyond the ones above, each at its default: a vLLM
# script that spells them out runs here unchanged.
VLLM_0_32_DEFAULTS = dict(
    watermarking=None, prompt_logprob_token_ids=None, prompt_logprob_start=None,
    logprob_token_ids=None, flat_logprobs=False, stream_interval=None, skip_clone=False,
    extra_args=None, skip_reading_prefix_cache=None, thinking_token_budget=None,
    repetition_detection=None, routed_experts_prompt_start=0, trace_decode_token_ids=None,
    output_kind=RequestOutputKind.CUMULATIVE, structured_outputs=None, logit_bias=None,
    allowed_token_ids=None, bad_words=None)


def test_every_vllm_0_32_keyword_is_taken_at_its_default():
    p = SamplingParams(**VLLM_0_32_DEFAULTS)
    assert p.kv_transfer_params is None and p.repetition_detection is None
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None   # unlimited


@pytest.mark.parametrize("name, value, named", [
    ("watermarking", True, "watermarking"), ("flat_logprobs", True, "flat_logprobs"),
    ("thinking_token_budget", -2, "thinking_token_budget"),
    ("thinking_token_budget", 1.5, "thinking_token_budget"),
    ("prompt_logprob_token_ids", [[1, 2]], "prompt_logprob_token_ids"),
    ("prompt_logprob_start", 2, "prompt_logprob_start"),
    ("routed_experts_prompt_start", 3, "routed_experts_prompt_start"),
    ("trace_decode_token_ids", [5], "trace_decode_token_ids"),
    ("repetition_detection", {"max_pattern_size": 2, "min_count": 1}, "min_count"),
    ("repetition_detection", {"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 3},
     "min_pattern_size <= max_pattern_size"),
])
def test_vllm_keywords_this_engine_cannot_honour_are_refused_by_name(name, value, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        SamplingParams(**{name: value})


def test_extra_args_kv_transfer_params_asks_for_pd_as_vllm_0_32_does():
    offer = {"do_remote_decode": True}
    assert SamplingParams(extra_args={"kv_transfer_params": offer}).kv_transfer_params == offer
    with pytest.raises(ValueError, match="differs from kv_transfer_params"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True},
                       extra_args={"kv_transfer_params": offer})


def _repeats_by_definition(ids, largest, smallest, count) -> bool:
    """vLLM's definition, spelled out: for some pattern size L, the last L*count tokens are
    the last L tokens count times over."""
    for size in range(max(smallest, 1), largest + 1):
        if size * count > len(ids):
            return False
        tail = ids[-size * count:]
        if all(tail[i] == tail[i % size + (count - 1) * size] for i in range(len(tail))):
            return True
    return False


def test_repetition_detection_finds_exactly_the_repeats_vllm_defines():
    import random
    from llm_serving.sampling_params import RepetitionDetectionParams
    rng = random.Random(5)
    found = 0
    for _ in range(3000):
        largest, count = rng.randint(1, 4), rng.randint(2, 4)
        smallest = rng.randint(0, largest)
        ids = [rng.randint(0, 2) for _ in range(rng.randint(0, 14))]
        got = RepetitionDetectionParams(largest, smallest, count).repeats(ids)
        assert got == _repeats_by_definition(ids, largest, smallest, count), (ids, largest,
                                                                            smallest, count)
        found += got
    assert 100 < found < 2900          # both answers were exercised
