"""How the micro-batches' phases run: one small interface, three implementations.

A decorated decoder layer runs each phase (attention, then FFN) of micro-batch A, then of B,
inside ``overlap.phase()``, and calls ``overlap.wait(handles)`` before a phase reads what an
earlier phase's communication produces:

- ``SequentialOverlap``: communication blocks where it is issued. The same micro-batch
  schedule with nothing overlapped: the correctness reference, on any device and TP size.
- ``ThreadOverlap`` (CPU, TP >= 2): the tensor-parallel all-reduces issued inside a phase go
  to one communication thread (a bounded queue, in issue order, the same order on every
  rank) and run there, over the host shared-memory all-reduce, while this thread computes
  the other micro-batch.
- ``StreamOverlap`` (Ascend): the all-reduces run on a second ``mindspore.runtime.Stream``,
  ordered after the compute stream by an event and waited for by one. **Never run**: this
  machine has no NPU (docs/multistream.md).

The runner sets the one in use at start-up (``set_overlap``); the layers find it with
``get_overlap``.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from llm_serving.model_executor.parallel_state import TPGroup, get_tp_group

# Most all-reduces waiting for the communication thread (two phases of two micro-batches
# issue at most a few; the bound keeps a stuck peer from growing the queue).
MAX_PENDING = 16
WAIT_TIMEOUT_S = 120.0


class SequentialOverlap:
    name = "sequential"

    @contextmanager
    def phase(self) -> Iterator[list]:
        yield []

    def wait(self, handles) -> None:
        pass

    def close(self) -> None:
        pass


class _Handle:
    __slots__ = ("event", "error")

    def __init__(self):
        self.event = threading.Event()
        self.error = None

    def wait(self) -> None:
        if not self.event.wait(WAIT_TIMEOUT_S):
            raise RuntimeError(f"a multi-stream all-reduce did not finish within "
                               f"{WAIT_TIMEOUT_S:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"a multi-stream all-reduce failed: {self.error}")


class ThreadOverlap:
    name = "overlapped"

    def __init__(self, tp: TPGroup):
        if tp.shm is None:
            raise RuntimeError("overlapped multi-stream on CPU needs the shared-memory "
                               "all-reduce (cpu_allreduce=shm)")
        self.tp = tp
        self._queue: queue.Queue = queue.Queue(MAX_PENDING)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ms-comm")
        self._thread.start()
        # The two threads share the agent's core(s): hand the interpreter over often, so a
        # finished all-reduce is noticed within half a millisecond, not 5 ms.
        sys.setswitchinterval(5e-4)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, handle = item
            t0 = time.perf_counter()
            try:
                self.tp.shm.all_reduce(tensor.asnumpy())    # a view of the tensor on CPU
            except Exception as e:    # noqa: BLE001 - reported to the waiter
                handle.error = e
            if self.tp.timers is not None:
                self.tp.timers.comm_s += time.perf_counter() - t0
            handle.event.set()

    def submit(self, tensor) -> _Handle:
        handle = _Handle()
        self._queue.put((tensor, handle), timeout=WAIT_TIMEOUT_S)
        return handle

    @contextmanager
    def phase(self) -> Iterator[list]:
        with self.tp.deferred(self, []) as handles:
            yield handles

    def wait(self, handles) -> None:
        timers = self.tp.timers
        t0 = time.perf_counter() if timers is not None else 0.0
        for h in handles:
            h.wait()
        if timers is not None:
            timers.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5.0)


class StreamOverlap:
    """Ascend: communication on its own stream (never run here; see the module doc)."""
    name = "overlapped"

    def __init__(self, tp: TPGroup):
        from mindspore import runtime
        self.tp, self.runtime = tp, runtime
        self.stream = runtime.Stream()

    def submit(self, tensor):
        rt = self.runtime
        ready = rt.Event()
        ready.record(rt.current_stream())          # the tensor's producer is done
        with rt.StreamCtx(self.stream):
            self.stream.wait_event(ready)
            from mindspore.mint.distributed import all_reduce
            all_reduce(tensor)
            done = rt.Event()
            done.record(self.stream)
        return done

    @contextmanager
    def phase(self) -> Iterator[list]:
        with self.tp.deferred(self, []) as handles:
            yield handles

    def wait(self, handles) -> None:
        for event in handles:
            self.runtime.current_stream().wait_event(event)

    def close(self) -> None:
        pass


_overlap = SequentialOverlap()


def get_overlap():
    return _overlap


def set_overlap(mode: str, device: str = "CPU"):
    """Install the implementation for ``mode`` ("sequential" or "overlapped") in this
    process (its tensor-parallel group must be set up first). Returns it."""
    global _overlap
    _overlap.close()
    tp = get_tp_group()
    if mode == "overlapped" and tp.size > 1:
        _overlap = StreamOverlap(tp) if device == "Ascend" else ThreadOverlap(tp)
    else:
        _overlap = SequentialOverlap()
    return _overlap
