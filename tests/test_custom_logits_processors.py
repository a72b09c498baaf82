"""vLLM's custom logits processors (``logits_processors``) and per-request ``extra_args`` /
``vllm_xargs``: the processors of tests/custom_logits_processors.py, written as vLLM's docs
write them, run offline with LLM(...) and over a real server with the openai client. Requests
that do not ask for a processor are checked against transformers' greedy tokens."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests

import custom_logits_processors as procs
from conftest import hf_causal_lm
from llm_serving import LLM, EngineArgs, SamplingParams
from llm_serving.errors import ConfigError, LogitsProcessorError
from llm_serving.executor.launch_plan import plan_launch
from llm_serving.sample.batch_update import PersistentBatch
from llm_serving.sample.custom_logits_processors import (CustomLogitsProcessors,
                                                         vllm_config_view)
from llm_serving.sample.logits_processor import process_dict_updates
from test_http_server import ROOT, free_port, serve_model, stop_server

V = 1024                    # the tiny model's vocabulary
TESTS = str(ROOT / "tests")
PROMPTS = [np.random.default_rng(s).integers(3, V, 20).tolist() for s in range(12)]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """transformers' greedy continuation of a prompt (the reference of unaffected rows) and
    its first-step logits."""
    model = hf_causal_lm(tiny_model_dir)
    import torch

    def logits(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].numpy()

    def greedy(ids, n):
        out = []
        for _ in range(n):
            out.append(int(logits(ids + out).argmax()))
        return out
    return greedy, logits


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """Few KV blocks and four rows: twelve requests wait, join and get preempted."""
    return LLM(tiny_model_dir, num_blocks=10, block_size=16, max_model_len=128, max_num_seqs=4,
               logits_processors=[procs.TargetTokenProcessor, procs.CountingProcessor,
                                  "custom_logits_processors:TopOnlyProcessor",
                                  procs.BannedTokenAdapter, procs.FailingProcessor])


def _ids(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_batch_updates_take_every_row_to_its_request_in_any_reordering():
    """Random batches (requests leaving, joining and reordered): a processor that keeps
    row -> request through the updates, as vLLM's contract says, ends with this step's
    rows; no row is both removed and added (vLLM's own helper handles added first), and
    every row named is below the larger of the two batches."""
    rng = np.random.default_rng(0)
    batch, state, live, next_key, kinds = PersistentBatch(), {}, [], 0, set()
    for _ in range(400):
        keep = [k for k in live if rng.random() < 0.8]
        new = list(range(next_key, next_key + int(rng.integers(0, 4))))
        next_key += len(new)
        live = list(rng.permutation(keep + new)) if rng.random() < 0.5 else keep + new
        live = [int(k) for k in live[:8]]
        old_size = len(batch.keys)
        update = batch.update(live, {k: (k, [], []) for k in new})
        if update is None:
            assert live == batch.keys
            continue
        rows = [*update.removed, *(a[0] for a in update.added),
                *(m[i] for m in update.moved for i in (0, 1))]
        assert all(0 <= r < max(old_size, len(live)) for r in rows)
        assert not set(update.removed) & {a[0] for a in update.added}
        assert update.batch_size == len(live)
        process_dict_updates(state, update, lambda params, _p, _o: params)
        assert state == dict(enumerate(live))
        kinds.update(m[2].name for m in update.moved)
    assert kinds == {"UNIDIRECTIONAL", "SWAP"}


def test_a_target_token_is_forced_exactly_for_the_requests_that_ask(llm, hf):
    greedy, _ = hf
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args={"target_token": 77} if i % 2 else None)
              for i in range(4)]
    outs = _ids(llm, PROMPTS[:4], params)
    for i, out in enumerate(outs):
        assert out == ([77] * 6 if i % 2 else greedy(PROMPTS[i], 6)), i
    # n > 1: each sequence is a row of its own, from the first token on
    two = llm.generate({"prompt_token_ids": PROMPTS[4]}, SamplingParams(
        n=2, temperature=1.0, max_tokens=3, extra_args={"target_token": 5}), use_tqdm=False)
    assert [c.token_ids for c in two[0].outputs] == [[5] * 3] * 2


def test_rows_keep_their_requests_as_requests_join_finish_and_are_preempted(llm):
    """Each request's tokens count up from its own start, a function of its own live output
    list: a row given another request's state or tokens would break the count. Twelve
    requests of 3 to 40 tokens on four rows and ten KV blocks."""
    before = llm.engine.stats.num_preemptions
    lengths = [3, 40, 7, 25, 12, 40, 5, 33, 18, 9, 40, 2]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             extra_args={"count_from": 80 * i}) for i, n in enumerate(lengths)]
    outs = _ids(llm, PROMPTS, params)
    for i, (out, n) in enumerate(zip(outs, lengths)):
        assert out == [(80 * i + j) % V for j in range(n)], i
    assert llm.engine.stats.num_preemptions > before


def test_an_argmax_invariant_processor_runs_after_temperature_on_random_rows(llm, hf):
    """top_only 1 leaves a random row only its likeliest token; a greedy row is untouched."""
    greedy, _ = hf
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=8, ignore_eos=True,
                             extra_args={"top_only": 1}) for s in range(2)]
    params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                 extra_args={"top_only": 1}))
    free = SamplingParams(temperature=1.5, seed=0, max_tokens=8, ignore_eos=True)
    outs = _ids(llm, PROMPTS[:4], params + [free])
    for i in range(3):
        assert outs[i] == greedy(PROMPTS[i], 8), i
    assert outs[3] != greedy(PROMPTS[3], 8)        # sampled at 1.5 without it


def test_seeded_requests_that_ask_nothing_sample_as_without_processors(llm, tiny_llm):
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=7 + i, max_tokens=8,
                             ignore_eos=True)
              for i, (t, k, p) in enumerate([(0.8, 0, 1.0), (1.3, 50, 0.9), (0.5, 0, 0.7)])]
    assert _ids(llm, PROMPTS[:3], params) == _ids(tiny_llm, PROMPTS[:3], params)


def test_an_adapter_processor_runs_its_per_request_callable(llm, hf):
    greedy, logits = hf
    first = greedy(PROMPTS[0], 1)[0]
    row = logits(PROMPTS[0])
    row[first] = -np.inf
    out, plain = _ids(llm, PROMPTS[:2], [
        SamplingParams(temperature=0, max_tokens=1, extra_args={"ban": first}),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert out == [int(row.argmax())]
    assert plain == greedy(PROMPTS[1], 3)


def test_a_processor_that_raises_fails_the_started_requests_and_keeps_the_queued_ones(llm):
    """What the server's engine loop does with the error (fail_running): the four
    requests the failing step ran end with it, the two still queued run as they would."""
    engine = llm.engine
    for i in range(6):
        engine.add_request({"prompt_token_ids": PROMPTS[i]}, SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True,
            extra_args={"fail": True} if i == 0 else {"count_from": 7 * i}), f"fail-{i}")
    with pytest.raises(LogitsProcessorError, match="custom logits processor "
                       "FailingProcessor.apply failed: RuntimeError: this processor fails"):
        engine.step()
    failed = engine.fail_running("the step failed")
    assert sorted(o.request_id for o in failed) == [f"fail-{i}" for i in range(4)]
    assert all(o.outputs[0].finish_reason == "abort" for o in failed)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert done == {f"fail-{i}": [7 * i + j for j in range(5)] for i in (4, 5)}


def test_vllm_config_gives_what_processors_read_and_names_what_it_does_not(llm):
    import torch
    view = vllm_config_view(llm.engine.config)
    assert (view.scheduler_config.max_num_seqs, view.model_config.get_vocab_size(),
            view.model_config.max_model_len, view.model_config.dtype,
            view.cache_config.block_size, view.speculative_config) == (4, V, 128,
                                                                      torch.float32, 16, None)
    assert getattr(view, "reasoning_config", None) is None
    with pytest.raises(AttributeError, match="vllm_config.model_config.hf_config is not "
                                             "provided to custom logits processors here"):
        view.model_config.hf_config


def test_a_class_derived_from_vllms_own_interface_gets_vllms_types(llm, monkeypatch):
    """With vLLM installed, a processor subclassing vLLM's LogitsProcessor is taken, and its
    updates carry vLLM's BatchUpdate and MoveDirectionality (here a stand-in vLLM module)."""
    import abc
    import dataclasses
    import enum
    import pickle
    import types
    fake = types.ModuleType("vllm.v1.sample.logits_processor")

    class Move(enum.Enum):
        UNIDIRECTIONAL = 1
        SWAP = 2

    @dataclasses.dataclass(frozen=True)
    class BatchUpdate:
        batch_size: int
        removed: list
        added: list
        moved: list

    class LogitsProcessor(abc.ABC):
        pass
    LogitsProcessor.__module__ = "vllm.v1.sample.logits_processor.interface"
    fake.LogitsProcessor, fake.BatchUpdate, fake.MoveDirectionality = (LogitsProcessor,
                                                                      BatchUpdate, Move)
    for name in ("vllm", "vllm.v1", "vllm.v1.sample", "vllm.v1.sample.logits_processor"):
        monkeypatch.setitem(sys.modules, name, fake)
    seen = []

    class Theirs(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            seen.append(batch_update)

        def apply(self, logits):
            return logits
    config = llm.engine.config
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, logits_processors=(Theirs,)))
    custom = CustomLogitsProcessors(config)
    params = SamplingParams()
    custom.update(np.array([1, 2]), np.frombuffer(pickle.dumps(
        {1: (params, [5], []), 2: (params, [6], [])}), np.uint8))
    custom.update(np.array([2, 1]), None)
    assert [type(u) for u in seen] == [BatchUpdate, BatchUpdate]
    assert [({a, b}, how) for a, b, how in seen[1].moved] == [({0, 1}, Move.SWAP)]


