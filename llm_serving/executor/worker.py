"""A WorkAgent: one process per device. It loads the model, owns the KV cache, and runs the
steps the master announces.

Started by the master (``llm_serving.executor.multiproc_executor``) with the control
connection's file descriptor and the two shared-memory segments' names:

    python -m llm_serving.executor.worker --control-fd N --tp-rank R --shm-in A,B --shm-out C,D
        --config '{...the EngineConfig as JSON...}'

Protocol (frames are ``shm_channel.FRAME``: kind, step number, payload bytes):
- agent -> master READY once the model is loaded (or ERROR with the reason, then exit);
- master -> agent STEP n: a StepInput is packed in input segment n % 2; the agent runs it and
  answers DONE n with the SamplerOutput packed in output segment n % 2, or ERROR n (the
  master may send STEP n+1 before DONE n arrives: steps run in order); before DONE n,
  LORA_FAILED n with JSON {adapter id: why} when a LoRA adapter of the step could not be
  read (its rows ran without it; the master ends its requests, the step stands);
- master -> agent MASK n: step n was sent with ``mask_after_forward`` (its token bitmask
  needs step n-1's samples); the master has now written the bitmask into input segment n % 2.
  Rank 0 runs step n's forward, then waits for this frame (at most MASK_TIMEOUT_S) before
  sampling. A STEP frame read meanwhile is kept for later; a MASK for another step is dropped;
- master -> agent PROFILE (no step in flight; --profiler-config): JSON {"start": bool,
  "prefix": str or null}: the agent starts its trace recorder (``profiler.py``) or stops it,
  writing its trace; it answers PROFILE with the trace's path (empty if none), or ERROR. A
  trace still recording at QUIT is dropped (the master stops the profile first when it
  shuts down);
- master -> agent RPC n (no step in flight): collective_rpc's call n, pickled
  (``collective_rpc.py``); the agent runs it and answers RPC n with its size field 1 and the
  pickled result, or 0 and the error's ``Type: message``. It goes on serving either way;
- master -> agent QUIT: the agent exits.

Tensor parallel (``parallel.tensor_parallel_size`` N > 1): the master starts N agents (ranks)
and MindSpore's collective scheduler (``comm_scheduler.py``), and sets MS_ROLE,
MS_SCHED_HOST/PORT, MS_WORKER_NUM and MS_NODE_ID. Every rank reads each step from the shared input segment and
runs it; only rank 0 samples and writes the output segment, the others answer DONE n with an
empty payload. ``parallel.cpu_affinity[rank]`` pins the agent to its cores before MindSpore
loads (so MindSpore and our kernels' thread pool size themselves to them).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Optional

# How long rank 0 waits, after a step's forward, for the master's token mask. The master sends
# it as soon as the previous step's samples are processed (milliseconds); this only bounds a
# master that hangs.
MASK_TIMEOUT_S = 60.0


def ignore_stop_signals() -> None:
    """The master decides when its helper processes stop: Ctrl-C in a terminal reaches the
    whole process group, and so does SIGTERM from `timeout`, `kill -- -PGID` or a service
    manager; the master then drains and sends QUIT (or kills them). Left to SIGTERM, agents
    died first and the master restarted them before stopping."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m llm_serving.executor.worker")
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--shm-in", required=True, help="the two input segments' names, A,B")
    ap.add_argument("--shm-out", required=True, help="the two output segments' names, C,D")
    ap.add_argument("--config", required=True, help="the EngineConfig, as JSON")
    return ap.parse_args(argv)


def watch_parent(on_gone, parent: Optional[int] = None) -> None:
    """Call ``on_gone()`` once the process ``parent`` (default: this process's parent now)
    is no longer its parent, i.e. it died, whatever the main thread is doing: a daemon thread
    watches ``os.getppid()``."""
    import threading
    parent = os.getppid() if parent is None else parent

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        on_gone()
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def exit_with_master() -> None:
    """Exit at once if the master dies, whatever this process is doing (loading a model
    included, when it does not read the control connection)."""
    watch_parent(lambda: _exit(0))


def _configure_logging(rank: int) -> None:
    """Log to stderr (the master's) at the master's --log-level, naming the agent."""
    import logging
    level = os.environ.get("LLM_SERVING_LOG_LEVEL", "INFO").upper()
    from llm_serving.vllm_env import logging_prefix
    prefix = logging_prefix()       # VLLM_LOGGING_PREFIX, as the master's lines
    logging.basicConfig(level=level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO",
                        format=f"{prefix}%(asctime)s %(levelname)s %(name)s (WorkAgent {rank}): "
                               "%(message)s")


