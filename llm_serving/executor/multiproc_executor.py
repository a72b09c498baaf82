"""Runs the model in a WorkAgent process (``agents/work_agent.py``) instead of in the master.

The master keeps the engine: scheduler, block manager, tokenizer. Each step it packs the
StepInput into an input segment and sends one STEP frame (``submit``); later it waits for
DONE, checking every second that the agent is still alive, and reads the SamplerOutput
(``collect``). Two steps may be outstanding, so that the master can hand over step N+1
while the agent computes step N: steps alternate between two input and two output
segments, so neither side overwrites what the other still reads. It has the model runner's
interface (``submit``/``collect``, ``execute``, ``move_blocks``), so the engine does not
know which it has.

A dead agent is detected within a second and raises ``AgentDiedError`` for the step.
``shutdown()`` (also run at exit) stops the agent and unlinks the shared memory.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

import numpy as np

from llm_serving.errors import LLMServingError
from llm_serving.executor import shm_channel as ch
from llm_serving.model_executor.layers.sampler import SamplerOutput
from llm_serving.model_executor.model_runner import StepInput

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
_EMPTY = np.zeros(0, np.int32)


class AgentDiedError(LLMServingError):
    """A WorkAgent process exited; the step it was running is lost."""


class MultiprocExecutor:
    def __init__(self, model_dir: str, num_blocks: int, block_size: int, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 checkpoint: Optional[str] = None, device: str = "auto", device_id: int = 0,
                 seed: int = 0, num_cpu_blocks: int = 0, dump_vocab: int = 0,
                 ready_timeout: float = 300.0):
        held = []             # freed if starting the agent fails before the finalizer owns them
        try:
            in_bytes = ch.step_channel_bytes(max_num_batched_tokens, max_num_seqs, max_model_len,
                                             block_size, num_blocks)
            out_bytes = ch.result_channel_bytes(max_num_seqs, dump_vocab=dump_vocab,
                                                max_tokens=max_num_batched_tokens)
            self.shm_in, self.shm_out = [], []
            for _ in range(2):            # step n uses segment n % 2 in each direction
                self.shm_in.append(ch.ShmSegment(in_bytes))
                held.append(self.shm_in[-1])
                self.shm_out.append(ch.ShmSegment(out_bytes))
                held.append(self.shm_out[-1])
            ours, theirs = socket.socketpair()
            held += [ours, theirs]
            self.proc = self._spawn(theirs, model_dir, num_blocks, block_size, checkpoint,
                                    device, device_id, seed, num_cpu_blocks)
        except BaseException:
            for h in held:
                h.close()
            raise
        theirs.close()
        self.conn = Connection(ours.detach())
        self._step_no = 0
        self._outstanding: collections.deque = collections.deque()   # submitted step numbers
        self._closed = False
        # Clean up even if the user never calls shutdown() (also runs at interpreter exit).
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self.conn,
                                           *self.shm_in, *self.shm_out)
        try:
            kind, _, payload = self._wait(ready_timeout, "loading the model")
        except BaseException:
            self.shutdown()
            raise
        if kind != ch.READY:
            self.shutdown()
            raise LLMServingError(f"the WorkAgent failed to start: {payload}")

    def _spawn(self, theirs: socket.socket, model_dir, num_blocks, block_size, checkpoint, device,
               device_id, seed, num_cpu_blocks) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "agents.work_agent", "--control-fd", str(theirs.fileno()),
               "--shm-in", ",".join(x.name for x in self.shm_in),
               "--shm-out", ",".join(x.name for x in self.shm_out),
               "--model", model_dir, "--num-blocks", str(num_blocks),
               "--block-size", str(block_size), "--num-cpu-blocks", str(num_cpu_blocks),
               "--device", device, "--device-id", str(device_id), "--seed", str(seed)]
        if checkpoint:
            cmd += ["--checkpoint", checkpoint]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def _wait(self, timeout: Optional[float], doing: str):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(1.0):
            code = self.proc.poll()
            if code is not None:
                raise AgentDiedError(f"the WorkAgent (pid {self.proc.pid}) exited with code "
                                     f"{code} while {doing}")
            if deadline is not None and time.monotonic() > deadline:
                raise AgentDiedError(f"the WorkAgent did not answer within {timeout:.0f} s "
                                     f"while {doing}")
        try:
            frame = self.conn.recv_bytes()
        except (EOFError, OSError):
            raise AgentDiedError(f"the WorkAgent (pid {self.proc.pid}) closed its connection "
                                 f"while {doing}") from None
        kind, step_no, n = ch.FRAME.unpack_from(frame)
        payload = frame[ch.FRAME.size:].decode(errors="replace") if kind == ch.ERROR else n
        return kind, step_no, payload

    def submit(self, step: StepInput) -> None:
        """Hand a step to the agent without waiting (at most two outstanding)."""
        if self._closed:
            raise LLMServingError("the executor is shut down")
        if len(self._outstanding) >= 2:
            raise LLMServingError("two steps are outstanding already; collect one first")
        self._step_no += 1
        n = ch.pack(self.shm_in[self._step_no % 2].buf, ch.step_to_arrays(step))
        try:
            self.conn.send_bytes(ch.FRAME.pack(ch.STEP, self._step_no, n))
        except OSError:
            raise AgentDiedError(f"the WorkAgent (pid {self.proc.pid}) is gone (exit code "
                                 f"{self.proc.poll()}) before step {self._step_no}") from None
        self._outstanding.append(self._step_no)

    def collect(self) -> Optional[SamplerOutput]:
        """Wait for the oldest outstanding step and return its result."""
        expected = self._outstanding.popleft()
        kind, step_no, payload = self._wait(None, f"running step {expected}")
        if step_no != expected:
            raise AgentDiedError(f"the WorkAgent answered step {step_no} while step "
                                 f"{expected} was expected")
        if kind == ch.ERROR:
            raise LLMServingError(f"the WorkAgent failed step {step_no}: {payload}")
        return ch.result_from_arrays(ch.unpack(self.shm_out[step_no % 2].buf))

    def execute(self, step: StepInput) -> Optional[SamplerOutput]:
        self.submit(step)
        return self.collect()

    def move_blocks(self, swap_out: np.ndarray, swap_in: np.ndarray,
                    copies: np.ndarray) -> None:
        self.execute(StepInput(_EMPTY, _EMPTY, _EMPTY, np.zeros((0, 0), np.int32),
                               np.zeros(1, np.int32), _EMPTY, _EMPTY, None,
                               swap_out=swap_out, swap_in=swap_in, copies=copies))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()


def _cleanup(proc: subprocess.Popen, conn: Connection, *segments: ch.ShmSegment) -> None:
    try:
        if proc.poll() is None:
            try:
                conn.send_bytes(ch.FRAME.pack(ch.QUIT, 0, 0))
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(10)
    finally:
        conn.close()
        for seg in segments:
            seg.close()