def test_validate_params_refuses_a_request_naming_extra_args(llm):
    with pytest.raises(ValueError, match="extra_args: target_token value 'x' is not an int"):
        llm.generate("Hello", SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)


def test_extra_args_without_processors_are_refused_as_unread(tiny_llm):
    with pytest.raises(ValueError, match="extra_args: 'target_token' would be read by custom "
                                         "logits processors, and this engine has none"):
        tiny_llm.generate("Hello", SamplingParams(extra_args={"target_token": 3}),
                          use_tqdm=False)


@pytest.mark.parametrize("spec, problem", [
    ("no_such_module:X", "cannot import no_such_module"),
    ("custom_logits_processors:Missing", "custom_logits_processors has no Missing"),
    ("custom_logits_processors:NotAProcessor", "NotAProcessor is not a subclass of "
                                               "LogitsProcessor"),
    ("custom_logits_processors.TargetTokenProcessor", "expected 'module:Class'"),
])
def test_a_class_that_cannot_be_loaded_stops_the_engine_naming_the_key(tiny_model_dir, spec,
                                                                       problem):
    with pytest.raises(ConfigError, match="logits_processors") as e:
        EngineArgs(tiny_model_dir, logits_processors=[spec]).create_engine_config()
    assert problem in str(e.value)


