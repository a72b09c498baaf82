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
   every kernel output is allocated with ``empty``, on fresh memory kept until the step ends;
3. the recorded calls are laid out on one arena that all batch sizes share (only one step
   runs at a time, and the logits are copied out): a buffer's bytes are reused once the last
   kernel that reads it has run, so the arena holds about one layer's outputs and the
   logits, not every layer's. Every pointer argument into a recorded buffer, plain, in a
   ctypes pointer array or as a NumPy array's memory, is moved to the buffer's place there;
4. the third is replayed, then run eagerly (which rewrites its K/V slots), and the replay is
   kept only if its logits equal the eager ones bit for bit (a computation outside ``launch``,
   or a buffer read after its bytes were reused, would fail this);
5. from then on the step is replayed. If a replayed kernel fails, the step is run eagerly and
   that batch size stays eager.

A replay calls its kernels from C (``Program``, ``cpu_graph_replay.cpp``): one ctypes call for
each run of C kernels, instead of one each (1-2 us a call, ~0.15 ms of a 97 M model's decode
step). A Python callable in the list (the embedding's gather) is called from Python.

Batch sizes above ``max_batch`` (``--max-capture-batch``), up to ``max_steady_batch``
(``--max-num-seqs``), are captured only once a size has run ``STEADY_STEPS`` decode steps in
a row: a server at a steady large batch replays it (4-8% of a B=64 step was the eager path's
Python), while a batch that drains through many sizes (W1 all at once) does not pay a capture
and a check for each size it passes (with every size up to 128 captured at once, W1 all at
once was 5-6% slower).

Only what the recorded kernels read may change between replays: the step's token ids,
positions, slot mapping, block tables and sequence lengths (``CpuGraphs`` copies them into
the buffers the capture read), the KV cache's contents and the weights' contents (a
collective_rpc callable or reload_weights drops every capture: ``forget``). Steps with
prefill rows, multi-stream micro-batches, tensor parallelism or a KV connector run eagerly
(``ModelRunner`` decides), as do batch sizes above ``max_steady_batch``. ``--enforce-eager`` (vLLM's
flag) turns replay off.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import numpy as np

logger = logging.getLogger(__name__)

_ALIGN = 64
# Decode steps in a row at one batch size above max_batch before that size is captured.
STEADY_STEPS = 8
# A capture holds every kernel output of its step on fresh memory until it is laid out (about
# 0.6 MB a row for the 97 M model, 8 MB for a 7 B one). A size above max_batch is not captured
# if the captures so far put it above this.
STEADY_CAPTURE_BYTES = 512 << 20


class _Capture:
    """The kernel calls of one step being recorded, and the buffers their outputs went to
    (fresh memory, kept alive while the step is laid out on the arena)."""

    def __init__(self):
        self.buffers: list = []
        self.ops: list = []
        self.unsupported: Optional[str] = None
        self.paused = 0
        self.nbytes = 0

    def alloc(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = _aligned_bytes(max(nbytes, 1))
        self.buffers.append(raw)
        self.nbytes += len(raw)
        return raw[:nbytes].view(dtype).reshape(shape)


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


def _plain_argtypes(fn: Callable, args: tuple) -> Optional[list]:
    """The argtypes of a ctypes function that declares one for each of ``args`` and has no
    ``errcheck``; None for anything else."""
    argtypes = getattr(fn, "argtypes", None)
    if (not isinstance(fn, ctypes._CFuncPtr) or argtypes is None or len(argtypes) != len(args)
            or fn.errcheck is not None):
        return None
    return argtypes


def direct_call(fn: Callable, args: tuple) -> tuple:
    """``(fn, args)`` ready to be called again and again with the same arguments. A ctypes
    function with ``argtypes`` checks and converts every argument at every call: about 2 us a
    call, 0.15-0.3 ms of a 97 M model's decode step (110 calls, AMD Zen 3). Here the arguments
    are converted once, and the call goes through a copy of the function without ``argtypes``.
    Other callables, and a ctypes function with an ``errcheck`` (which the copy would lose),
    come back as they are."""
    argtypes = _plain_argtypes(fn, args)
    if argtypes is None:
        return fn, args
    raw = type(fn)(ctypes.cast(fn, ctypes.c_void_p).value)
    raw.restype = fn.restype
    raw.__name__ = fn.__name__
    return raw, tuple(t.from_param(a) for t, a in zip(argtypes, args))


_REPLAY_SOURCE = Path(__file__).with_name("cpu_graph_replay.cpp")
# A ctypes type's code in cpu_graph_replay.cpp's signatures.
_TYPE_CODES = {None: "v", ctypes.c_int: "i", ctypes.c_int64: "l", ctypes.c_void_p: "p",
               ctypes.c_float: "f"}


@lru_cache(maxsize=None)
def _replay_library() -> Optional[ctypes.CDLL]:
    from llm_serving.model_executor.cpp_build import KernelBuildError, load_cpp_library
    try:
        lib = load_cpp_library(_REPLAY_SOURCE)
    except KernelBuildError as e:     # (the kernels themselves were built: not expected)
        logger.warning("CPU graph replays call each kernel from Python: %s", e)
        return None
    lib.lls_replay_signature.restype = ctypes.c_int
    lib.lls_replay_signature.argtypes = [ctypes.c_char_p]
    lib.lls_replay.restype = ctypes.c_int64
    lib.lls_replay.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    return lib


@lru_cache(maxsize=None)
def _signature(code: str) -> int:
    lib = _replay_library()
    return lib.lls_replay_signature(code.encode()) if lib is not None else -1


def _slot(argtype, arg) -> Optional[int]:
    """``arg`` as cpu_graph_replay.cpp reads it for a parameter of ctypes type ``argtype``
    (None: a kind of argument it does not take)."""
    if isinstance(arg, ctypes._SimpleCData):
        arg = arg.value
    if argtype is ctypes.c_void_p:
        if arg is None:
            return 0
        if isinstance(arg, ctypes.Array):
            return ctypes.addressof(arg)
        return arg if isinstance(arg, int) else None
    if argtype is ctypes.c_float:
        if not isinstance(arg, (int, float, np.floating)):
            return None
        with np.errstate(over="ignore"):        # (inf, as ctypes would pass it)
            return int(np.float32(arg).view(np.uint32))
    if isinstance(arg, (int, np.integer)) and -(1 << 63) <= arg < (1 << 63):
        return int(arg)
    return None


def _c_call(fn: Callable, args: tuple) -> Optional[tuple]:
    """(function address, signature id, argument slots) to call ``fn(*args)`` from C, or None
    (not a ctypes function of a signature cpu_graph_replay.cpp has)."""
    argtypes = _plain_argtypes(fn, args)
    if (argtypes is None or fn.restype not in _TYPE_CODES
            or any(t not in _TYPE_CODES for t in argtypes)):
        return None
    sig = _signature(_TYPE_CODES[fn.restype] + "".join(_TYPE_CODES[t] for t in argtypes))
    slots = [_slot(t, a) for t, a in zip(argtypes, args)]
    if sig < 0 or None in slots:
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value, sig, slots


class Program:
    """Kernel calls ``[(fn, args)]`` to be made again and again, in order, with the same
    arguments: each run of C kernels in one call to ``lls_replay``, any other callable from
    Python (``direct_call``). ``python_calls``: the names of the latter. Calling it raises
    RuntimeError, naming the kernel, at the first call that returns non-zero."""

    def __init__(self, ops: list):
        self._ops = ops                 # the arguments the slots point into stay alive
        self._arrays: list = []         # and the runs' arrays, which lls_replay reads
        self._steps: list = []          # (fn, args, names, a C run?)
        self.python_calls: list = []
        run: list = []                  # (name, address, signature, slots) of C kernels
        for fn, args in ops:
            name = getattr(fn, "__name__", repr(fn))
            c = _c_call(fn, args)
            if c is not None:
                run.append((name, *c))
                continue
            self._add_run(run)
            run = []
            self.python_calls.append(name)
            self._steps.append((*direct_call(fn, args), [name], False))
        self._add_run(run)

    def _add_run(self, run: list) -> None:
        if not run:
            return
        names, addrs, sigs, slots = zip(*run)
        offsets = np.cumsum([0] + [len(s) for s in slots[:-1]])
        arrays = (np.array(addrs, np.uint64), np.array(sigs, np.int32),
                  offsets.astype(np.int64), np.array([v for s in slots for v in s], np.int64))
        fn, args = direct_call(_replay_library().lls_replay,
                               tuple(a.ctypes.data for a in arrays) + (len(run),))
        self._arrays.append(arrays)
        self._steps.append((fn, args, list(names), True))

    def __call__(self) -> None:
        for fn, args, names, c_run in self._steps:
            rc = fn(*args)
            if rc:
                raise RuntimeError(f"a replayed kernel ({names[rc - 1] if c_run else names[0]}) "
                                   "failed")


def empty(shape, dtype=np.float32) -> np.ndarray:
    """A kernel's output buffer (fresh memory; during a capture, a buffer the capture lays
    out on the arena)."""
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
def _capturing():
    if _state.capture is not None:
        raise RuntimeError("a capture is already running")
    _state.capture = cap = _Capture()
    try:
        yield cap
    finally:
        _state.capture = None


class _Unmovable(Exception):
    """A recorded argument the layout cannot move (its reason is why the step runs eagerly)."""


# Argument templates: ("p", buffer, offset) a pointer; ("a", ctypes array type, [templates])
# an array of c_void_p; ("n", buffer, offset, shape, dtype, strides) a NumPy array's memory;
# anything else a literal, passed as recorded.


class _Layout:
    """A captured step's kernel calls, with every pointer into a recorded buffer written as
    (buffer, offset), and each buffer's place on the arena: buffers whose uses (the first to
    the last recorded call that points into them) overlap get disjoint bytes, the others may
    share. The logits stay live to the end."""

    def __init__(self, cap: _Capture, logits: np.ndarray):
        bufs = sorted(cap.buffers, key=lambda b: b.ctypes.data)
        self._starts = [b.ctypes.data for b in bufs]
        self._ends = [b.ctypes.data + len(b) for b in bufs]
        self.sizes = [-(-len(b) // _ALIGN) * _ALIGN for b in bufs]
        first: dict = {}
        last: dict = {}
        self.ops = []
        for i, (fn, args) in enumerate(cap.ops):
            used: set = set()
            self.ops.append((fn, tuple(self._template(a, used) for a in args)))
            for b in used:
                first.setdefault(b, i)
                last[b] = i
        out = self._template(logits, set())
        if not (isinstance(out, tuple) and out[0] == "n"):
            raise _Unmovable("its logits are not a recorded kernel's output")
        self.logits = out
        first.setdefault(out[1], len(cap.ops))
        last[out[1]] = len(cap.ops)
        self.offsets = self._place(first, last)
        self.nbytes = max((self.offsets[b] + self.sizes[b] for b in self.offsets), default=0)

    def _locate(self, addr: int):
        i = bisect.bisect_right(self._starts, addr) - 1
        return i if i >= 0 and addr <= self._ends[i] else None

    def _template(self, arg, used: set):
        if arg is None or isinstance(arg, (float, str, bytes)):
            return arg
        if isinstance(arg, (int, np.ndarray)):      # (bool is an int: never an address)
            addr = arg.ctypes.data if isinstance(arg, np.ndarray) else arg
            b = self._locate(addr)
            if b is None:
                return arg
            used.add(b)
            if isinstance(arg, np.ndarray):
                return ("n", b, addr - self._starts[b], arg.shape, arg.dtype, arg.strides)
            return ("p", b, addr - self._starts[b])
        if isinstance(arg, ctypes.Array):
            if arg._type_ is ctypes.c_void_p:
                items = [self._template(v, used) for v in arg]
                if any(isinstance(t, tuple) for t in items):
                    return ("a", type(arg), items)
                return arg
            if issubclass(arg._type_, ctypes._SimpleCData) and arg._type_._type_ not in "zZPO":
                return arg          # numbers (a split, leading dimensions)
        elif isinstance(arg, ctypes._SimpleCData) and arg._type_ not in "zZO":
            if arg._type_ == "P" and arg.value is not None and self._locate(arg.value) is not None:
                raise _Unmovable("a c_void_p argument into a recorded buffer (pass an int)")
            return arg
        elif isinstance(arg, np.generic) or callable(arg):
            return arg
        raise _Unmovable(f"a kernel argument of type {type(arg).__name__}")

    def _place(self, first: dict, last: dict) -> dict:
        """First fit, largest buffer first, among the placed buffers live at the same time."""
        placed: list = []           # (offset, end, first use, last use)
        offsets = {}
        for b in sorted(first, key=lambda b: (-self.sizes[b], first[b])):
            lo, hi, size = first[b], last[b], self.sizes[b]
            off = 0
            for o, e in sorted((o, e) for o, e, f, l in placed if f <= hi and lo <= l):
                if off + size <= o:
                    break
                off = max(off, e)
            offsets[b] = off
            placed.append((off, off + size, lo, hi))
        return offsets

    def bind(self, arena: np.ndarray):
        """The calls and the logits array, on this arena."""
        base = arena.ctypes.data

        def arg(t):
            if not isinstance(t, tuple):
                return t
            if t[0] == "p":
                return base + self.offsets[t[1]] + t[2]
            if t[0] == "a":
                return t[1](*[arg(v) for v in t[2]])
            _, b, off, shape, dtype, strides = t
            return np.ndarray(shape, dtype, buffer=arena, offset=self.offsets[b] + off,
                              strides=strides)

        return [(fn, tuple(arg(a) for a in args)) for fn, args in self.ops], arg(self.logits)


@dataclass
class _Graph:
    layout: _Layout
    ops: list = field(default_factory=list)
    logits: Optional[np.ndarray] = None     # the arena's logits buffer [b, vocab]
    verified: bool = False

    program: Optional[Program] = None

    def bind(self, arena: np.ndarray) -> None:
        self.ops, self.logits = self.layout.bind(arena)
        self.program = Program(self.ops)

    def replay(self) -> None:
        self.program()


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

    def __init__(self, forward: Callable, max_batch: int, max_blocks_per_seq: int,
                 max_steady_batch: int = 0):
        self.forward = forward
        self.max_batch = max_batch
        self.max_steady_batch = max(max_batch, max_steady_batch)
        self._run_b, self._run_len = 0, 0       # the last steps' batch size, steps in a row
        self._row_bytes = 0.0                   # the most capture memory per row seen
        n = self.max_steady_batch
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

    def forget(self) -> None:
        """Drop every capture (the weights were replaced or changed in place: a capture
        replays the addresses it recorded); each batch size is captured again as at start.
        The arena stays, for the new captures."""
        self.graphs.clear()
        self.stats.captured.clear()
        self.stats.failed.clear()
        self._run_b, self._run_len = 0, 0

    def replayable(self, step) -> bool:
        """A decode-only step (one row per sequence) of at most ``max_steady_batch`` sequences
        whose block tables fit."""
        b = len(step.input_ids)
        return (0 < b <= self.max_steady_batch and len(step.seq_lens) == b
                and step.block_tables.shape[1] <= self.block_tables.shape[1])

    def logits(self, step, rows: np.ndarray) -> Optional[np.ndarray]:
        """The logits of ``rows`` for a step ``replayable`` accepted, or None: run it eagerly."""
        b = len(step.input_ids)
        self._run_b, self._run_len = b, (self._run_len + 1 if b == self._run_b else 1)
        graph = self.graphs.get(b)
        if graph is None:
            if b <= self.max_batch or (self._run_len >= STEADY_STEPS and
                                       self._row_bytes * b <= STEADY_CAPTURE_BYTES):
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
            if not self._replay(b, graph):
                return self._eager(b)[rows]
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
        if not self._replay(b, graph):
            return self._eager(b)[rows]     # (rewrites the K/V slots the replay touched)
        self.stats.replayed_steps += 1
        return graph.logits[rows]       # a copy: the next replay overwrites the arena

    def _replay(self, b: int, graph: _Graph) -> bool:
        """Replay ``graph``; if a kernel fails, this size runs eagerly from then on (the
        step too: its eager run gives the error, if the failure was not the replay's)."""
        try:
            graph.replay()
            return True
        except Exception as e:          # noqa: BLE001 (any failure: the eager path decides)
            self._fail(b, f"its replay failed ({e})", logging.ERROR)
            return False

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

    def _capture(self, b: int) -> np.ndarray:
        with _capturing() as cap:
            logits = self._eager(b)
        self._row_bytes = max(self._row_bytes, cap.nbytes / b)
        if cap.unsupported is not None:
            self._fail(b, cap.unsupported)
            return logits
        try:
            graph = _Graph(_Layout(cap, logits))
        except _Unmovable as e:
            self._fail(b, str(e))
            return logits
        except Exception as e:          # noqa: BLE001 (a layout bug: the step itself is right)
            self._fail(b, f"laying out its capture failed ({e!r})", logging.ERROR, exc_info=True)
            return logits
        if graph.layout.nbytes > len(self.arena):
            # Grow it; the graphs on the old one move (their layouts do not change).
            self.arena = _aligned_bytes(graph.layout.nbytes)
            logger.debug("CPU graph arena: %d KB", len(self.arena) >> 10)
            for g in self.graphs.values():
                if isinstance(g, _Graph):
                    g.bind(self.arena)
        graph.bind(self.arena)
        self.graphs[b] = graph
        return logits

    def _fail(self, b: int, why: str, level: int = logging.WARNING,
              exc_info: bool = False) -> None:
        """Batch size ``b`` runs eagerly from now on. Logged at ``level``: a warning only for
        the first size (sizes tend to fail alike), an error (a replay or a layout failed,
        ``exc_info`` with its traceback) always."""
        if level > logging.WARNING or not self.stats.failed:
            logger.log(level, "decode steps of %d sequences run eagerly: %s", b, why,
                       exc_info=exc_info)
        if b in self.stats.captured:
            self.stats.captured.remove(b)
        self.graphs[b] = _FAILED
        self.stats.failed[b] = why


def _aligned_bytes(n: int) -> np.ndarray:
    raw = np.empty(n + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off:off + n]
