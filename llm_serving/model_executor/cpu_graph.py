"""CPU graphs: a decode step captured once per batch size, then replayed kernel by kernel.

vLLM captures decode steps in CUDA graphs so that the GPU replays them without the Python
that launched each kernel. On CPU the same Python costs as much: a decode step of the 97 M
bench model makes ~110 kernel calls through ctypes, and the Cells, Tensors and checks around
them took ~4 ms of a 16 ms batch-1 step. Here a step's kernels are recorded as they run, with
their arguments (pointers and sizes), and later steps of the same batch size call the same
list again: inputs are copied into fixed buffers first, and every kernel writes where it
wrote during the capture.

How a step becomes replayable (``CpuGraphs.logits``):
1. the first decode step of ``b`` sequences runs eagerly (it warms the GEMM plan's probe);
2. the second runs eagerly too, recorded: every kernel call goes through ``launch``, and
   every kernel output is allocated with ``empty`` from one arena that all batch sizes share
   (only one step runs at a time, and the logits are copied out);
3. the third is replayed, then run eagerly (which rewrites its K/V slots), and the replay is
   kept only if its logits equal the eager ones bit for bit (a computation outside ``launch``
   would leave a stale value and fail this);
4. from then on the step is replayed.

Only what the recorded kernels read may change between replays: the step's token ids,
positions, slot mapping, block tables and sequence lengths (``CpuGraphs`` copies them into
the buffers the capture read), the KV cache's contents and the weights' contents. Steps with
prefill rows, multi-stream micro-batches, tensor parallelism or a KV connector run eagerly
(``ModelRunner`` decides), as do batch sizes above ``max_batch``. ``--enforce-eager`` (vLLM's
flag) turns replay off.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

logger = logging.getLogger(__name__)

_ALIGN = 64


class _Capture:
    """The kernel calls of one step being recorded, and the arena their outputs come from."""

    def __init__(self, arena: np.ndarray):
        self.arena = arena
        self.needed = 0                 # bytes the step asked for (may exceed the arena)
        self.ops: list = []
        self.unsupported: Optional[str] = None
        self.paused = 0

    def alloc(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        start = self.needed
        self.needed += -(-nbytes // _ALIGN) * _ALIGN
        if self.needed > len(self.arena):
            # Too small: this step finishes on fresh memory, and is not kept.
            return np.empty(shape, dtype)
        return self.arena[start:start + nbytes].view(dtype).reshape(shape)


class _State(threading.local):
    capture: Optional[_Capture] = None      # the step this thread is recording, if any


# Per thread: engines in one process (a PD pair in tests, several LLMs) may step at once, and
# one's kernels must never land in another's capture.
_state = _State()


def _recording() -> Optional[_Capture]:
    cap = _state.capture
    return cap if cap is not None and not cap.paused else None


def launch(fn: Callable, *args):
    """Call kernel ``fn(*args)``, recording the call when this thread captures a step.

    ``args`` must be what the kernel reads at call time (pointers, sizes, NumPy arrays it
    fills in place), never values computed from the data: a replay calls ``fn`` with the
    same arguments."""
    rc = fn(*args)
    cap = _recording()
    if cap is not None:
        cap.ops.append((fn, args))
    return rc


def empty(shape, dtype=np.float32) -> np.ndarray:
    """A kernel's output buffer: fresh memory, or during a capture the arena's."""
    cap = _recording()
    return cap.alloc(shape, dtype) if cap is not None else np.empty(shape, dtype)


def unsupported(reason: str) -> None:
    """Mark the step being captured (if any) as not replayable: ``reason`` computes outside
    ``launch`` (MindSpore's MatMul, a collective)."""
    cap = _recording()
    if cap is not None and cap.unsupported is None:
        cap.unsupported = reason


@contextlib.contextmanager
def paused():
    """Run eagerly, unrecorded, inside a capture (the GEMM plan's probe)."""
    cap = _state.capture
    if cap is None:
        yield
        return
    cap.paused += 1
    try:
        yield
    finally:
        cap.paused -= 1


@contextlib.contextmanager
def _capturing(arena: np.ndarray):
    if _state.capture is not None:
        raise RuntimeError("a capture is already running")
    _state.capture = cap = _Capture(arena)
    try:
        yield cap
    finally:
        _state.capture = None


@dataclass
class _Graph:
    ops: list
    logits: np.ndarray              # the arena's logits buffer [b, vocab]
    verified: bool = False

    def replay(self) -> None:
        for fn, args in self.ops:
            if fn(*args):
                raise RuntimeError(f"a replayed kernel ({getattr(fn, '__name__', fn)}) failed")


_SEEN, _FAILED = "seen", "failed"


@dataclass
class GraphStats:
    replayed_steps: int = 0
    captured: list = field(default_factory=list)    # batch sizes with a verified graph
    failed: dict = field(default_factory=dict)      # batch size -> why it runs eagerly


class CpuGraphs:
    """Decode steps of up to ``max_batch`` sequences, captured and replayed.

    ``forward(ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens)`` runs
    the model eagerly on those arrays and returns the logits of every row as float32 NumPy
    [b, vocab] (``ModelRunner._forward_logits``)."""

    def __init__(self, forward: Callable, max_batch: int, max_blocks_per_seq: int):
        self.forward = forward
        self.max_batch = max_batch
        n = max_batch
        # The inputs every graph reads: a step's are copied in before it runs.
        self.ids = np.zeros(n, np.int32)
        self.positions = np.zeros(n, np.int32)
        self.slot_mapping = np.zeros(n, np.int32)
        self.block_tables = np.zeros((n, max_blocks_per_seq), np.int32)
        self.query_start_loc = np.arange(n + 1, dtype=np.int32)     # one row per sequence
        self.seq_lens = np.zeros(n, np.int32)
        self.arena = np.empty(0, np.uint8)
        self.graphs: dict = {}
        self.stats = GraphStats()

    def replayable(self, step) -> bool:
        """A decode-only step (one row per sequence) of at most ``max_batch`` sequences whose
        block tables fit."""
        b = len(step.input_ids)
        return (0 < b <= self.max_batch and len(step.seq_lens) == b
                and step.block_tables.shape[1] <= self.block_tables.shape[1])

    def logits(self, step, rows: np.ndarray) -> Optional[np.ndarray]:
        """The logits of ``rows`` for a step ``replayable`` accepted, or None: run it eagerly."""
        b = len(step.input_ids)
        graph = self.graphs.get(b)
        if graph is None:
            self.graphs[b] = _SEEN
            return None
        if graph is _FAILED:
            return None
        self._load(step)
        if graph is _SEEN:
            return self._capture(b)[rows]          # (fancy indexing: a copy)
        if not graph.verified:
            # Replay first: a bad replay writes wrong K/V into this step's slots, and the
            # eager run then writes them again, right.
            graph.replay()
            replayed = graph.logits.copy()
            eager = self._eager(b)
            if np.array_equal(replayed, eager):
                graph.verified = True
                if not self.stats.captured and not self.stats.replayed_steps:
                    logger.info("CPU graphs: decode steps of up to %d sequences are replayed "
                                "from a capture of their kernels (the first: %d; "
                                "--enforce-eager turns it off)", self.max_batch, b)
                self.stats.captured.append(b)
            else:
                self._fail(b, "its replay did not reproduce the eager logits")
            return eager[rows]
        graph.replay()
        self.stats.replayed_steps += 1
        return graph.logits[rows]       # a copy: the next replay overwrites the arena

    def _load(self, step) -> None:
        b, w = len(step.input_ids), step.block_tables.shape[1]
        self.ids[:b] = step.input_ids
        self.positions[:b] = step.positions
        self.slot_mapping[:b] = step.slot_mapping
        self.block_tables[:b, :w] = step.block_tables
        self.seq_lens[:b] = step.seq_lens

    def _eager(self, b: int) -> np.ndarray:
        return self.forward(self.ids[:b], self.positions[:b], self.slot_mapping[:b],
                            self.block_tables[:b], self.query_start_loc[:b + 1],
                            self.seq_lens[:b])

    def _capture(self, b: int, again: bool = True) -> np.ndarray:
        with _capturing(self.arena) as cap:
            logits = self._eager(b)
        if cap.unsupported is not None:
            self._fail(b, cap.unsupported)
        elif cap.needed > len(self.arena):
            # The step ran on fresh memory. Grow the arena for every size up to max_batch at
            # once (outputs scale with the rows): the graphs on the old one are captured
            # again when their size comes back, this one now (running a step again rewrites
            # the same K/V slots with the same values).
            size = max(cap.needed, -(-cap.needed * self.max_batch // b))
            logger.debug("CPU graph arena: %d -> %d MB", len(self.arena) >> 20, size >> 20)
            self.arena = _aligned_bytes(size)
            self.graphs = {k: (_SEEN if isinstance(v, _Graph) else v)
                           for k, v in self.graphs.items()}
            self.stats.captured.clear()
            if again:
                return self._capture(b, again=False)
        else:
            self.graphs[b] = _Graph(cap.ops, logits)
        return logits

    def _fail(self, b: int, why: str) -> None:
        if not self.stats.failed:
            logger.warning("decode steps of %d sequences run eagerly: %s", b, why)
        self.graphs[b] = _FAILED
        self.stats.failed[b] = why


def _aligned_bytes(n: int) -> np.ndarray:
    raw = np.empty(n + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off:off + n]
