"""``logits_processors``: the user's logits processor classes, loaded, checked and run.

vLLM's ways of naming them are taken: ``'pkg.module:Class'`` (``--logits-processors``, the
YAML, ``LLM(logits_processors=[...])``), a class object (``LLM(...)``), and the classes that
installed packages register under vLLM's entry point group ``vllm.logits_processors``. The
master loads each at start (``resolve``: a class that cannot be imported, or that does not
implement ``LogitsProcessor``, stops the start naming ``logits_processors``) and checks each
request with the classes' ``validate_params``; the WorkAgent that samples builds them and
runs them on each step's logits (``CustomLogitsProcessors``).

Where they run, as vLLM V1's sampler runs them: the processors that may change a row's
argmax on the model's logits before the penalties, bans, logit bias and token masks; the
argmax-invariant ones after temperature, only when some row samples at random. Logprobs stay
the model's raw ones. torch is imported only here, when a processor is configured.
"""
from __future__ import annotations

import importlib
import inspect
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from llm_serving.errors import ConfigError, LogitsProcessorError
from llm_serving.sample.batch_update import PersistentBatch
from llm_serving.sample.logits_processor import BatchUpdate, LogitsProcessor

KEY = "logits_processors"
ENTRY_POINT_GROUP = "vllm.logits_processors"        # vLLM's plugins' group
_VLLM_INTERFACE = "vllm.v1.sample.logits_processor"
# What one request's parameters may take in a step's channel (they travel pickled once, when
# the request joins the batch); the input processor refuses larger ones.
MAX_PARAMS_BYTES = 64 << 10


def _is_processor(cls) -> bool:
    """A subclass of this package's LogitsProcessor or of vLLM's (when vLLM is installed)."""
    return any(c is LogitsProcessor or (c.__name__ == "LogitsProcessor"
                                        and c.__module__.startswith(_VLLM_INTERFACE))
               for c in inspect.getmro(cls)[1:])


def _from_vllm(cls) -> bool:
    return any(c.__module__.startswith(_VLLM_INTERFACE) for c in inspect.getmro(cls))


def load_class(spec) -> type:
    """The class ``spec`` names ('pkg.module:Class', dotted qualnames too), or ``spec`` itself
    when it is a class; checked to be a LogitsProcessor that can be built."""
    if isinstance(spec, type):
        cls = spec
    elif isinstance(spec, str) and spec.count(":") == 1 and all(spec.split(":")):
        module, qualname = spec.split(":")
        try:
            obj: Any = importlib.import_module(module)
        except Exception as e:      # noqa: BLE001 - whatever the import raised, named
            raise ConfigError(KEY, f"{spec!r}: cannot import {module}: "
                              f"{type(e).__name__}: {e}") from None
        for attr in qualname.split("."):
            if not hasattr(obj, attr):
                raise ConfigError(KEY, f"{spec!r}: {module} has no {qualname}")
            obj = getattr(obj, attr)
        if not isinstance(obj, type):
            raise ConfigError(KEY, f"{spec!r} is not a class")
        cls = obj
    else:
        raise ConfigError(KEY, f"expected 'module:Class' or a class, got {spec!r}")
    if not _is_processor(cls):
        raise ConfigError(KEY, f"{cls.__qualname__} is not a subclass of LogitsProcessor "
                          "(llm_serving.sample.logits_processor's, or vLLM's "
                          "vllm.v1.sample.logits_processor's)")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(KEY, f"{cls.__qualname__} does not implement {missing}")
    return cls


def _entry_points() -> list[str]:
    from importlib.metadata import entry_points
    return [ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)]


def resolve(values, in_process: bool) -> tuple:
    """The configured processors and the installed plugins' as the engine keeps them: each
    'module:Class' (a class object given to LLM(...) is kept as is when the model runs in
    this process, else named by its module, which the WorkAgent imports), every one loaded
    and checked here. ConfigError naming logits_processors."""
    if values is None:
        values = []
    elif isinstance(values, (str, type)) or not isinstance(values, (list, tuple)):
        values = [values]
    out = []
    for spec in [*_entry_points(), *values]:
        cls = load_class(spec)
        if isinstance(spec, str) or in_process:
            out.append(spec)
            continue
        name = f"{cls.__module__}:{cls.__qualname__}"
        try:
            found = load_class(name)
        except ConfigError:
            found = None
        if found is not cls:
            raise ConfigError(KEY, f"{cls.__qualname__} is defined in {cls.__module__}, which "
                              "the WorkAgent process cannot import: put it in a module and "
                              "give 'module:Class'")
        out.append(name)
    return tuple(out)


