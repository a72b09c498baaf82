"""llm-serving tune: the search loop against a deterministic fake objective, the tuned YAML's
round trip through load_config, a real trial server that fails to start, and a real Ctrl-C
to a real ``llm-serving tune`` (the best so far written, no server or segment left)."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llm_serving.config import EngineArgs
from llm_serving.serving_config import load_config
from llm_serving.tune.objective import make_objective
from llm_serving.tune.search import Tuner, table
from llm_serving.tune.space import default_space, engine_kwargs, without_fixed
from llm_serving.tune.trial_server import TrialFailed, TrialServer, TrialTooSlow
from llm_serving.tune.tuned_yaml import read_base, write_tuned_yaml

ROOT = Path(__file__).resolve().parents[1]
LLAMA_7B = ROOT / "configs" / "llama" / "llama_7b_kbk_pa_dyn.yaml"
TINY = ROOT / "configs" / "llama" / "tiny_llama.yaml"


def fake_throughput(kw: dict, prompts: int) -> float:
    """A made-up, deterministic landscape: best at max_num_seqs 64 and a 1024-token budget,
    a little better with a bigger KV pool; the rung size scales it (as a smaller sample
    would)."""
    v = 1000.0 - 60 * (math.log2(kw["max_num_seqs"]) - 6) ** 2 \
        - 40 * (math.log2(kw["max_num_batched_tokens"]) - 10) ** 2 \
        + 5 * math.log2(kw["num_blocks"] * kw["block_size"] / 1024)
    return v * prompts / (prompts + 4)


class FakeEvaluator:
    """Stands in for the server: fails to 'start' when max_num_seqs > the KV pool's blocks
    (a made-up invalid combination), else scores each rung with fake_throughput."""

    def __init__(self):
        self.calls = []      # (trial number, rungs measured)
        self.limits = []     # (trial number, rung, time limit given, duration it would take)

    def evaluate(self, number, kwargs, rungs, report, time_limit=lambda n: None):
        measured = []
        self.calls.append((number, measured))
        if kwargs["max_num_seqs"] > kwargs["num_blocks"]:
            raise TrialFailed(f"num_blocks {kwargs['num_blocks']} < max_num_seqs")
        for i, n in enumerate(rungs):
            tput = fake_throughput(kwargs, n)
            duration = 100.0 * n / max(tput, 1.0)      # the same output tokens per rung
            limit = time_limit(n)
            self.limits.append((number, n, limit, duration))
            if limit is not None and duration > limit:
                raise TrialTooSlow(f"stopped after {limit:.0f} s on {n} prompts")
            measured.append(n)
            summary = {"output_throughput": tput, "duration": duration,
                       "ttft_ms": {"p99": 10.0}, "tpot_ms": {"p99": 1.0}}
            if i < len(rungs) - 1:
                report(n, summary)
        return summary


def run_fake(seed=0, n_trials=40, baseline=None, seeds=(), objective="throughput"):
    space = default_space(max_model_len=1024)
    ev = FakeEvaluator()
    tuner = Tuner(ev, space, {"model": "m"}, make_objective(objective), rungs=[4, 16],
                  budget_s=600, n_trials=n_trials, seed=seed, baseline=baseline, seeds=seeds,
                  progress=False, log=lambda _: None)
    return tuner.run(), ev, space


def test_search_finds_the_optimum_records_failures_and_prunes():
    base = {"max_num_seqs": 1, "max_num_batched_tokens": 2048, "block_size": 16,
            "kv_tokens": 16384, "enable_prefix_caching": False, "async_scheduling": True}
    result, ev, space = run_fake(baseline=base)
    complete = [t for t in result.trials if t.state == "complete"]
    failed = [t for t in result.trials if t.state == "failed"]
    pruned = [t for t in result.trials if t.state == "pruned"]
    assert len(result.trials) == 40 and not result.interrupted
    # Trial 0 is the base config's setting, measured as given.
    assert result.trials[0].params["max_num_seqs"] == 1 and result.trials[0].state == "complete"
    # The best is the best complete trial, and it is near the landscape's optimum
    # (1000 + 5*log2(65536/1024) = 1030 at the peak, times 16/20 for the 16-prompt rung).
    assert result.best.value == max(t.value for t in complete)
    assert result.best.value > 0.9 * 1030 * 16 / 20
    assert result.best.value > 2 * result.trials[0].value
    assert 16 <= result.best.params["max_num_seqs"] <= 256
    # Failures are recorded with their reason and the search went on past them.
    assert failed and all("< max_num_seqs" in t.error for t in failed)
    assert max(t.number for t in result.trials) > min(t.number for t in failed)
    # Pruned trials stopped after the first rung; complete ones measured both.
    assert pruned
    calls = dict(ev.calls)
    # (by the pruner after the first rung, or stopped inside a rung for running too long)
    assert all(calls[t.number] == [4] for t in pruned if not t.error)
    assert all(calls[t.number] in ([], [4]) and "stopped after" in t.error
               for t in pruned if t.error)
    assert all(calls[t.number] == [4, 16] for t in complete)
    # The engine arguments of a trial are its knobs, the KV pool in blocks of its size.
    for t in complete:
        assert t.kwargs["num_blocks"] == math.ceil(t.params["kv_tokens"] / t.params["block_size"])
    assert table(result, make_objective("throughput"), space).count("\n") == len(result.trials) + 1


def test_a_rung_slower_than_the_fastest_is_stopped_and_seeds_run_first():
    base = {"max_num_seqs": 1, "max_num_batched_tokens": 2048, "block_size": 16,
            "kv_tokens": 16384, "enable_prefix_caching": False, "async_scheduling": True}
    good = dict(base, max_num_seqs=64, max_num_batched_tokens=1024)
    result, ev, _ = run_fake(n_trials=20, baseline=base, seeds=(good,))
    # The baseline, then the seed, before the sampler's own picks.
    assert [t.params["max_num_seqs"] for t in result.trials[:2]] == [1, 64]
    # Nothing had run yet when trial 0 started: no limit. Later, a rung's limit is 1.25x the
    # fastest run of that rung so far, and a trial that would take longer was stopped there.
    assert ev.limits[0][2] is None
    fastest = {}
    for number, n, limit, duration in ev.limits:
        if n in fastest:
            assert limit == pytest.approx(1.25 * fastest[n])
        if limit is None or duration <= limit:
            fastest[n] = min(duration, fastest.get(n, float("inf")))
    slow = [t for t in result.trials if t.error and "stopped after" in t.error]
    assert slow and all(t.state == "pruned" for t in slow)
    assert result.best.value == max(t.value for t in result.trials if t.state == "complete")
    # Latency objectives are not monotone in the run's duration: no limit.
    _, ev, _ = run_fake(n_trials=6, objective="ttft-p99")
    assert all(limit is None for _, _, limit, _ in ev.limits)


def test_search_is_deterministic_for_a_seed():
    a, _, _ = run_fake(seed=3, n_trials=12)
    b, _, _ = run_fake(seed=3, n_trials=12)
    assert [t.params for t in a.trials] == [t.params for t in b.trials]
    assert [t.state for t in a.trials] == [t.state for t in b.trials]


def test_fixed_engine_arguments_are_not_searched():
    space = without_fixed(default_space(1024), {"block_size": 32, "num_blocks": 100})
    names = {k.name for k in space}
    assert "block_size" not in names and "kv_tokens" not in names
    assert engine_kwargs({"max_num_seqs": 8}, {"block_size": 32}) == \
        {"block_size": 32, "max_num_seqs": 8}


def test_objective_and_slo_errors_name_the_flag():
    from llm_serving.errors import ConfigError
    with pytest.raises(ConfigError, match="--slo"):
        make_objective("goodput")
    with pytest.raises(ConfigError, match="--slo"):
        make_objective("goodput", ["ttft=500"])
    assert make_objective("ttft-p99").direction == "minimize"


@pytest.mark.parametrize("flags, needle", [
    (["--rate", "0"], "error: --rate: expected requests per second > 0"),
    (["--rate", "-1"], "error: --rate: expected requests per second > 0"),
    (["--max-output", "0"], "error: --max-output: expected a positive integer"),
    (["--n-trials", "0"], "error: --n-trials: expected a positive integer"),
    (["--dataset", str(LLAMA_7B)], "error: --dataset: "),
    (["--out", "configs"], "error: --out: 'configs' is a directory"),
])
def test_bad_workload_flags_fail_naming_the_flag_before_any_trial(tmp_path, tiny_model_dir,
                                                                   flags, needle):
    r = subprocess.run([sys.executable, "-m", "llm_serving.cli", "tune", "--model",
                        tiny_model_dir, "--out", str(tmp_path / "t.yaml"), "--no-progress",
                        *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and needle in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "trial 0" not in r.stdout + r.stderr


@pytest.mark.parametrize("base_file", [LLAMA_7B, TINY], ids=["llama_7b", "tiny"])
def test_tuned_yaml_round_trip(tmp_path, tiny_model_dir, base_file):
    from llm_serving.config import EngineArgs
    chosen = {"model": tiny_model_dir, "max_model_len": 512, "max_num_seqs": 24,
              "max_num_batched_tokens": 700, "block_size": 32, "num_blocks": 90,
              "enable_prefix_caching": False, "async_scheduling": False}
    out = tmp_path / "tuned.yaml"
    write_tuned_yaml(out, read_base(base_file), chosen, ["measured: a test", "CPU: any"])
    text = out.read_text()
    assert text.startswith("# measured: a test\n# CPU: any\n")
    kw = load_config(out).engine_kwargs
    assert {k: kw[k] for k in chosen} == chosen
    raw = yaml.safe_load(text)
    if base_file == LLAMA_7B:       # llm-serving's own keys where they exist
        assert raw["model_config"]["decode_batch_size"] == [24]
        assert raw["pa_config"]["num_blocks"] == 90 and raw["pa_config"]["block_size"] == 32
        assert "max_num_seqs" not in raw["llm_serving"]
        assert raw["tokenizer"] == read_base(base_file)["tokenizer"]   # the rest kept
    cfg = EngineArgs(**kw).create_engine_config()
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (24, 700)
    assert (cfg.cache.block_size, cfg.cache.num_blocks) == (32, 90)
    assert cfg.scheduler.async_scheduling is False


def test_trial_server_that_cannot_start_fails_with_its_reason(tmp_path, tiny_model_dir):
    config = tmp_path / "bad.yaml"
    # 4 blocks of 16 tokens cannot hold one 512-token sequence: start.py refuses it.
    write_tuned_yaml(config, read_base(TINY), {"model": tiny_model_dir, "max_model_len": 512,
                                               "num_blocks": 4}, ["bad"])
    with pytest.raises(TrialFailed, match="num_blocks"):
        TrialServer(config, tmp_path / "bad.log", startup_timeout=120)


def test_a_rungs_time_limit_counts_the_requests_not_the_clients_set_up(tmp_path,
                                                                       tiny_model_dir,
                                                                       monkeypatch):
    """The limit is slack x the fastest run's duration, which runs from the first request
    sent; the client's set-up before it (loading the tokenizer, counting output lengths)
    must not count, or on a short rung every trial is pruned as slower than the best,
    the best's own setting included."""
    from clients import benchmark_serving as bs
    from llm_serving.tune.trial_server import Workload, run_client
    workload = Workload(dataset=str(ROOT / "clients" / "data" / "alpaca_5010.json"),
                        request_rate=float("inf"), max_output=8, tokenizer=tiny_model_dir)
    server = TrialServer(None, tmp_path / "s.log", startup_timeout=120,
                         extra_args=("--model", tiny_model_dir, "--max-model-len", "256"))
    try:
        duration = run_client(server.url, workload, 4)["duration"]
        counted = bs.output_lengths

        async def slow_set_up(*args):
            await asyncio.sleep(3.0)
            return await counted(*args)
        monkeypatch.setattr(bs, "output_lengths", slow_set_up)
        summary = run_client(server.url, workload, 4, time_limit=duration + 2.0)
        assert summary["completed"] == 4
    finally:
        server.stop()


