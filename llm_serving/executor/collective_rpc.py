"""vLLM's ``collective_rpc``: a method or a function run on every model process, between steps.

``LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)`` (and ``AsyncLLMEngine``'s,
and ``POST /collective_rpc`` under ``VLLM_SERVER_DEV_MODE=1``) runs ``method`` once on each
WorkAgent (one per tensor-parallel rank) and returns their results in rank order; with the
in-process runner (``distributed_executor_backend="uni"``) it runs here, once. ``method`` is
either the name of a ``Worker`` method or a callable taking the ``Worker`` first, as vLLM's
take vLLM's worker: ``fn(worker, *args, **kwargs)``. ``LLM.apply_model(fn)`` is
``collective_rpc("apply_model", args=(fn,))``: ``fn(model)``, the model Cell the runner runs.

To a WorkAgent the call travels on its control connection between two steps (never during
one), pickled with cloudpickle as vLLM pickles callables (a lambda, a closure, a function of
``__main__`` are sent by value, a function of a module by reference: the agent imports it,
the caller's ``sys.path`` added to its own); its result comes back pickled. Both are bounded:
``MAX_RPC_BYTES`` each, a ValueError naming what was too big. A call that raises is a
``CollectiveRPCError`` in the caller with the worker's ``Type: message`` (its traceback is in
the agent's log), and the agent goes on serving. ``timeout`` (seconds; None: no limit) is a
``TimeoutError`` once passed, as vLLM's; the agent still finishes the call, and the next step
waits for it (a call longer than the step timeout then has the agent restarted as hung). In
process the call runs on the caller's thread, without pickling, size bounds or timeout (as
vLLM's in-process executor, which runs it inline).

Weights: the CPU kernels read each Linear's weight packed in panels (``layers/gemm.py``), the
LM head from a packed copy of the embedding, and a replayed CPU graph (``cpu_graph.py``) from
the addresses its capture recorded. A callable that writes a Parameter in place, or replaces
it, would go unseen (or leave a graph reading freed memory), so after every callable the
runner drops its CPU graphs and the LM head's copy (``ModelRunner.weights_changed``; the next
steps capture again). A Linear's Parameter holds the packed layout: write a Linear's weight
with ``layer.set_weight(w, in_place=True)`` (w: float32 [out, in], this rank's shard), or
reload weights with ``Worker.reload_weights``, vLLM's method (RLHF loops call it), which
loads HF checkpoint tensors through the loader as at start, over the weights held.
"""
from __future__ import annotations

import inspect
import io
import logging
import pickle
import sys
import traceback
from typing import Any, Callable, Iterable, Optional, Union

from llm_serving.errors import LLMServingError

logger = logging.getLogger(__name__)

# The most bytes a call (method, args and kwargs, pickled) or one rank's result may take on
# the control connection: control messages, not a data plane (vLLM's advice too); weights go
# through reload_weights(weights_path=...).
MAX_RPC_BYTES = 64 << 20

Method = Union[str, Callable[..., Any]]


class CollectiveRPCError(LLMServingError, RuntimeError):
    """A collective_rpc call raised on a worker; the message names the rank and carries the
    worker's ``Type: message``. A RuntimeError, as vLLM's."""


class ArgumentsError(TypeError):
    """A Worker method named with arguments it does not take (found before the call is sent)."""


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