def validate_params(classes, params) -> None:
    """Each processor's validate_params on a request (ValueError: the request is refused)."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except ValueError as e:
            raise ValueError(f"extra_args: {e}") from None


# ---- what a processor's __init__ gets -----------------------------------------------------

class _Section:
    """A part of vLLM's VllmConfig with the attributes processors read; any other is refused
    by name rather than answered wrongly."""

    def __init__(self, name: str, **values):
        self._name = name
        self.__dict__.update(values)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"vllm_config.{self._name}.{attr} is not provided to custom "
                             "logits processors here (docs/openai.md, 'Custom logits "
                             "processors', lists what is)")


def vllm_config_view(config) -> _Section:
    """vllm_config as processors read it: scheduler_config (max_num_seqs,
    max_num_batched_tokens, max_model_len), model_config (get_vocab_size(), vocab_size,
    max_model_len, max_logprobs, dtype, seed, model, tokenizer and vLLM's tokenizer
    settings), cache_config.block_size, parallel_config's sizes, speculative_config (None:
    processors run without it) and additional_config ({})."""
    m, s = config.model, config.scheduler
    import torch
    model = _Section("model_config", model=m.path, tokenizer=m.tokenizer,
                     tokenizer_mode="auto", trust_remote_code=False, revision=None,
                     tokenizer_revision=None, vocab_size=m.vocab_size,
                     max_model_len=m.max_model_len, max_logprobs=m.max_logprobs,
                     dtype=getattr(torch, m.weight_dtype), seed=m.seed,
                     get_vocab_size=lambda: m.vocab_size)
    return _Section(
        "", model_config=model, speculative_config=None, additional_config={},
        scheduler_config=_Section("scheduler_config", max_num_seqs=s.max_num_seqs,
                                  max_num_batched_tokens=s.max_num_batched_tokens,
                                  max_model_len=m.max_model_len),
        cache_config=_Section("cache_config", block_size=config.cache.block_size),
        parallel_config=_Section(
            "parallel_config", tensor_parallel_size=config.parallel.tensor_parallel_size,
            pipeline_parallel_size=1, data_parallel_size=1))


# ---- the WorkAgent side ------------------------------------------------------------------

@dataclass
class _Built:
    name: str
    processor: Any
    vllm_types: bool        # written against vLLM's module: its BatchUpdate and moves


class CustomLogitsProcessors:
    """The processors of a sampling model runner, and the batch they see."""

    def __init__(self, config):
        import torch
        self.torch = torch
        view = vllm_config_view(config)
        device = torch.device("cpu")
        self.changing: list[_Built] = []        # may change a row's argmax
        self.invariant: list[_Built] = []
        for spec in config.model.logits_processors:
            cls = load_class(spec)
            proc = cls(view, device, False)
            built = _Built(cls.__qualname__, proc, _from_vllm(cls))
            (self.invariant if proc.is_argmax_invariant() else self.changing).append(built)
        self.batch = PersistentBatch()
        self._vllm_update = _vllm_converter() if any(
            b.vllm_types for b in self.changing + self.invariant) else None

    @property
    def has_invariant(self) -> bool:
        return bool(self.invariant)

    def update(self, row_keys: np.ndarray, added: Optional[np.ndarray]) -> None:
        """This step's rows (request keys) and the requests new since the last step (pickled
        by the master): every processor's update_state."""
        new = pickle.loads(added.tobytes()) if added is not None and len(added) else {}
        update = self.batch.update(row_keys.tolist(), new)
        theirs = self._vllm_update(update) if self._vllm_update and update else update
        for b in self.changing + self.invariant:
            self._call(b, "update_state", theirs if b.vllm_types else update)

    def apply(self, logits: np.ndarray, invariant: bool) -> np.ndarray:
        """The processors of one kind on [B, V] float32 logits (changed in place when the
        processors change theirs in place)."""
        t = self.torch.from_numpy(logits)
        for b in (self.invariant if invariant else self.changing):
            t = self._call(b, "apply", t)
        out = t.detach().numpy() if isinstance(t, self.torch.Tensor) else np.asarray(t)
        if out.dtype != np.float32 or out.shape != logits.shape:
            raise LogitsProcessorError(f"a custom logits processor returned logits of shape "
                                       f"{tuple(out.shape)} {out.dtype}; expected "
                                       f"{tuple(logits.shape)} float32")
        return out

    def record(self, token_ids: np.ndarray) -> None:
        self.batch.append(token_ids)

    def _call(self, built: _Built, method: str, arg):
        try:
            return getattr(built.processor, method)(arg)
        except Exception as e:          # noqa: BLE001 - the step fails, naming the class
            raise LogitsProcessorError(f"custom logits processor {built.name}.{method} "
                                       f"failed: {type(e).__name__}: {e}") from e


def _vllm_converter():
    """A BatchUpdate in vLLM's own types, for processors written against vLLM's module."""
    from vllm.v1.sample.logits_processor import BatchUpdate as VllmUpdate
    from vllm.v1.sample.logits_processor import MoveDirectionality as VllmMove

    def convert(u: BatchUpdate):
        return VllmUpdate(batch_size=u.batch_size, removed=u.removed, added=u.added,
                          moved=[(a, b, VllmMove[d.name]) for a, b, d in u.moved])
    return convert
