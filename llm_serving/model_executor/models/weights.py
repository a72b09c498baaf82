"""Filling a model's parameters from (checkpoint name, array) pairs, shared by the model files.

A model maps a checkpoint name to its own parameter through ``stacked_params`` (name fragment ->
(our fragment, fused part index)): the q/k/v projections land in one fused qkv Linear, each
in its part. ``Linear`` and ``VocabEmbedding`` take their slice of the tensor themselves
(tensor-parallel shards, fused parts) through ``weight_loader``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Sequence

import numpy as np
from mindspore import Tensor, nn

from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.kv_scales import KVScales
from llm_serving.model_executor.layers.linear import Linear, VocabEmbedding
from llm_serving.model_executor.quantization import W8A8Config


class _Loading(threading.local):
    reload = False      # into a running model: packed weights written where they are
    partial = False     # only the parameters given


_loading = _Loading()


@contextlib.contextmanager
def reloading(partial: bool):
    """Within it, ``load_named_weights`` loads into a model that runs already
    (``ModelRunner.reload_weights``, collective_rpc's reload_weights): each packed weight is
    written over the one held (no new memory: a reload after a reload does not grow the
    process), and with ``partial`` only the parameters given are updated (the others keep
    their values), each still whole: every fused part of it (q, k and v of a qkv)."""
    _loading.reload, _loading.partial = True, partial
    try:
        yield
    finally:
        _loading.reload = _loading.partial = False


def load_named_weights(model: nn.Cell, weights: Iterable[tuple[str, np.ndarray]],
                       stacked_params: Sequence[tuple[str, str, int]]) -> None:
    """Fill ``model``'s parameters from (name, array) pairs; every parameter must be covered
    (in ``reloading(partial=True)``: every part of each parameter given). Nothing is stored
    unless all of them fit. The layers a W8A8 checkpoint quantizes (``quantization.py``) take
    their int8 weight as it is, its ``weight_scale`` and a static ``input_scale``. A layer's
    KV scales (k_scale, v_scale) are folded into its attention weights (``kv_scales.py``)."""
    params = dict(model.parameters_and_names())
    cells = dict(model.cells_and_names())
    int8 = _int8_layers(model, cells, stacked_params)
    for layer, static in int8.items():       # the scales fill parameters of their own here
        params.update(dict.fromkeys([f"{layer}.weight_scale"]
                                    + ([f"{layer}.input_scale"] if static else [])))
    host: dict[str, np.ndarray] = {}
    filled: dict[str, set] = {}
    kv_scales = KVScales(model, cells, _loading.reload)
    for name, loaded in weights:
        if kv_scales.take(name, loaded):
            continue
        target, shard = name, None
        for ckpt_part, our_part, idx in stacked_params:
            if ckpt_part in name:
                target, shard = name.replace(ckpt_part, our_part), idx
                break
        layer, leaf = target.rsplit(".", 1)
        if layer in int8 and leaf.endswith("_zero_point"):
            if np.any(np.asarray(loaded)):
                raise ModelLoadError(f"checkpoint tensor {name!r}: nonzero zero points "
                                     "(asymmetric quantization) are not served")
            continue            # a symmetric scheme's zeros, as some versions write them
        if target not in params and leaf in _QUANT_LEAVES and layer in cells:
            raise ModelLoadError(f"checkpoint tensor {name!r} quantizes a layer config.json's "
                                 f"quantization_config does not quantize ({_NOT_QUANTIZED})")
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} matches no model parameter")
        cell = cells.get(layer)
        loaded = _checked_array(name, loaded, leaf if layer in int8 else None)
        buf = host.get(target)
        if buf is None:            # a Linear may hold its weight packed: [out, in] here
            buf = host[target] = _host_buffer(params[target], cell, leaf, layer in int8)
        filled.setdefault(target, set()).add(shard or 0)
        if leaf == "input_scale":
            buf[shard or 0] = loaded.reshape(-1)[0]
        elif leaf == "weight_scale" and loaded.size == 1:   # per tensor: on the part's rows
            start = cell.offsets[shard or 0]
            buf[start:start + cell.output_sizes[shard or 0]] = loaded.reshape(-1)[0]
        elif isinstance(cell, (Linear, VocabEmbedding)):
            cell.weight_loader(buf, loaded.reshape(-1) if leaf == "weight_scale" else loaded,
                               shard or 0, target.endswith(".bias") or leaf == "weight_scale")
        else:
            if buf.shape != loaded.shape:
                raise ValueError(f"{name}: checkpoint shape {loaded.shape} does not match "
                                 f"the model's {buf.shape}")
            buf[...] = loaded
    _check_complete(params, cells, filled, int8)
    kv_scales.fold(host)
    for target in list(host):
        layer, leaf = target.rsplit(".", 1)
        cell = cells.get(layer)
        if layer in int8 and leaf != "bias":     # weight and scales, stored together
            if leaf == "weight":
                given = host.pop(f"{layer}.input_scale", None)    # the parts' max, as vLLM's
                cell.set_int8_weight(host.pop(target), host.pop(f"{layer}.weight_scale"),
                                     None if given is None else float(given.max()),
                                     _loading.reload)
            continue
        buf = host.pop(target)           # freed as it is stored
        if isinstance(cell, Linear) and target.endswith(".weight"):
            cell.set_weight(buf, _loading.reload)  # packed, bf16 bits if the layer holds bf16
        elif isinstance(cell, VocabEmbedding) and target.endswith(".weight"):
            cell.set_weight(buf)
        else:
            params[target].set_data(Tensor(buf))


# a quantized checkpoint's tensors beside a layer's weight
_QUANT_LEAVES = ("weight_scale", "input_scale", "weight_zero_point", "input_zero_point")


def check_float_head(name: str, loaded) -> None:
    """A ModelLoadError for a checkpoint tensor of a quantized LM head (int8, or its scales):
    the head stays float (W8A8 checkpoints ignore it; vLLM's is a float ParallelLMHead)."""
    if name.endswith(_QUANT_LEAVES) or np.asarray(loaded).dtype == np.int8:
        raise ModelLoadError(f"checkpoint tensor {name!r}: a quantized LM head is not served "
                             "(it stays float: a W8A8 checkpoint's quantization_config ignores "
                             "it)")


def split_packed(name: str, loaded, split) -> list:
    """A packed q/k/v layer's checkpoint tensor cut into its q, k and v as ``split`` cuts the
    rows of its weight; a per-tensor scale (or zero point) of the packed layer, one value, is
    each part's (the parts' max, as a fused layer takes static input scales, is that value)."""
    loaded = np.asarray(loaded)
    if name.rsplit(".", 1)[-1] in _QUANT_LEAVES and loaded.size == 1:
        return [loaded] * 3
    return list(split(loaded))


_NOT_QUANTIZED = "there is no quantization_config, or the layer is in its ignore list"


def _int8_layers(model: nn.Cell, cells: dict, stacked_params) -> dict:
    """{name: static input scale} of the Linear layers that hold int8 weights."""
    quant = getattr(getattr(model, "config", None), "quantization", None)
    if quant is None:
        return {}
    layers = quantized_layers(model, quant, stacked_params)
    for name in layers:
        if not cells[name].int8:
            raise RuntimeError(f"{name} is quantized but holds no int8 weight: call "
                               "use_int8_weights before loading")
    return {name: scheme.static_input for name, scheme in layers.items()}


def _checked_array(name: str, loaded, int8_leaf) -> np.ndarray:
    """The checkpoint tensor as the model takes it: a quantized layer's weight int8 as
    stored, everything else float32; an int8 tensor elsewhere is a ModelLoadError."""
    is_int8 = np.asarray(loaded).dtype == np.int8
    if int8_leaf == "weight":
        if not is_int8:
            raise ModelLoadError(f"checkpoint tensor {name!r} is {np.asarray(loaded).dtype}, "
                                 "but config.json's quantization_config quantizes its layer: "
                                 "expected int8")
        return np.asarray(loaded)
    if is_int8:
        raise ModelLoadError(f"checkpoint tensor {name!r} is int8, but config.json's "
                             f"quantization_config does not quantize its layer "
                             f"({_NOT_QUANTIZED})")
    return np.asarray(loaded, dtype=np.float32)


def _host_buffer(param, cell, leaf: str, int8: bool) -> np.ndarray:
    """Where a parameter's checkpoint tensors are gathered before it is stored."""
    if leaf == "weight_scale":
        return np.zeros(cell.gemm_shape[0], np.float32)
    if leaf == "input_scale":
        return np.zeros(len(cell.output_sizes), np.float32)
    if isinstance(cell, Linear) and leaf == "weight":
        return np.zeros(cell.gemm_shape, np.int8 if int8 else np.float32)
    return np.zeros(param.shape, np.float32)


def _check_complete(params: dict, cells: dict, filled: dict, int8: dict) -> None:
    """Every parameter (in a partial reload: every one given) has all its fused parts, and an
    int8 layer given its weight has its scales (and they their weight)."""
    def given(n: str) -> bool:
        layer = n.rsplit(".", 1)[0]
        if layer in int8:
            return any(k.startswith(layer + ".") for k in filled)
        return n in filled

    missing = sorted(n for n in params
                     if (given(n) or not _loading.partial)
                     and len(filled.get(n, ())) < len(getattr(cells.get(n.rsplit(".", 1)[0]),
                                                              "output_sizes", [0])))
    if missing:
        lacks = ("lacks parts of these fused weights (give them in the same update): "
                 if _loading.partial else "lacks weights for: ")
        raise KeyError(f"checkpoint {lacks}{', '.join(missing[:8])}"
                       + (" ..." if len(missing) > 8 else ""))


def quantized_layers(model, config: W8A8Config, stacked_params) -> dict:
    """{Linear cell name: Int8Scheme} of ``model``'s layers ``config`` quantizes; a layer's HF
    parts are found by undoing ``stacked_params`` (qkv_proj -> q_proj, k_proj, v_proj), then
    named as the checkpoint names them by the model's ``checkpoint_modules`` if it has one
    (InternLM2's attention.wqkv, Baichuan's W_pack: config.json's targets name those)."""
    layers = {}
    for name, cell in model.cells_and_names():
        if not isinstance(cell, Linear):
            continue
        parts = [(idx, (name + ".").replace(ours, ckpt)[:-1])
                 for ckpt, ours, idx in stacked_params if ours in name + "."]
        parts = [p for _, p in sorted(parts)] or [name]
        rename = getattr(model, "checkpoint_modules", None)     # a packed qkv's own name
        scheme = config.scheme(rename(parts) if rename else parts)
        if scheme is not None:
            layers[name] = scheme
    return layers


def use_int8_weights(model, config: W8A8Config, stacked_params) -> int:
    """Make the layers ``config`` quantizes hold int8 weights (before loading); how many."""
    cells = dict(model.cells_and_names())
    layers = quantized_layers(model, config, stacked_params)
    for name, scheme in layers.items():
        cells[name].use_int8_weight(static_input_scale=scheme.static_input)
    return len(layers)