def main(argv=None) -> int:
    args = parse_args(argv)
    ignore_stop_signals()
    exit_with_master()
    conn = Connection(args.control_fd)
    rank = args.tp_rank
    _configure_logging(rank)
    # Only the standard library so far: reading the config needs no MindSpore.
    from llm_serving.config import EngineConfig
    config = EngineConfig.from_json(args.config)
    tp_size = config.parallel.tensor_parallel_size
    cpus = config.parallel.cores_of(rank)
    if cpus:
        # Before MindSpore and the kernels load: their thread pools size from the affinity.
        os.sched_setaffinity(0, cpus)
    importlib.import_module("llm_serving")   # sets the OpenMP policy before MindSpore loads
    from llm_serving.executor import shm_channel as ch
    try:
        from llm_serving.model_executor.device import init_device
        from llm_serving.model_executor.model_runner import ModelRunner
        from llm_serving.model_executor.parallel_state import init_tensor_parallel
        device = init_device(config.device.device, config.device.start_device_id + rank)
        if device == "CPU" and (cpus or tp_size > 1):
            # Pinned: MindSpore's own pool to the agent's cores. Unpinned ranks share the
            # machine: each gets its share of the cores (else each rank's threads fight the
            # other ranks' on every core).
            import mindspore as ms
            from llm_serving.model_executor.attention import kernels
            n = len(cpus) if cpus else max(1, len(os.sched_getaffinity(0)) // tp_size)
            ms.device_context.cpu.op_tuning.threads_num(n)
            kernels.set_num_threads(n)
        tp = init_tensor_parallel(rank, tp_size, device)
        # MindSpore's collective init installs its own SIGINT handler, which stops this
        # rank's communication at Ctrl-C: the drain's steps then hung in a collective.
        ignore_stop_signals()
        runner = ModelRunner(config)
        # Step n reads input segment n % 2; rank 0 writes its result to output segment n % 2.
        shm_in = [ch.ShmSegment(name=n) for n in args.shm_in.split(",")]
        shm_out = ([ch.ShmSegment(name=n) for n in args.shm_out.split(",")] if tp.is_driver
                   else None)
    except Exception as e:   # noqa: BLE001 - reported to the master, which names it
        msg = f"{type(e).__name__}: {e}".encode()
        conn.send_bytes(ch.FRAME.pack(ch.ERROR, -1, len(msg)) + msg)
        return 1
    hello = runner.kv_connector_info_bytes()
    conn.send_bytes(ch.FRAME.pack(ch.READY, 0, len(hello)) + hello)
    control = Control(conn)
    recorder = None
    worker = None           # collective_rpc's Worker (made at the first call)
    while True:
        kind, step_no, payload = control.next()
        if kind == ch.QUIT:
            _exit(0)
        if kind != ch.STEP:
            if kind == ch.PROFILE:
                recorder = recorder or _recorder(config, rank)
                conn.send_bytes(_profile(recorder, payload))
            elif kind == ch.RPC:
                from llm_serving.executor.collective_rpc import Worker, answer
                worker = worker or Worker(runner, rank, tp_size)
                ok, data = answer(worker, payload)
                conn.send_bytes(ch.FRAME.pack(ch.RPC, step_no, int(ok)) + data)
            continue                     # (a late MASK of a step that failed or timed out)
        try:
            step = ch.step_from_arrays(ch.unpack(shm_in[step_no % len(shm_in)].buf))
            runner.wait_for_mask = lambda n=step_no: control.wait_mask(n)
            result = runner.execute(step)   # (one with no tokens moves KV or reads adapters)
            failed = runner.take_lora_failures()
            if failed:
                msg = json.dumps(failed).encode()
                conn.send_bytes(ch.FRAME.pack(ch.LORA_FAILED, step_no, len(msg)) + msg)
            n = (ch.pack(shm_out[step_no % len(shm_out)].buf, ch.result_to_arrays(result))
                 if shm_out is not None else 0)
            # Every rank appends its KV connector output (small JSON; none without PD).
            conn.send_bytes(ch.FRAME.pack(ch.DONE, step_no, n) + runner.kv_output_bytes())
        except Exception as e:   # noqa: BLE001 - the master fails the step, the agent lives
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}".encode()
            conn.send_bytes(ch.FRAME.pack(ch.ERROR, step_no, len(msg)) + msg)


def _recorder(config, rank: int):
    from llm_serving.profiler import TraceRecorder, agent_name
    return TraceRecorder(config.profiler, agent_name(rank)) if config.profiler else None


def _profile(recorder, payload: bytes) -> bytes:
    """The answer to a PROFILE frame: start or stop ``recorder`` (the path written)."""
    from llm_serving.executor import shm_channel as ch
    try:
        if recorder is None:
            raise ValueError("profiling is not enabled (--profiler-config)")
        ask = json.loads(payload)
        path = recorder.start(ask["prefix"]) if ask["start"] else recorder.stop()
        msg, kind = (path or "").encode(), ch.PROFILE
    except Exception as e:   # noqa: BLE001 - reported to the master, which names it
        msg, kind = f"{type(e).__name__}: {e}".encode(), ch.ERROR
    return ch.FRAME.pack(kind, 0, len(msg)) + msg


class Control:
    """The control connection, as the step loop reads it: frames in order, except that a
    STEP frame read while waiting for a step's token mask is kept for later."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.backlog: list[tuple] = []

    def _recv(self, timeout: Optional[float] = None) -> Optional[tuple]:
        from llm_serving.executor import shm_channel as ch
        if timeout is not None and not self.conn.poll(timeout):
            return None
        try:
            frame = self.conn.recv_bytes()
        except (EOFError, OSError):          # the master is gone
            _exit(0)
        kind, step_no, _ = ch.FRAME.unpack_from(frame)
        if kind == ch.QUIT:
            _exit(0)
        return kind, step_no, frame[ch.FRAME.size:]

    def next(self) -> tuple:
        return self.backlog.pop(0) if self.backlog else self._recv()

    def wait_mask(self, step_no: int) -> None:
        """Block until the master's MASK frame for ``step_no`` (bounded: MASK_TIMEOUT_S)."""
        from llm_serving.executor import shm_channel as ch
        deadline = time.monotonic() + MASK_TIMEOUT_S
        while True:
            got = self._recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise TimeoutError(f"the master sent no token mask for step {step_no} within "
                                   f"{MASK_TIMEOUT_S:.0f} s")
            if got[:2] == (ch.MASK, step_no):
                return
            if got[0] != ch.MASK:            # (a stale MASK is dropped)
                self.backlog.append(got)


def _exit(code: int) -> None:
    # The master owns the shared memory; skip interpreter teardown (MindSpore's is slow, and
    # the step arrays still view the segments).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