def encode_call(method: Method, args: tuple, kwargs: Optional[dict]) -> bytes:
    """The call as sent to the WorkAgents (``check_call`` passed it; a ValueError when it
    does not pickle or is too big)."""
    try:
        import cloudpickle
    except ImportError:
        raise ImportError("collective_rpc needs the cloudpickle package, as vLLM's: "
                          "pip install cloudpickle") from None
    try:
        # this process's import path first: a function of an importable module is pickled by
        # reference, and the agent imports its module as this process would (as vLLM's
        # spawned workers, which start with their parent's sys.path)
        data = pickle.dumps(list(sys.path)) + cloudpickle.dumps(
            (method, tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:      # noqa: BLE001 - whatever the pickler raised, named
        raise ValueError(f"collective_rpc: {method_name(method)}'s call cannot be pickled "
                         f"for the WorkAgents: {type(e).__name__}: {e}") from None
    if len(data) > MAX_RPC_BYTES:
        raise ValueError(f"collective_rpc: the call (method, args and kwargs) is {len(data)} "
                         f"bytes pickled, over the limit of {MAX_RPC_BYTES} (collective_rpc "
                         "carries control messages; load weights with "
                         "reload_weights(weights_path=...))")
    return data


def check_call(method: Method, timeout, args, kwargs) -> None:
    """A TypeError or ValueError for arguments of the wrong kind, vLLM's NotImplementedError
    for a name that is not a Worker method."""
    if isinstance(method, str):
        if method not in Worker.METHODS:
            raise NotImplementedError(f"Method {method!r} is not implemented (the Worker's "
                                      f"methods: {', '.join(Worker.METHODS)})")
    elif not callable(method):
        raise TypeError(f"collective_rpc: method must be a worker method's name or a "
                        f"callable, got {type(method).__name__}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"collective_rpc: timeout must be a number of seconds > 0 or None, "
                         f"got {timeout!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"collective_rpc: args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"collective_rpc: kwargs must be a dict, got {type(kwargs).__name__}")
    if isinstance(method, str):       # arguments the method cannot take: refused before sending
        try:
            inspect.signature(getattr(Worker, method)).bind(None, *args, **(kwargs or {}))
        except TypeError as e:
            raise ArgumentsError(f"collective_rpc({method}): {e}") from None


def run_call(worker: "Worker", method: Method, args: tuple, kwargs: Optional[dict]) -> Any:
    """``method`` (``check_call`` passed it) run on ``worker``: a Worker method by name, or
    ``method(worker, ...)``."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    try:
        return method(worker, *args, **(kwargs or {}))
    finally:
        worker.model_runner.weights_changed()


def answer(worker: "Worker", payload: bytes) -> tuple[bool, bytes]:
    """A WorkAgent's answer to a pickled call: (True, the pickled result) or (False, the
    error's ``Type: message``). Never raises."""
    try:
        stream = io.BytesIO(payload)
        sys.path.extend(p for p in pickle.load(stream) if p not in sys.path)
        method, args, kwargs = pickle.load(stream)
        result = run_call(worker, method, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the caller gets it; the agent goes on
        logger.error("collective_rpc failed on this WorkAgent:\n%s", traceback.format_exc())
        return False, f"{type(e).__name__}: {e}".encode()
    try:
        import cloudpickle
        data = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001
        return False, (f"ValueError: the result ({type(result).__name__}) cannot be "
                       f"pickled: {type(e).__name__}: {e}").encode()
    if len(data) > MAX_RPC_BYTES:
        return False, (f"ValueError: the result is {len(data)} bytes pickled, over the "
                       f"limit of {MAX_RPC_BYTES}").encode()
    return True, data


class Worker:
    """What a collective_rpc callable gets as its first argument (vLLM's gets vLLM's worker),
    and whose methods a method name calls. Attributes a callable may rely on:

    - ``rank``, ``local_rank``: this process's tensor-parallel rank (0 in process);
    - ``tp_size``: the tensor-parallel size; ``is_driver_worker``: rank 0 (it samples);
    - ``device``: "CPU" or "Ascend";
    - ``model_runner``: the ModelRunner (``model_runner.model`` the model Cell,
      ``model_runner.kv_caches`` the KV cache, one per layer);
    - ``config``: the resolved EngineConfig (``config.model.path``, ``config.model.hf``, ...).
    """

    METHODS = ("apply_model", "get_model", "check_health", "reload_weights")

    def __init__(self, model_runner, rank: int, tp_size: int):
        self.model_runner = model_runner
        self.config = model_runner.engine_config
        self.rank = self.local_rank = rank
        self.tp_size = tp_size
        self.is_driver_worker = rank == 0
        self.device = model_runner.device

    def get_model(self):
        """The model Cell (``LlamaForCausalLM``, ...), its Parameters those the kernels read."""
        return self.model_runner.model

    def apply_model(self, fn: Callable[[Any], Any]) -> Any:
        """vLLM's: ``fn(model)``; the runner then drops what it derived from the weights."""
        try:
            return fn(self.model_runner.model)
        finally:
            self.model_runner.weights_changed()

    def check_health(self) -> None:
        """vLLM's: nothing to check beyond answering."""

    def reload_weights(self, weights_iterator: Optional[Iterable] = None,
                       weights_path: Optional[str] = None,
                       is_checkpoint_format: bool = True) -> None:
        """vLLM's: load new weights into the running model, from ``weights_iterator``
        ((HF checkpoint name, array) pairs, NumPy arrays or CPU torch tensors: the parameters
        they name, the others unchanged; a fused parameter whole, e.g. q_proj, k_proj and
        v_proj of a layer together), or else all of them from the checkpoint at
        ``weights_path`` (an HF model directory), or else from the model's own. Each rank
        takes its shard. Nothing is stored unless every tensor fits (a KeyError or ValueError
        names the first that does not). Cached prefixes were computed with the old weights:
        reset the prefix cache after (vLLM's RLHF examples do)."""
        if not is_checkpoint_format:
            raise ValueError("reload_weights: is_checkpoint_format=False is not supported "
                             "here (weights are taken by their HF checkpoint names)")
        self.model_runner.reload_weights(weights_iterator, weights_path)
