"""Custom logits processors: the interface a user's class implements (vLLM V1's).

A vLLM script's processor imports these names from ``vllm.v1.sample.logits_processor``; here
they are ``llm_serving.sample.logits_processor``'s (the same names, the same meaning, and
vLLM's helper ``process_dict_updates``)::

    try:
        from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    except ImportError:
        from llm_serving.sample.logits_processor import BatchUpdate, LogitsProcessor

A class written against vLLM's own module runs here too when vLLM is installed (its
``MoveDirectionality`` is then the one its moves carry). The engine loads the classes named
by ``logits_processors`` (``--logits-processors pkg.module:Class``, ``LLM(logits_processors=
[...])``, and vLLM's ``vllm.logits_processors`` entry points), checks them at start, and runs
them in the WorkAgent on the step's logits as a torch tensor (docs/openai.md, "Custom logits
processors"). torch is imported only when a processor is configured.

The batch a processor sees is the step's sampled rows, in row order: ``update_state`` gets,
once a step and before ``apply``, a ``BatchUpdate`` of the rows removed, added and moved since
the last step (None when nothing changed), to be processed in that order; ``apply`` gets the
[rows, vocab] float32 logits.
"""
from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()     # row a's request moves to row b (b's is dropped)
    SWAP = enum.auto()               # rows a and b exchange their requests


# A removed row; an added row (row, its SamplingParams, prompt token ids, its live output
# token list: the same list object grows as the request generates); a move (a, b, direction).
RemovedRequest = int
AddedRequest = tuple
MovedRequest = tuple


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous step: apply ``removed``, then ``added`` (an
    added row may take the place of a removed one), then ``moved``."""
    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


def process_dict_updates(state: dict, batch_update: Optional[BatchUpdate],
                         new_state: Callable) -> bool:
    """Keep ``state`` (row -> a request's state) in step with ``batch_update``:
    ``new_state(params, prompt_ids, output_ids)`` gives an added row's (None: the row has
    none). vLLM's helper of the same name (``vllm.v1.sample.logits_processor``). Returns
    whether ``state`` changed."""
    if batch_update is None:
        return False
    changed = False
    for row in batch_update.removed:
        changed |= state.pop(row, None) is not None
    for row, params, prompt_ids, output_ids in batch_update.added:
        value = new_state(params, prompt_ids, output_ids)
        if value is None:
            changed |= state.pop(row, None) is not None
        else:
            state[row] = value
            changed = True
    for a, b, direction in batch_update.moved:
        va, vb = state.pop(a, None), state.pop(b, None)
        if va is not None:
            state[b] = va
        if vb is not None and direction.name == "SWAP":
            state[a] = vb
        changed |= va is not None or vb is not None
    return changed


class LogitsProcessor(ABC):
    """A batch-level logits processor: vLLM V1's interface (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raise ValueError for a request whose parameters (its ``extra_args``) this processor
        cannot take: the request is refused (a 400 naming the error on the server)."""

    @abstractmethod
    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits):
        """Return the step's logits (torch [rows, vocab] float32), changed in place or anew."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if it never changes a row's argmax: it then runs after temperature and only
        when some row samples at random (greedy rows never see it)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        """Called once a step before ``apply``; None when the batch did not change."""
        raise NotImplementedError


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs a per-request callable on its request's row: subclass it with
    ``is_argmax_invariant`` and ``new_req_logits_processor(params)``, which returns None (the
    request is left alone) or ``f(output_ids, row)`` / ``f(prompt_ids, output_ids, row)``
    returning the row's new logits."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.req_info: dict[int, Callable] = {}

    @abstractmethod
    def new_req_logits_processor(self, params) -> Optional[Callable]:
        raise NotImplementedError

    def _bound(self, params, prompt_ids, output_ids) -> Optional[Callable]:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        process_dict_updates(self.req_info, batch_update, self._bound)

    def apply(self, logits: Any):
        for row, fn in self.req_info.items():
            old = logits[row]
            new = fn(old)
            if new is not old:
                logits[row] = new
        return logits
