"""LoRA in the model runner: the adapters a WorkAgent holds, and each step's rows per adapter.

``LoRAModels`` names the model's linear layers (``Linear.lora_name``), loads an adapter's
weights from its directory the first time a step needs it, and keeps up to
``max_cpu_loras`` of them, the least recently used dropped first. An adapter that cannot be
read then (its directory removed or changed since the master checked it) fails only its own
requests: its rows run without it, and ``take_failures`` tells the master, which ends them.
Per step, ``for_step`` groups the token rows by adapter (from ``StepInput.lora_ids``, an id
per sequence); the model runner puts the result, a ``StepLoRA``, in the forward context, and
every ``Linear`` adds its adapters' products to their rows (``StepLoRA.apply``):

    y[rows] += (x[rows] @ A.T) @ (scale * B).T

one pair of GEMMs per layer and adapter in the step, over all its rows at once. Rows without
an adapter are not touched: they are bit for bit what the model computes without LoRA. A
fused layer (q/k/v, gate/up) holds its parts' A matrices stacked, so that x is read once.
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Optional

import numpy as np
from mindspore import Tensor

from llm_serving.config import LoRAConfig
from llm_serving.model_executor.kv_scales import fold_lora
from llm_serving.lora.peft import LORA_ARCHITECTURES, check_adapter, load_adapter

logger = logging.getLogger(__name__)


def _linear_part(module: str, stacked: list) -> tuple[str, int]:
    """Our layer and fused part for a PEFT module name (``...self_attn.k_proj`` ->
    ``...self_attn.qkv_proj``, part 1), by the model's ``stacked_params``."""
    name = module + "."
    for src, dst, part in stacked:
        if src in name:
            return name.replace(src, dst)[:-1], part
    return module, 0


class AdapterWeights:
    """One adapter's weights per linear layer it targets: (A stacked over the layer's
    targeted parts [R, in], [(part, first row of A, end row, scale * B [out_part, r])])."""

    def __init__(self, modules: dict, layers: dict, stacked: list):
        grouped: dict[str, list] = {}
        for module, (a, b) in modules.items():
            layer, part = _linear_part(module, stacked)
            if layer not in layers:
                raise ValueError(f"LoRA module {module!r}: the model has no layer {layer!r}")
            grouped.setdefault(layer, []).append((part, a, b))
        self.layers = {}
        for layer, parts in grouped.items():
            parts.sort(key=lambda p: p[0])
            ends = np.cumsum([len(a) for _, a, _ in parts]).tolist()
            self.layers[layer] = (
                np.ascontiguousarray(np.concatenate([a for _, a, _ in parts])),
                [(part, end - len(a), end, b) for (part, a, b), end in zip(parts, ends)])


class StepLoRA:
    """A step's token rows per adapter: [(AdapterWeights, rows)], rows a slice when they
    are contiguous (a view, no copy), else an index array."""

    def __init__(self, groups: list):
        self.groups = groups

    def apply(self, layer, x, y):
        """``y`` (the layer's output: a tensor, or its parts' tensors) with the step's
        adapters' products added to their rows."""
        xs = outs = arrays = None
        for weights, rows in self.groups:
            w = weights.layers.get(layer.lora_name)
            if w is None:
                continue
            if xs is None:
                xs = x.asnumpy()
                outs = list(y) if isinstance(y, tuple) else [y]
                arrays = [t.asnumpy() for t in outs]
            a, parts = w
            t = xs[rows] @ a.T
            for part, lo, hi, b in parts:
                d = t[:, lo:hi] @ b.T
                if len(arrays) > 1:
                    arrays[part][rows] += d
                else:
                    off = layer.offsets
                    arrays[0][rows, off[part]:off[part + 1]] += d
        if xs is None:
            return y
        # Our kernels' outputs share their memory with the arrays; MindSpore's may not.
        outs = [t if arr.ctypes.data == t.data_ptr() else Tensor(arr)
                for t, arr in zip(outs, arrays)]
        return tuple(outs) if isinstance(y, tuple) else outs[0]


class LoRAModels:
    def __init__(self, model, config: LoRAConfig, hf):
        from llm_serving.model_executor.layers.linear import Linear
        if hf.architecture not in LORA_ARCHITECTURES:
            raise ValueError(f"LoRA is not supported for {hf.architecture}")
        self.config, self.hf, self.model = config, hf, model
        self.stacked = getattr(model, "stacked_params", [])
        self.layers = {}
        for name, cell in model.cells_and_names():
            if isinstance(cell, Linear):
                cell.lora_name = name
                self.layers[name] = cell
        self._loaded: OrderedDict = OrderedDict()    # (id, path) -> AdapterWeights, LRU first
        self.failed: dict[int, str] = {}      # adapters that could not be read, not yet told

    def adapter(self, lora_id: int, path: str, keep: set) -> AdapterWeights:
        """The adapter's weights, loaded now if not held (dropping the least recently used
        one not in ``keep`` beyond max_cpu_loras)."""
        key = (lora_id, path)
        weights = self._loaded.get(key)
        if weights is not None:
            self._loaded.move_to_end(key)
            return weights
        spec = check_adapter(path, self.hf, self.config.max_lora_rank)
        weights = AdapterWeights(load_adapter(spec), self.layers, self.stacked)
        weights.layers = fold_lora(self.model, weights.layers)    # the checkpoint's KV scales
        while len(self._loaded) >= self.config.max_cpu_loras:
            old = next((k for k in self._loaded if k not in keep), None)
            if old is None:
                break
            del self._loaded[old]
        self._loaded[key] = weights
        return weights

    @property
    def loaded(self) -> list:
        """The (id, path) of the adapters held, least recently used first."""
        return list(self._loaded)

    def read(self, lora_paths: np.ndarray) -> None:
        """Load the adapters of ``lora_paths`` ({id: path} JSON) now: newly registered ones."""
        for i, path in json.loads(lora_paths.tobytes().decode()).items():
            self._adapter_or_failure(int(i), path, set())

    def _adapter_or_failure(self, lora_id: int, path: str, keep: set):
        """``adapter``, or None with the reason kept for ``take_failures``."""
        try:
            return self.adapter(lora_id, path, keep)
        except Exception as e:   # noqa: BLE001 - its requests fail, not the step
            logger.warning("cannot read LoRA adapter %d at %s: %s", lora_id, path, e)
            self.failed[lora_id] = f"{type(e).__name__}: {e}"
            return None

    def for_step(self, lora_ids: np.ndarray, lora_paths: np.ndarray,
                 query_start_loc: np.ndarray) -> Optional[StepLoRA]:
        """The step's rows per adapter (None when no sequence has one)."""
        if not len(lora_ids) or not lora_ids.any():
            return None
        paths = json.loads(lora_paths.tobytes().decode())
        per_row = np.repeat(lora_ids, np.diff(query_start_loc))
        ids = [int(i) for i in np.unique(lora_ids) if i]
        keep = {(i, paths[str(i)]) for i in ids}
        groups = []
        for i in ids:
            weights = self._adapter_or_failure(i, paths[str(i)], keep)
            if weights is None:
                continue
            rows = np.flatnonzero(per_row == i)
            if rows[-1] - rows[0] + 1 == len(rows):
                rows = slice(int(rows[0]), int(rows[-1]) + 1)
            groups.append((weights, rows))
        return StepLoRA(groups) if groups else None

    def take_failures(self) -> dict:
        """{adapter id: why} of the adapters that could not be read since the last call (their
        rows ran without them: the master ends their requests)."""
        failed, self.failed = self.failed, {}
        return failed