def test_classes_the_workagent_cannot_import_or_use_are_refused(tiny_model_dir):
    class Local(procs.TopOnlyProcessor):
        pass

    class Abstract(procs.LogitsProcessor):
        def apply(self, logits):
            return logits
    with pytest.raises(ConfigError, match="the WorkAgent process cannot import"):
        EngineArgs(tiny_model_dir, logits_processors=[Local],
                   distributed_executor_backend="mp").create_engine_config()
    with pytest.raises(ConfigError, match="does not implement __init__, is_argmax_invariant, "
                                          "update_state"):
        EngineArgs(tiny_model_dir, logits_processors=[Abstract]).create_engine_config()
    with pytest.raises(ConfigError, match="not supported with speculative_config"):
        EngineArgs(tiny_model_dir, logits_processors=["custom_logits_processors:TopOnlyProcessor"],
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_installed_plugins_of_vllms_entry_point_group_are_loaded(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """A package that registers a processor under vllm.logits_processors runs without a
    flag, before the ones given, as in vLLM."""
    info = tmp_path / "lp_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lp-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[vllm.logits_processors]\n"
                                           "top = custom_logits_processors:TopOnlyProcessor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = EngineArgs(tiny_model_dir, logits_processors=["custom_logits_processors:"
                                                           "TargetTokenProcessor"]
                        ).create_engine_config()
    assert config.model.logits_processors == ("custom_logits_processors:TopOnlyProcessor",
                                              "custom_logits_processors:TargetTokenProcessor")


