"""The tensor-parallel group of this process: one WorkAgent is one rank.

A WorkAgent started with ``--tp-size N > 1`` calls ``init_tensor_parallel`` once, before the
model is built; MindSpore's collectives then run over ``mccl`` on CPU or HCCL on Ascend. On
CPU the all-reduces go through a host shared-memory segment instead when the master made one
(``distributed/shm_allreduce.py``; ``parallel.cpu_allreduce``), an order of magnitude faster.

Multi-stream's overlapped phases (``multistream/overlap.py``) hand the all-reduces to a
communicator that runs them asynchronously (``deferred``); the phase's caller waits for them
before the results are read.
Everything else (the in-process runner, a single agent) keeps the trivial group of one rank.

Only the parallel layers (``layers/linear.py``) call the collectives; model code does not.
Every rank runs every step, so all ranks issue the same collectives in the same order.
"""
from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np
from mindspore import Tensor



class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, shm=None):
        self.rank, self.size = rank, size
        self.shm = shm              # a ShmAllReduce, or None: MindSpore's collectives
        self._defer = None          # (communicator, handles) inside ``deferred``
        self.timers = CommTimers.from_env(rank)   # bench only: None unless asked for

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers the master with the step's result."""
        return self.rank == 0

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the ranks, in place (every rank gets the sum). Returns ``t``."""
        if self.size > 1:
            if self._defer is not None:
                comm, handles = self._defer
                handles.append(comm.submit(t))
            else:
                t0 = time.perf_counter() if self.timers is not None else 0.0
                if self.shm is not None:
                    self.shm.all_reduce(t.asnumpy())   # on CPU a view of the tensor's memory
                else:
                    from mindspore.mint.distributed import all_reduce
                    all_reduce(t)
                    _let_comm_threads_run()
                if self.timers is not None:
                    dt = time.perf_counter() - t0
                    self.timers.comm_s += dt
                    self.timers.wait_s += dt
        return t

    @property
    def deferring(self) -> bool:
        return self._defer is not None

    @contextmanager
    def deferred(self, comm, handles: list) -> Iterator[list]:
        """All-reduces issued inside run through ``comm.submit`` (asynchronously, in issue
        order): each returns its tensor at once, and holds the sum only once its handle, now
        in ``handles``, is waited for."""
        previous, self._defer = self._defer, (comm, handles)
        try:
            yield handles
        finally:
            self._defer = previous

    def broadcast_from_driver(self, ids: np.ndarray) -> np.ndarray:
        """Rank 0's int32 ``ids`` on every rank (the other ranks pass zeros of the same
        shape): the previous step's samples, which only rank 0 has, for async scheduling.
        Sent as float32 through an all-reduce, exact for ids below 2**24."""
        if self.size == 1:
            return ids
        t = Tensor(ids.astype(np.float32))
        self.all_reduce(t)
        return t.asnumpy().astype(np.int32)

    def gather_last_dim(self, t: Tensor) -> Optional[np.ndarray]:
        """Concatenate every rank's ``t`` [M, N] along the last dim on rank 0: [M, size * N]
        there, None on the other ranks."""
        if self.size == 1:
            return t.asnumpy()
        from mindspore.mint.distributed import gather
        parts = [np.empty(t.shape, np.float32) for _ in range(self.size)]
        gather(t, [Tensor.from_numpy(p) for p in parts], dst=0)
        _let_comm_threads_run()
        return np.concatenate(parts, axis=-1) if self.is_driver else None


class CommTimers:
    """Per-phase communication timers for bench/bench_multistream.py, on only when
    ``LLM_SERVING_COMM_TIMERS`` names a directory: seconds spent in all-reduces (``comm_s``)
    and seconds the compute thread waited for them (``wait_s``: all of a blocking one, only
    the exposed part of an overlapped one). Written to ``<dir>/rank<r>.json`` after each step."""

    def __init__(self, path: str):
        self.path, self.comm_s, self.wait_s, self.steps = path, 0.0, 0.0, 0

    @classmethod
    def from_env(cls, rank: int) -> Optional["CommTimers"]:
        d = os.environ.get("LLM_SERVING_COMM_TIMERS")
        return cls(os.path.join(d, f"rank{rank}.json")) if d else None

    def step_done(self) -> None:
        import json
        self.steps += 1
        with open(self.path, "w") as f:
            json.dump({"comm_s": self.comm_s, "wait_s": self.wait_s, "steps": self.steps}, f)


def _let_comm_threads_run() -> None:
    """Give the CPU to mccl's send/receive threads before computing on. A collective can
    return while its last message still waits in the send thread's queue; an agent pinned to
    one core then computes the next layer first (the scheduler does not preempt for it), and
    the peer waits for that message meanwhile. Measured with two agents on one core each: an
    all-reduce of 768 floats after 1 ms of compute took 1.5 ms, 0.23 ms with this yield."""
    os.sched_yield()


_group = TPGroup()


def get_tp_group() -> TPGroup:
    return _group


def init_tensor_parallel(rank: int, size: int, device: str) -> TPGroup:
    """Join the collective group (the master set MS_ROLE, MS_SCHED_HOST/PORT, MS_WORKER_NUM and
    MS_NODE_ID in this process's environment and runs the scheduler). Takes a few seconds."""
    global _group
    if size > 1:
        from mindspore.communication import get_group_size, get_rank, init
        _wait_for_scheduler()
        init("mccl" if device == "CPU" else "hccl")
        if (get_rank(), get_group_size()) != (rank, size):
            raise RuntimeError(f"collective init gave rank {get_rank()} of {get_group_size()}, "
                               f"expected {rank} of {size}")
    shm = None
    from llm_serving.distributed.shm_allreduce import ENV_NAME, ShmAllReduce
    if size > 1 and device == "CPU" and os.environ.get(ENV_NAME):
        name, _, slot = os.environ[ENV_NAME].partition(":")
        shm = ShmAllReduce(name, rank, size, int(slot))
    _group = TPGroup(rank, size, shm)
    return _group


def _wait_for_scheduler(timeout: float = 120.0) -> None:
    """Wait until the scheduler accepts connections. A worker whose first registration
    attempt finds no scheduler yet keeps failing to register for tens of seconds (measured:
    40-75 s with pinned agents, against about 5 s for init when the scheduler is up)."""
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT")
    if not host or not port:
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), 1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the collective scheduler at {host}:{port} did not come "
                                   f"up within {timeout:.0f} s") from None
            time.sleep(0.05)