def _procs_where(field: int, value: int) -> list[int]:
    """Pids whose /proc/<pid>/stat field (after the command name) equals ``value``:
    1 = parent pid, 3 = process group."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[field]) == value:
                out.append(int(d))
    return out


def _children(pid: int) -> list[int]:
    return _procs_where(1, pid)


def _in_group(pgid: int) -> list[int]:
    return _procs_where(3, pgid)


def _tune_until_a_trial_server(out, work, model):
    """``llm-serving tune`` running, one trial complete and the next trial's server started:
    (the process, its output lines so far, the trial servers' pids)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_serving.cli", "tune",     # --model alone: engine defaults
         "--model", model, "--max-model-len", "256", "--num-prompts", "4",
         "--max-output", "8", "--budget-s", "300", "--no-progress", "--workdir", str(work),
         "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # as from a terminal: a test run started in the background (cmd &) ignores SIGINT,
        # and a child would inherit that and never see the Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, servers = [], []
    try:
        for line in proc.stdout:           # wait for a completed trial
            lines.append(line)
            if line.startswith("trial 0 "):
                break
        assert "trial 0 complete" in lines[-1], "".join(lines)
        deadline = time.time() + 120       # then for the next trial's server to be running
        while time.time() < deadline and not servers:
            servers = _children(proc.pid)
            time.sleep(0.2)
        assert servers, "no trial server was started after trial 0"
    except BaseException:
        proc.kill()
        raise
    return proc, lines, servers


def _left_behind(pid: int) -> list:
    """The processes of trial server ``pid``'s group and its shared-memory segments."""
    return _in_group(pid) + [f for f in os.listdir("/dev/shm")
                             if f.startswith(f"llm_serving_{pid}_")]


def test_a_killed_tune_leaves_no_trial_server(tmp_path, tiny_model_dir):
    """tune killed outright (SIGKILL, a crash: no clean-up of its own) must not leave its
    trial server serving in its own session, holding its shared memory."""
    proc, _, servers = _tune_until_a_trial_server(tmp_path / "tuned.yaml", tmp_path / "work",
                                                  tiny_model_dir)
    try:
        proc.kill()
        proc.wait(10)
        deadline = time.time() + 90        # the server drains and frees its segments
        while time.time() < deadline and any(_left_behind(pid) for pid in servers):
            time.sleep(0.5)
        assert not [_left_behind(pid) for pid in servers if _left_behind(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in servers:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_tune_with(sig, out, work, model):
    """Send ``sig`` to a tune with one trial complete and the next one's server up: (the
    process, once ended; all it printed; the trial servers' pids)."""
    proc, lines, servers = _tune_until_a_trial_server(out, work, model)
    try:
        time.sleep(2)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, "".join(lines) + rest, servers


def test_sigterm_stops_the_search_as_ctrl_c_does(tmp_path, tiny_model_dir):
    """kill, timeout or a cancelled job sends SIGTERM: the trials done so far are not lost
    (the best is written), and the trial under way is stopped with its shared memory."""
    out = tmp_path / "tuned.yaml"
    proc, text, servers = _stop_tune_with(signal.SIGTERM, out, tmp_path / "work",
                                          tiny_model_dir)
    assert proc.returncode == 130 and f"wrote {out}" in text, text
    assert "interrupted" in out.read_text()
    for pid in servers:
        assert not _left_behind(pid), f"trial server {pid} left {_left_behind(pid)}"


def test_ctrl_c_writes_the_best_so_far_and_leaves_nothing(tmp_path, tiny_model_dir):
    out = tmp_path / "tuned.yaml"
    proc, text, servers = _stop_tune_with(signal.SIGINT, out, tmp_path / "work",
                                          tiny_model_dir)
    assert proc.returncode == 130, text
    assert "interrupted" in text and f"wrote {out}" in text
    trials = json.loads(Path(str(out) + ".trials.json").read_text())
    # trial 0 measured the engine's defaults, as start.py --model DIR runs them: its batch
    # and the KV pool it sizes from kv_cache_space
    engine = EngineArgs(model=tiny_model_dir, max_model_len=256).create_engine_config()
    first = next(t for t in trials if t["number"] == 0)["params"]
    assert first["max_num_seqs"] == engine.scheduler.max_num_seqs == 128
    assert first["kv_tokens"] == engine.cache.num_blocks * engine.cache.block_size
    best = max((t for t in trials if t["state"] == "complete"), key=lambda t: t["value"])
    kw = load_config(out).engine_kwargs
    assert kw["max_num_seqs"] == best["params"]["max_num_seqs"]
    assert "interrupted by Ctrl-C" in out.read_text()
    # the base was the engine's defaults, as start.py --model DIR takes them (not the tiny
    # model's file, which sizes its KV pool and batch for the tiny model)
    assert "from the engine's defaults." in out.read_text()
    assert kw["model"] == tiny_model_dir and "tiny_llama" not in text
    for pid in servers:                    # every trial server, its WorkAgents and segments
        assert not _left_behind(pid), f"trial server {pid} left {_left_behind(pid)}"