def test_the_workagent_finds_processor_modules_on_the_scripts_sys_path(tiny_model_dir,
                                                                       tmp_path, monkeypatch):
    """A script that puts its processors' directory on sys.path (as vLLM's spawned workers
    get it): the WorkAgent's PYTHONPATH has it, and not the interpreter's own paths."""
    (tmp_path / "my_procs.py").write_text("from custom_logits_processors import "
                                          "TopOnlyProcessor as P\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = EngineArgs(tiny_model_dir, logits_processors=["my_procs:P"],
                        distributed_executor_backend="mp").create_engine_config()
    path = plan_launch(config, sys.executable).agents[0].env["PYTHONPATH"].split(os.pathsep)
    assert str(tmp_path) in path and TESTS in path
    assert not [p for p in path if p.startswith((sys.prefix, sys.base_prefix))]


def test_the_server_does_not_start_with_a_processor_it_cannot_import(tiny_model_dir):
    r = subprocess.run([sys.executable, str(ROOT / "start.py"), "--model", tiny_model_dir,
                        "--port", str(free_port()), "--logits-processors", "no_such_mod:P"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "logits_processors: 'no_such_mod:P': cannot import no_such_mod" in r.stderr


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), TESTS])}
    proc, url = serve_model(tiny_model_dir, "--max-num-seqs", "4", "--logits-processors",
                            "custom_logits_processors:TargetTokenProcessor",
                            "custom_logits_processors:CountingProcessor",
                            "custom_logits_processors:FailingProcessor",
                            port=free_port(), env=env)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    finally:
        assert stop_server(proc) == 0


def _complete(client, prompt, n, xargs=None):
    r = client.completions.create(model=client.model, prompt=prompt, max_tokens=n,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True,
                                                             **({"vllm_xargs": xargs}
                                                                if xargs else {})})
    return r.choices[0].token_ids


def test_vllm_xargs_reach_the_processors_on_every_generating_route(client, tiny_model_dir, hf):
    client.model = client.models.list().data[0].id
    assert _complete(client, PROMPTS[0], 5, {"target_token": 77}) == [77] * 5
    r = client.chat.completions.create(
        model=client.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, extra_body={"vllm_xargs": {"target_token": 77},
                                                  "return_tokens_as_token_ids": True})
    assert [t.token for t in r.choices[0].logprobs.content] == ["token_id:77"] * 4
    import transformers
    text = transformers.AutoTokenizer.from_pretrained(tiny_model_dir).decode([77] * 4)
    r = client.responses.create(model=client.model, input="hi", max_output_tokens=4,
                                extra_body={"vllm_xargs": {"target_token": 77}})
    assert r.output_text == text
    r = requests.post(str(client.base_url).replace("/v1/", "/v1/messages"), json={
        "model": client.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "vllm_xargs": {"target_token": 77}})
    assert r.json()["content"] == [{"type": "text", "text": text}]
    greedy, _ = hf
    lengths = [30, 4, 17, 9, 25, 3, 12, 20]
    jobs = [(PROMPTS[i], n, {"count_from": 100 * i} if i % 4 else None)
            for i, n in enumerate(lengths)]
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda job: _complete(client, *job), jobs))
    for i, (prompt, n, xargs) in enumerate(jobs):
        want = ([(100 * i + j) % V for j in range(n)] if xargs else greedy(prompt, n))
        assert outs[i] == want, i


def test_bad_vllm_xargs_are_a_400_naming_the_field(client):
    client.model = client.models.list().data[0].id
    for bad, says in (({"target_token": "x"}, "target_token value 'x' is not an int"),
                      ({"target_token": {"a": 1}}, "vllm_xargs.target_token")):
        with pytest.raises(openai.BadRequestError) as e:
            _complete(client, PROMPTS[0], 2, bad)
        assert e.value.body["param"].startswith("vllm_xargs") and says in e.value.message


def test_a_processor_that_raises_fails_its_request_and_the_server_goes_on(client):
    client.model = client.models.list().data[0].id
    with pytest.raises(openai.APIStatusError) as e:
        _complete(client, PROMPTS[0], 5, {"fail": True})
    assert "custom logits processor FailingProcessor.apply failed: RuntimeError: this " \
           "processor fails on purpose" in e.value.message
    assert _complete(client, PROMPTS[1], 5, {"target_token": 9}) == [9] * 5
