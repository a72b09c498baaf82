"""One trial of ``llm-serving tune``: write the trial's config file, start the real server on it
(``start.py --config``, in its own session so a Ctrl-C at the terminal reaches only the
tuner), drive it with ``clients/benchmark_serving.py`` on a sample of the workload, and stop
it. The server is stopped on every way out (success, failure, pruning, Ctrl-C), and any shared
memory segment of its pid left in /dev/shm is removed.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from llm_serving.cli_args import STOP_WITH_PARENT_ENV
from llm_serving.tune.tuned_yaml import write_tuned_yaml

ROOT = Path(__file__).resolve().parents[2]
START_PY = ROOT / "start.py"
# /ready's reasons that mean "not yet"; any other reason is a failure to start.
_NOT_YET = ("loading the model", "restarting the model process")


class TrialFailed(Exception):
    """The trial's server did not start, or requests failed: recorded with this reason."""


class TrialTooSlow(Exception):
    """A rung ran past its time limit: with the same requests, the trial cannot beat the best
    one (recorded as pruned, with this reason)."""


@dataclass
class Workload:
    dataset: str                   # an alpaca-style JSON (instruction, input, output)
    request_rate: float            # inf = all at once
    ignore_eos: bool = True
    max_output: int = 256
    seed: int = 0
    tokenizer: Optional[str] = None   # counts reference output tokens (default: /tokenize)
    timeout: float = 1800.0

    def describe(self, n: int) -> str:
        rate = "all at once" if self.request_rate == float("inf") else \
            f"{self.request_rate:g} req/s (Poisson)"
        return (f"the first {n} prompts of {Path(self.dataset).name}, {rate}, greedy, "
                f"outputs of the reference length capped at {self.max_output}"
                + (", ignore_eos" if self.ignore_eos else ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrialServer:
    """``start.py --config FILE`` (no file: ``start.py`` with only ``extra_args``) in its own
    session; ``stop()`` always leaves nothing behind."""

    def __init__(self, config: Optional[Path], log: Path, startup_timeout: float,
                 extra_args: tuple = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")
        # In its own session, so stop() can signal its whole group; and so nothing reaches
        # it when tune dies (SIGKILL, a crash): it stops itself then (cli_args).
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                   **{STOP_WITH_PARENT_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(
            [sys.executable, str(START_PY), *(("--config", str(config)) if config else ()),
             "--port", str(self.port),
             "--log-level", "warning", *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
            start_new_session=True)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TrialFailed(f"the server exited with code {self.proc.returncode} at "
                                  f"start: {self.error_line()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                try:
                    reason = json.loads(e.read() or b"{}").get("reason", "")
                except ValueError:
                    reason = ""
                if reason and reason not in _NOT_YET:
                    raise TrialFailed(f"the server could not serve: {reason}") from None
            except OSError:
                pass
            time.sleep(0.5)
        raise TrialFailed(f"the server was not ready within {timeout:.0f} s")

    def error_line(self) -> str:
        """The server's own error message (its 'error: ...' line), else its last line."""
        self._log.flush()
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines()
                 if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error:")]
        return (errors or lines or ["(no output)"])[-1][:300]

    def stop(self) -> None:
        """SIGTERM to the server's process group (it drains and frees its shared memory), then
        SIGKILL after 60 s; then remove any segment of its pid still in /dev/shm."""
        old, deferred = None, []
        try:     # a Ctrl-C must not cut the clean-up short: it is acted on once it is done
            old = signal.signal(signal.SIGINT, lambda *_: deferred.append(True))
        except ValueError:       # not the main thread
            pass
        try:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
                except ProcessLookupError:
                    self.proc.wait()
            try:         # agents left in the group after the master exited
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _wait_group_gone(self.proc.pid, 10.0)
            from llm_serving.executor.shm_channel import remove_segments
            remove_segments(self.proc.pid)
            self._log.close()
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        # A Ctrl-C during the clean-up stops the search (unless one is being handled already:
        # the clean-up then runs on its behalf). Swallowing it lost the user's Ctrl-C when
        # trials are short and most of the time goes to stopping servers.
        if deferred and sys.exc_info()[0] is not KeyboardInterrupt:
            raise KeyboardInterrupt


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Until no process of the group is left (killed agents are reaped by init a moment
    after the kill), so a stopped trial has really stopped when this returns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def run_client(url: str, workload: Workload, num_prompts: int, slo: tuple = (),
               time_limit: Optional[float] = None) -> dict:
    """``clients/benchmark_serving.py`` against ``url`` on the first ``num_prompts`` prompts:
    its summary, plus the first request error (or None). Past ``time_limit`` seconds the
    client is stopped (its requests are cancelled, so the server aborts them) and
    ``TrialTooSlow`` is raised."""
    from clients import benchmark_serving as bs
    argv = ["--base-url", url, "--dataset-name", "alpaca", "--dataset-path", workload.dataset,
            "--num-prompts", str(num_prompts), "--max-output", str(workload.max_output),
            "--request-rate", str(workload.request_rate), "--seed", str(workload.seed),
            "--timeout", str(workload.timeout), "--no-progress"]
    if workload.ignore_eos:
        argv.append("--ignore-eos")
    if workload.tokenizer:
        argv += ["--tokenizer", workload.tokenizer]
    if slo:
        argv += ["--goodput", *slo]
    args = bs.parse_args(argv)
    # Ctrl-C stops the search here too. asyncio.run's own SIGINT handling only cancels the
    # client's task, and the client's clean-up then ends it like a time limit (a pruned
    # trial), so the Ctrl-C was lost; this handler raises KeyboardInterrupt at once.
    interrupted = []

    def on_sigint(*_):
        interrupted.append(True)
        raise KeyboardInterrupt
    try:
        old = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:           # not the main thread
        old = None
    try:
        result = asyncio.run(bs.run(args, time_limit))   # the requests timed, not set-up
    except asyncio.TimeoutError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise TrialTooSlow(f"stopped after {time_limit:.0f} s on {num_prompts} prompts, "
                           "slower than the best trial") from None
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    if interrupted:
        raise KeyboardInterrupt
    summary = bs.summarize(args, result)
    summary["first_error"] = next((r["error"] for r in result["records"]
                                   if r["error"] is not None), None)
    return summary


class ServerEvaluator:
    """Measures a trial's engine arguments on the real server.

    ``evaluate(number, kwargs, rungs, report, time_limit)`` starts one server, runs the client
    once per rung (a number of prompts, smallest first), calls ``report(prompts, summary)``
    after each rung but the last (it raises optuna.TrialPruned to stop the trial), and returns
    the last rung's summary. ``time_limit(prompts)`` gives a rung's limit in seconds, or None;
    past it the rung stops with ``TrialTooSlow``. The server is stopped whatever happens."""

    def __init__(self, base: dict, workload: Workload, workdir: Path, slo: tuple = (),
                 startup_timeout: float = 300.0):
        self.base, self.workload, self.workdir = base, workload, Path(workdir)
        self.slo, self.startup_timeout = slo, startup_timeout

    def evaluate(self, number: int, kwargs: dict, rungs: list[int],
                 report: Callable[[int, dict], None],
                 time_limit: Callable[[int], Optional[float]] = lambda n: None) -> dict:
        config = self.workdir / f"trial_{number}.yaml"
        write_tuned_yaml(config, self.base, kwargs, [f"llm-serving tune, trial {number}"])
        server = TrialServer(config, self.workdir / f"trial_{number}.log", self.startup_timeout)
        try:
            summary = None
            for i, n in enumerate(rungs):
                summary = self._measure(server, n, time_limit(n))
                if i < len(rungs) - 1:
                    report(n, summary)
            return summary
        finally:
            server.stop()

    def _measure(self, server: TrialServer, n: int, time_limit: Optional[float]) -> dict:
        if server.proc.poll() is not None:
            raise TrialFailed(f"the server died: {server.error_line()}")
        s = run_client(server.url, self.workload, n, self.slo, time_limit)
        if s["failed"]:
            raise TrialFailed(f"{s['failed']} of {n} requests failed: {s['first_error']}")
        return s

