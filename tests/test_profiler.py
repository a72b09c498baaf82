"""vLLM's profiler workflow (--profiler-config, POST /start_profile and /stop_profile,
LLM.start_profile / stop_profile): the real server (the model in a WorkAgent) writes one
Chrome trace per process, the master's with the scheduler's steps on its engine thread and the
HTTP routes on its event loop, the WorkAgent's with the model's forward; a second session
works; offline the one process's trace holds both. Bad settings stop the start naming the
key."""
from __future__ import annotations

import gzip
import json
import os

import pytest
import requests

from llm_serving import LLM, EngineArgs, SamplingParams
from llm_serving.errors import ConfigError
from test_embeddings_server import _port, served


def _trace(path: str) -> dict:
    """The events of a trace file by thread name: {thread: {function names}}."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    process, = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert os.path.basename(path).split(".")[0].endswith(process.split(".")[0])  # its role
    calls: dict = {}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] > 0
            calls.setdefault(names.get(e["tid"], e["tid"]), set()).add(e["name"].split(" (")[0])
    return calls


def _complete(url: str) -> None:
    r = requests.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                      timeout=60)
    assert r.status_code == 200, r.text


def test_server_profile_sessions_write_one_trace_per_process(tiny_model_dir, tmp_path):
    out = tmp_path / "traces"
    config = {"profiler": "torch", "torch_profiler_dir": str(out)}
    with served(tiny_model_dir, "--profiler-config", json.dumps(config), port=_port(7)) as url:
        r = requests.post(url + "/start_profile", timeout=60)
        assert r.status_code == 200 and r.content == b""
        again = requests.post(url + "/start_profile", timeout=60)
        assert again.status_code == 409
        assert "already active" in again.json()["error"]["message"]
        _complete(url)
        _complete(url)
        assert requests.post(url + "/stop_profile", timeout=120).status_code == 200
        files = sorted(os.listdir(out))
        assert len(files) == 2, files
        master, = [f for f in files if ".master." in f]
        agent, = [f for f in files if f.startswith("rank0.")]
        assert master.endswith(".trace.json.gz") and agent.endswith(".trace.json.gz")
        calls = _trace(str(out / master))
        assert {"LLMEngine.step", "Scheduler.schedule"} <= calls["llm-engine"]
        assert "completions" in calls["MainThread"]     # the route, on the event loop
        calls = _trace(str(out / agent))
        assert {"ModelRunner.execute", "LlamaForCausalLM.construct"} <= calls["MainThread"]

        # a second session, its files named with vLLM's profile_prefix; stop without a
        # session does nothing, as vLLM
        bad = requests.post(url + "/start_profile", json={"profile_prefix": "-x"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "profile_prefix"
        bad = requests.post(url + "/start_profile", json={"delay_iterations": -1}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "delay_iterations"
        # vLLM's max_iterations: the traces are written once that many model steps recorded
        r = requests.post(url + "/start_profile", timeout=60,
                          json={"profile_prefix": "run2", "max_iterations": 2})
        assert r.status_code == 200
        _complete(url)          # 4 tokens: a prefill and 3 decodes
        second = sorted(set(os.listdir(out)) - set(files))
        assert len(second) == 2 and all(f.startswith("run2_") for f in second), second
        agent = _trace(str(out / next(f for f in second if ".master." not in f)))
        assert "ModelRunner.execute" in agent["MainThread"]
        assert requests.post(url + "/stop_profile", timeout=120).status_code == 200
        assert requests.post(url + "/stop_profile", timeout=120).status_code == 200
        assert len(os.listdir(out)) == 4
        # a profile still recording when the server stops: every process's trace is
        # written, as vLLM's shutdown does
        r = requests.post(url + "/start_profile", timeout=60, json={"profile_prefix": "run3"})
        assert r.status_code == 200
        _complete(url)
    third = sorted(f for f in os.listdir(out) if f.startswith("run3_"))
    assert len(third) == 2, third
    agent = _trace(str(out / next(f for f in third if ".master." not in f)))
    assert "ModelRunner.execute" in agent["MainThread"]


def test_offline_llm_profile_records_steps_and_forward(tiny_model_dir, tmp_path):
    out = tmp_path / "offline"
    llm = LLM(tiny_model_dir, distributed_executor_backend="uni",
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(out),
                               "torch_profiler_use_gzip": False})
    with pytest.raises(ValueError, match="max_iterations"):
        llm.start_profile(max_iterations=-2)
    llm.start_profile()
    llm.generate(["hello"], SamplingParams(max_tokens=3))
    llm.stop_profile()
    files = os.listdir(out)
    assert len(files) == 1 and files[0].endswith(".trace.json"), files
    calls = _trace(str(out / files[0]))["MainThread"]
    assert {"LLMEngine.step", "ModelRunner.execute", "LlamaForCausalLM.construct"} <= calls

    # vLLM's iteration bounds: 2 model steps pass, 3 are recorded, then the trace is written
    llm.start_profile("bounded", delay_iterations=2, max_iterations=3)
    llm.generate(["hello"], SamplingParams(max_tokens=10, ignore_eos=True))
    bounded, = [f for f in os.listdir(out) if f.startswith("bounded_")]
    with open(out / bounded) as f:
        events = [e["name"].split(" (")[0] for e in json.load(f)["traceEvents"]]
    assert events.count("ModelRunner.execute") == 3
    llm.stop_profile()          # written already: nothing more
    assert len(os.listdir(out)) == 2


def test_a_long_profile_keeps_its_last_events(tmp_path, caplog):
    from llm_serving.profiler import ProfilerConfig, TraceRecorder
    config = ProfilerConfig.from_value({"profiler": "torch", "torch_profiler_dir": str(tmp_path),
                                        "max_trace_entries": 1000})
    recorder = TraceRecorder(config, "unit")

    def early():
        pass

    def late():
        pass
    caplog.set_level("WARNING", logger="llm_serving.profiler")
    recorder.start()
    for _ in range(3000):
        early()
    for _ in range(600):
        late()
    path = recorder.stop()
    assert not recorder.active and os.path.basename(path).startswith("unit.")
    with gzip.open(path, "rt") as f:
        calls = [e["name"].split(" (")[0].rsplit(".", 1)[-1]
                 for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert len(calls) <= 1000 and calls.count("late") == 600      # the end, all of it
    assert "buffer of 1000 events filled" in caplog.text


def test_profile_without_profiler_config_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="Profiling is not enabled"):
        tiny_llm.start_profile()


@pytest.mark.parametrize("config, key", [
    ({"profiler": "cuda"}, "profiler_config.profiler"),
    ({"profiler": "proton", "proton_profiler_dir": "/tmp/p"}, "profiler_config.proton_profiler_dir"),
    ({"profiler": "torch"}, "profiler_config.torch_profiler_dir"),
    ({"torch_profiler_dir": "/tmp/p"}, "profiler_config.torch_profiler_dir"),
    ({"profiler": "torch", "torch_profiler_dir": "gs://bucket/p"},
     "profiler_config.torch_profiler_dir"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "torch_profiler_with_flops": True},
     "profiler_config.torch_profiler_with_flops"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "max_iterations": -4},
     "profiler_config.max_iterations"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "warmup_iterations": 2},
     "profiler_config.warmup_iterations"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "max_trace_entries": 10},
     "profiler_config.max_trace_entries"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "colour": 1}, "profiler_config.colour"),
    ("{not json", "profiler_config"),
])
def test_bad_profiler_config_names_the_key(tiny_model_dir, config, key):
    with pytest.raises(ConfigError) as e:
        EngineArgs(model=tiny_model_dir, profiler_config=config)
    assert e.value.key == key


def test_missing_viztracer_names_the_pip_command(tiny_model_dir, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "viztracer" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'llm_serving\[profiling\]'") as e:
        EngineArgs(model=tiny_model_dir,
                   profiler_config={"profiler": "torch", "torch_profiler_dir": "/tmp/p"})
    assert e.value.key == "profiler_config.profiler"
