"""A host shared-memory all-reduce between the tensor-parallel WorkAgents of one machine.

On CPU, MindSpore's mccl moves a 4 MB all-reduce at about 0.25 GB/s (14-22 ms, NOTES.md);
through shared memory it is two memory copies and an add. vLLM's CPU backend has the same
idea. mccl (and HCCL on Ascend) stays for multi-host groups and for the other collectives.

The segment is created and unlinked by the master (``segment_bytes`` sizes it from the
config), so it is freed on shutdown and when an agent dies. Layout: one 64-byte line per
counter (``arrived[rank]``, ``done[rank]``), then two parities x ``size`` slots of
``slot_bytes``. An all-reduce of a float32 array in place, chunk by chunk of a slot:

1. wait until every rank is done reading this parity's slots from two rounds ago;
2. copy my chunk into my slot, then publish ``arrived[me] = round``;
3. wait until every rank has arrived, sum the slots in rank order into my chunk (every rank
   adds in the same order, so all get the same bits), publish ``done[me] = round``.

Waits sleep on a futex and are bounded (``timeout``): a peer that never arrives raises
instead of hanging. The
counters are published after the data with plain stores, which x86's total store order keeps
in order; a weakly ordered host (ARM) would need fences, and uses mccl/HCCL here.
"""
from __future__ import annotations

import ctypes
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

_LINE = 64
ENV_NAME = "LLM_SERVING_SHM_ALLREDUCE"          # the segment's name, set by the master
MAX_SLOT_BYTES = 8 << 20

# Waiting for a peer: the Linux futex on the counter's word, as pthread mutexes do. A woken
# rank runs at once; polling with short sleeps was 2-4x slower on a busy machine (each
# timer wake-up may wait a scheduler slice). The low 32 bits of a little-endian int64 are the
# futex word; a wait returns when the word changes, on a wake, or after 1 ms at most.
_SYS_FUTEX = 202 if __import__("platform").machine() in ("x86_64", "AMD64") else 98
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1          # shared between processes (not FUTEX_PRIVATE)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_MS = _Timespec(0, 1_000_000)


def _futex_wait(counters: np.ndarray, k: int, seen: int) -> None:
    addr = counters.ctypes.data + k * counters.strides[0]
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(seen),
                  ctypes.byref(_MS), None, 0)


def _futex_wake(counters: np.ndarray, k: int) -> None:
    addr = counters.ctypes.data + k * counters.strides[0]
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def slot_bytes_for(max_tokens: int, hidden_size: int) -> int:
    """A slot holds one step's largest all-reduce (tokens x hidden floats), up to 8 MB;
    larger ones go through in chunks."""
    return min(MAX_SLOT_BYTES, max(4096, 4 * max_tokens * hidden_size))


def segment_bytes(size: int, slot_bytes: int) -> int:
    return 2 * size * _LINE + 2 * size * slot_bytes


class ShmAllReduce:
    def __init__(self, name: str, rank: int, size: int, slot_bytes: int,
                 timeout: float = 120.0):
        self.shm = shared_memory.SharedMemory(name=name)
        # The master owns the segment: this process's tracker must not unlink it at exit.
        resource_tracker.unregister(self.shm._name, "shared_memory")
        if self.shm.size < segment_bytes(size, slot_bytes):
            raise ValueError(f"all-reduce segment {name} has {self.shm.size} bytes, needs "
                             f"{segment_bytes(size, slot_bytes)}")
        self.rank, self.size, self.timeout = rank, size, timeout
        buf = self.shm.buf
        stride = _LINE // 8
        counters = np.frombuffer(buf, np.int64, 2 * size * stride, 0).reshape(2, size, stride)
        self.arrived, self.done = counters[0, :, 0], counters[1, :, 0]
        self.slot_floats = slot_bytes // 4
        self.slots = np.frombuffer(buf, np.float32, 2 * size * self.slot_floats,
                                   2 * size * _LINE).reshape(2, size, self.slot_floats)
        self.round = int(self.arrived[rank])

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Sum the ranks' ``x`` (float32, C-contiguous) in place; returns ``x``."""
        flat = x.reshape(-1)
        for start in range(0, len(flat), self.slot_floats):
            self._chunk(flat[start:start + self.slot_floats])
        return x

    def _chunk(self, chunk: np.ndarray) -> None:
        self.round += 1
        r, n = self.round, len(chunk)
        p = r & 1
        self._wait(self.done, r - 2)
        self.slots[p, self.rank, :n] = chunk
        self._publish(self.arrived, r)
        self._wait(self.arrived, r)
        np.add(self.slots[p, 0, :n], self.slots[p, 1, :n], out=chunk)
        for k in range(2, self.size):
            chunk += self.slots[p, k, :n]
        self._publish(self.done, r)

    def _wait(self, counters: np.ndarray, r: int) -> None:
        """Until every rank's counter reaches round ``r``: sleep on the futex of a counter
        that is behind (its low 32 bits), woken by its rank's ``_publish``."""
        deadline = None
        while True:
            behind = np.flatnonzero(counters < r)
            if not len(behind):
                return
            k = int(behind[0])
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                raise RuntimeError(f"shared-memory all-reduce: a peer rank did not arrive "
                                   f"within {self.timeout:.0f} s (round {r})")
            seen = int(counters[k]) & 0xFFFFFFFF
            _futex_wait(counters, k, seen)

    def _publish(self, counters: np.ndarray, r: int) -> None:
        counters[self.rank] = r
        _futex_wake(counters, self.rank)

    def close(self) -> None:
        self.arrived = self.done = self.slots = None
        try:
            self.shm.close()
        except BufferError:
            pass
