"""Runs the model in WorkAgent processes (``llm_serving/executor/worker.py``) instead of in the master.

The master keeps the engine: scheduler, block manager, tokenizer. Each step it packs the
StepInput once into the shared input segment and sends a STEP frame to every agent
(``submit``); later it waits for every agent's DONE (``collect``), checking every second that
all of them are still alive, and reads rank 0's SamplerOutput. Two steps may be outstanding,
so that the master can hand over step N+1 while the agents compute step N (async
scheduling): steps alternate between two input and two output segments, so neither side
overwrites what the other still reads. A step whose token bitmask needs the previous step's
samples (grammar rows) is submitted with a placeholder; ``send_mask`` writes the bitmask into
its input segment while the agents run its forward, and a MASK frame tells rank 0 to sample. It has the model runner's interface (``submit``/
``collect``, ``execute``, ``move_blocks``), so the engine does not know which it has.

With ``tensor_parallel_size`` N > 1 there are N agents, one per rank (and per device:
rank r uses device ``device_id + r``), plus MindSpore's collective scheduler process
(``llm_serving/executor/comm_scheduler.py``) they meet through. Every rank runs every step; rank 0 samples
and writes the SamplerOutput into the output segment. ``cpu_affinity`` pins rank r to its own
cores.

Any agent (or the scheduler) dying is detected within a second and raises
``AgentDiedError``; the executor is then broken and ``shutdown()`` kills all of its processes.
``shutdown()`` (also run at exit) stops the processes and unlinks the shared memory.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Optional, Sequence

import numpy as np

from llm_serving.config import EngineConfig, check_tensor_parallel
from llm_serving.errors import LLMServingError, LogitsProcessorError
from llm_serving.executor import shm_channel as ch
from llm_serving.executor.launch_plan import plan_launch
from llm_serving.executor.protocol import SamplerOutput, StepInput
from llm_serving.spec_decode.config import max_sample_rows

logger = logging.getLogger(__name__)
_EMPTY = np.zeros(0, np.int32)
# After one rank reports an error, how long the others get to finish the step. A rank that
# failed before a collective leaves the others waiting in it; then the group is restarted.
ERROR_GRACE_S = 10.0
# How long agents get to exit after QUIT before they are killed. An idle agent exits at once;
# one still in a step (its result no longer wanted) or stopped would only delay the exit past
# a service manager's grace period (docker stop: 10 s), after which it kills the master and
# the shared memory stays behind.
QUIT_GRACE_S = 2.0
_STOP_LOADING = threading.Event()


def stop_loading() -> None:
    """The process is shutting down: executors still waiting for their agents to load, or
    for a warm-up step, give up at once (within a second), kill the agents and free the
    shared memory."""
    _STOP_LOADING.set()


class AgentDiedError(LLMServingError):
    """A WorkAgent process exited; the step it was running is lost."""


class _Procs:
    """The processes and connections one executor owns (what the finalizer cleans up)."""

    def __init__(self):
        self.agents: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.scheduler: Optional[subprocess.Popen] = None
        self.broken = False          # a rank died or the group lost step; don't wait for QUIT


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, ready_timeout: float = 300.0,
                 cancel: Optional[threading.Event] = None):
        """``cancel``: once set, a wait for the agents (loading, a step) gives up within a
        second, raising AgentDiedError, as after ``stop_loading()``."""
        tp = config.parallel.tensor_parallel_size
        self._cancel = cancel
        check_tensor_parallel(config.model.hf, tp)   # before starting anything
        self.tp_size = tp
        self.step_timeout = config.execution.execute_model_timeout
        self._procs = p = _Procs()
        segments: list[ch.ShmSegment] = []
        stale = ch.remove_stale_segments()
        if stale:
            logger.info("removed %d shared-memory segments left in /dev/shm by servers that "
                        "no longer run", len(stale))
        try:
            s, c = config.scheduler, config.cache
            rows = max_sample_rows(config.speculative, s.max_num_seqs,
                                   s.max_num_batched_tokens)
            in_bytes = ch.step_channel_bytes(s.max_num_batched_tokens, rows,
                                             config.model.max_model_len, c.block_size,
                                             c.num_blocks, config.model.vocab_size,
                                             _kv_meta_bytes(config) + _lora_bytes(config)
                                             + _processor_bytes(config, rows)
                                             + _embeds_bytes(config))
            out_bytes = ch.result_channel_bytes(
                rows, config.model.max_logprobs,
                dump_vocab=config.model.vocab_size if config.dump else 0,
                max_tokens=s.max_num_batched_tokens,
                pooled_size=config.model.pooler.hidden_size if config.model.pooler else 0)
            self.shm_in, self.shm_out = [], []
            for _ in range(2):            # step n uses segment n % 2 in each direction
                self.shm_in.append(ch.ShmSegment(in_bytes))
                segments.append(self.shm_in[-1])
                self.shm_out.append(ch.ShmSegment(out_bytes))
                segments.append(self.shm_out[-1])
            plan = plan_launch(config, sys.executable)
            allreduce_env = _shm_allreduce_segment(config, plan.device, segments)
            sched_port = _free_port() if plan.scheduler else None
            if plan.scheduler:
                p.scheduler = subprocess.Popen(
                    plan.scheduler.command(), stdout=subprocess.DEVNULL,
                    env=plan.scheduler.environment(dict(os.environ), sched_port))
            shm = dict(shm_in=",".join(x.name for x in self.shm_in),
                       shm_out=",".join(x.name for x in self.shm_out))
            for agent in plan.agents:
                ours, theirs = socket.socketpair()
                try:
                    p.agents.append(subprocess.Popen(
                        agent.command(control_fd=theirs.fileno(), **shm),
                        pass_fds=[theirs.fileno()],
                        env={**agent.environment(dict(os.environ), sched_port),
                             **allreduce_env}))
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
                p.conns.append(Connection(ours.detach()))
        except BaseException:
            p.broken = True
            _cleanup(p, *segments)
            raise
        self.proc = p.agents[0]          # rank 0 (the only agent without tensor parallelism)
        self._step_no = 0
        self._outstanding: collections.deque = collections.deque()   # submitted step numbers
        self._mask_owed: Optional[tuple] = None    # (step number, its bitmask in shm)
        self._closed = False
        self._extras: dict[int, bytes] = {}      # rank -> bytes after its last frame
        self._kv_outputs: list = []              # connector outputs not taken yet
        self._lora_failed: dict[int, str] = {}   # adapters the agents could not read
        self._rpc_no = 0          # the last collective_rpc call sent (its RPC frames carry it)
        # Clean up even if the user never calls shutdown() (also runs at interpreter exit).
        self._finalizer = weakref.finalize(self, _cleanup, p, *segments)
        try:
            frames = self._wait_all(ready_timeout, "loading the model")
        except BaseException:
            self.shutdown()
            raise
        errors = [f"rank {r}: {payload}" if tp > 1 else payload
                  for r, (kind, _, payload) in enumerate(frames) if kind != ch.READY]
        if errors:
            self.shutdown()
            raise LLMServingError(f"the WorkAgent failed to start: {'; '.join(errors)}")
        self._kv_info = [json.loads(self._extras.pop(r, b"{}")) for r in range(tp)]

    def kv_connector_info(self) -> list:
        """Each rank's KV connector handshake (empty dicts without KV transfer)."""
        return list(self._kv_info)

    def take_kv_connector_output(self) -> list:
        """The KV connector outputs the ranks reported since the last call."""
        out, self._kv_outputs = self._kv_outputs, []
        return out

    def take_lora_failures(self) -> dict:
        """{adapter id: why} of the LoRA adapters an agent could not read since the last
        call (reported with the steps collected)."""
        out, self._lora_failed = self._lora_failed, {}
        return out

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The agents, by rank."""
        return list(self._procs.agents)

    @property
    def scheduler_proc(self) -> Optional[subprocess.Popen]:
        """MindSpore's collective scheduler (tensor parallel only)."""
        return self._procs.scheduler

    def is_alive(self) -> bool:
        return not self._closed and not self._procs.broken and self._dead() is None

    def _dead(self, answered: Sequence[bool] = ()) -> Optional[str]:
        """Why the group cannot run (an exited agent or scheduler), or None. Agents that have
        already ``answered`` the current wait are not checked (one that failed to load
        reports ERROR, then exits)."""
        p = self._procs
        for rank, proc in enumerate(p.agents):
            code = proc.poll()
            if code is not None and not (rank < len(answered) and answered[rank]):
                who = f"rank {rank} " if self.tp_size > 1 else ""
                return f"the WorkAgent {who}(pid {proc.pid}) exited with code {code}"
        if p.scheduler is not None and p.scheduler.poll() is not None:
            return (f"the collective scheduler (pid {p.scheduler.pid}) exited with code "
                    f"{p.scheduler.poll()}")
        return None

    def _died(self, message: str) -> AgentDiedError:
        self._procs.broken = True
        return AgentDiedError(message)

    def _wait_all(self, timeout: Optional[float], doing: str,
                  rpc: Optional[int] = None) -> list[tuple]:
        """One frame from every agent, by rank: (kind, step number, payload), where the
        payload is the ERROR reason or the DONE size. Waiting for collective_rpc call
        ``rpc``: its RPC frames (kind, ok, the pickled result or the error), a TimeoutError
        after ``timeout`` (the agents are not taken for hung). An RPC frame of another call
        (one that timed out) is dropped."""
        p = self._procs
        frames: list[Optional[tuple]] = [None] * len(p.conns)
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(f is None for f in frames):
            waiting = [c for c, f in zip(p.conns, frames) if f is None]
            left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            for conn in wait(waiting, left):
                rank = p.conns.index(conn)
                try:
                    frame = conn.recv_bytes()
                except (EOFError, OSError):
                    who = f"rank {rank} " if self.tp_size > 1 else ""
                    raise self._died(f"the WorkAgent {who}(pid {p.agents[rank].pid}) closed "
                                     f"its connection while {doing}") from None
                kind, step_no, n = ch.FRAME.unpack_from(frame)
                if kind == ch.RPC:
                    if step_no == rpc:
                        frames[rank] = (kind, bool(n), bytes(frame[ch.FRAME.size:]))
                    continue
                if kind == ch.LORA_FAILED:        # then its DONE
                    failed = json.loads(frame[ch.FRAME.size:])
                    self._lora_failed.update({int(k): v for k, v in failed.items()})
                    continue
                payload = (frame[ch.FRAME.size:].decode(errors="replace") if kind == ch.ERROR
                           else n)
                if kind != ch.ERROR and len(frame) > ch.FRAME.size:
                    # READY: the rank's KV connector handshake; DONE: its connector output
                    self._extras[rank] = bytes(frame[ch.FRAME.size:])
                frames[rank] = (kind, step_no, payload)
                if kind == ch.ERROR and self.tp_size > 1:
                    grace = time.monotonic() + ERROR_GRACE_S
                    deadline = grace if deadline is None else min(deadline, grace)
            if all(f is not None for f in frames):
                break
            dead = self._dead([f is not None for f in frames])
            if dead is not None:
                raise self._died(f"{dead} while {doing}")
            if _STOP_LOADING.is_set() or (self._cancel is not None and self._cancel.is_set()):
                raise self._died(f"stopped while {doing}")
            if deadline is not None and time.monotonic() > deadline:
                failed = [f for f in frames if f is not None and f[0] == ch.ERROR]
                late = [r for r, f in enumerate(frames) if f is None]
                if rpc is not None:
                    raise TimeoutError(f"{doing} did not finish within {timeout:g} s "
                                       f"(rank(s) {late})")
                if failed:
                    raise self._died(f"a WorkAgent failed while {doing}: {failed[0][2]}; "
                                     f"rank(s) {late} did not finish it")
                raise self._died(f"the WorkAgent did not answer within {timeout:.0f} s "
                                 f"while {doing}")
        return frames

    def submit(self, step: StepInput) -> None:
        """Hand ``step`` to every agent without waiting (at most two outstanding)."""
        if self._closed:
            raise LLMServingError("the executor is shut down")
        if self._procs.broken:
            raise AgentDiedError("a WorkAgent died; the executor must be restarted")
        if len(self._outstanding) >= 2:
            raise LLMServingError("two steps are outstanding already; collect one first")
        # Numbered only once packed: a step that does not fit must not shift the parity of
        # the segments while another step is outstanding.
        if self._mask_owed is not None:
            raise LLMServingError(f"step {self._mask_owed[0]}'s token mask was never sent")
        buf = self.shm_in[(self._step_no + 1) % 2].buf
        n = ch.pack(buf, ch.step_to_arrays(step))
        self._step_no += 1
        if int(step.mask_after_forward):
            self._mask_owed = (self._step_no, ch.bitmask_view(buf))
        frame = ch.FRAME.pack(ch.STEP, self._step_no, n)
        self._send_all(frame, f"step {self._step_no}")
        self._outstanding.append(self._step_no)

    def send_mask(self, bitmask: Optional[np.ndarray]) -> None:
        """The token bitmask of the step submitted last (with ``mask_after_forward``): written
        into its input segment, then announced to rank 0, which waits for it before sampling.
        None sends the placeholder (every token allowed: a step whose result is dropped)."""
        if self._mask_owed is None:
            raise LLMServingError("no submitted step waits for a token mask")
        step_no, view = self._mask_owed
        self._mask_owed = None
        if bitmask is not None:
            view[...] = bitmask
        try:
            self._procs.conns[0].send_bytes(ch.FRAME.pack(ch.MASK, step_no, 0))
        except OSError:
            proc = self._procs.agents[0]
            raise self._died(f"the WorkAgent (pid {proc.pid}) is gone (exit code "
                             f"{proc.poll()}) before step {step_no}'s token mask") from None

    def collect(self) -> Optional[SamplerOutput]:
        """Wait for the oldest outstanding step on every agent; rank 0's SamplerOutput (None
        when the step sampled nothing)."""
        if not self._outstanding:
            raise LLMServingError("no step is in flight")
        step_no = self._outstanding.popleft()
        if self._procs.broken:    # a hung or dead agent: its later steps are lost as well
            raise AgentDiedError(f"a WorkAgent died; step {step_no} is lost")
        if self._mask_owed is not None and self._mask_owed[0] == step_no:
            self.send_mask(None)     # collected unmasked (an engine failing its requests)
        frames = self._wait_all(self.step_timeout, f"running step {step_no}")
        if any(f[1] != step_no for f in frames):
            raise self._died(f"a WorkAgent answered step {[f[1] for f in frames]} while step "
                             f"{step_no} was expected")
        if self._extras:
            from llm_serving.distributed.kv_transfer.base import KVConnectorOutput
            self._kv_outputs += [KVConnectorOutput.from_bytes(b) for b in self._extras.values()]
            self._extras.clear()
        errors = [(r, f[2]) for r, f in enumerate(frames) if f[0] == ch.ERROR]
        if errors:
            who = f"rank {errors[0][0]} of " if self.tp_size > 1 else ""
            # the agent's error, then its traceback: the traceback to the log, not to clients
            error, _, trace = errors[0][1].partition("\n")
            logger.error("the WorkAgent %sfailed step %d: %s\n%s", who, step_no, error, trace)
            kind, _, said = error.partition(": ")
            if kind == LogitsProcessorError.__name__:     # the user's code, not the agent's
                raise LogitsProcessorError(said)
            raise LLMServingError(f"the WorkAgent {who}failed step {step_no}: {error}")
        return ch.result_from_arrays(ch.unpack(self.shm_out[step_no % 2].buf))

    def execute(self, step: StepInput) -> Optional[SamplerOutput]:
        self.submit(step)
        return self.collect()

    def move_blocks(self, swap_out: np.ndarray, swap_in: np.ndarray,
                    copies: np.ndarray) -> None:
        self.execute(StepInput(_EMPTY, _EMPTY, _EMPTY, np.zeros((0, 0), np.int32),
                               np.zeros(1, np.int32), _EMPTY, _EMPTY, None,
                               swap_out=swap_out, swap_in=swap_in, copies=copies))

    def _send_between_steps(self, frame: bytes, what: str) -> None:
        """``frame`` to every agent, with no step in flight (profile, collective_rpc); an
        AgentDiedError naming the agent that is gone."""
        if self._outstanding:
            raise LLMServingError(f"{what}: a step is in flight; collect it first")
        if self._closed or self._procs.broken:
            raise AgentDiedError("a WorkAgent died; the executor must be restarted")
        self._send_all(frame, what)

    def _send_all(self, frame: bytes, before: str) -> None:
        """``frame`` to every agent; an AgentDiedError naming the agent that is gone (before
        ``before``)."""
        for rank, conn in enumerate(self._procs.conns):
            try:
                conn.send_bytes(frame)
            except OSError:
                proc = self._procs.agents[rank]
                raise self._died(f"the WorkAgent (pid {proc.pid}) is gone (exit code "
                                 f"{proc.poll()}) before {before}") from None

    def profile(self, start: bool, prefix: Optional[str] = None) -> list[str]:
        """Start or stop every agent's trace recorder (--profiler-config), with no step in
        flight; the traces the agents wrote (when stopping)."""
        msg = json.dumps({"start": start, "prefix": prefix}).encode()
        self._send_between_steps(ch.FRAME.pack(ch.PROFILE, 0, len(msg)) + msg, "profile")
        doing = "starting the profiler" if start else "writing its profile"
        frames = self._wait_all(self.step_timeout, doing)
        paths = [self._extras.pop(r, b"").decode() for r in range(self.tp_size)]
        errors = [f[2] for f in frames if f[0] == ch.ERROR]
        if errors:
            raise LLMServingError(f"the WorkAgent failed {doing}: {errors[0]}")
        return [p for p in paths if p]

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        """vLLM's: ``method`` run on every agent between two steps (nothing in flight); the
        results by rank (``collective_rpc.py``). A TimeoutError after ``timeout`` seconds
        (None: no limit), a CollectiveRPCError naming the rank when the call raised there."""
        from llm_serving.executor.collective_rpc import (CollectiveRPCError, check_call,
                                                         encode_call, method_name)
        check_call(method, timeout, args, kwargs)
        msg = encode_call(method, args, kwargs)
        self._rpc_no += 1
        self._send_between_steps(ch.FRAME.pack(ch.RPC, self._rpc_no, len(msg)) + msg,
                                 "collective_rpc")
        name = method_name(method)
        frames = self._wait_all(timeout, f"collective_rpc({name})", rpc=self._rpc_no)
        for rank, (_, ok, data) in enumerate(frames):
            if not ok:
                who = f"rank {rank}" if self.tp_size > 1 else "the WorkAgent"
                raise CollectiveRPCError(f"collective_rpc({name}) failed on {who}: "
                                         f"{data.decode(errors='replace')}")
        return [pickle.loads(data) for _, _, data in frames]

    def kill(self) -> None:
        """Kill every process of the group now (a step they hold ends: its wait fails with
        AgentDiedError); ``shutdown`` then frees the connections and the shared memory."""
        self._procs.broken = True
        _kill(self._procs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()


def _kv_meta_bytes(config: EngineConfig) -> int:
    if config.kv_transfer is None:
        return 0
    from llm_serving.distributed.kv_transfer.base import MAX_METADATA_BYTES
    return MAX_METADATA_BYTES


def _lora_bytes(config: EngineConfig) -> int:
    """A step's LoRA fields at most: an adapter id per sequence, and max_loras paths (of at
    most PATH_MAX bytes, each byte at most 6 in JSON) with their ids."""
    if config.lora is None:
        return 0
    return 4 * config.scheduler.max_num_seqs + config.lora.max_loras * (6 * 4096 + 32)


def _embeds_bytes(config: EngineConfig) -> int:
    """A step's prompt embedding rows at most (enable_prompt_embeds): one float32 row and
    its index per token of the step."""
    if not config.model.enable_prompt_embeds:
        return 0
    return config.scheduler.max_num_batched_tokens * (4 * config.model.hf.hidden_size + 4)


def _processor_bytes(config: EngineConfig, rows: int) -> int:
    """A step's custom logits processor fields at most (none without processors)."""
    if not config.model.logits_processors:
        return 0
    from llm_serving.engine.processor_rows import channel_bytes
    from llm_serving.sample.custom_logits_processors import MAX_PARAMS_BYTES
    return channel_bytes(rows, config.model.max_model_len, MAX_PARAMS_BYTES)


def _shm_allreduce_segment(config: EngineConfig, device: str, segments: list) -> dict:
    """CPU tensor parallelism all-reduces through a segment this master owns (freed with the
    others on shutdown or an agent's death): its name for the agents' environment."""
    from llm_serving.distributed import shm_allreduce as sa
    tp = config.parallel.tensor_parallel_size
    cpu = device == "CPU"
    if tp < 2 or not cpu or config.parallel.cpu_allreduce != "shm":
        return {}
    slot = sa.slot_bytes_for(config.scheduler.max_num_batched_tokens,
                             config.model.hf.hidden_size)
    seg = ch.ShmSegment(sa.segment_bytes(tp, slot))
    segments.append(seg)
    return {sa.ENV_NAME: f"{seg.name}:{slot}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(p: _Procs) -> None:
    for proc in p.agents + ([p.scheduler] if p.scheduler is not None else []):
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _cleanup(p: _Procs, *segments: ch.ShmSegment) -> None:
    """QUIT every live agent and give them QUIT_GRACE_S together (kill at once if the group
    is broken: a rank may be stuck in a collective), then kill the scheduler, close the
    connections and unlink the segments."""
    try:
        if not p.broken:
            for proc, conn in zip(p.agents, p.conns):
                if proc.poll() is None:
                    try:
                        conn.send_bytes(ch.FRAME.pack(ch.QUIT, 0, 0))
                    except OSError:
                        pass
            deadline = time.monotonic() + QUIT_GRACE_S
            for proc in p.agents:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        _kill(p)
    finally:
        for conn in p.conns:
            conn.close()
        for seg in segments:
            seg.close()
