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

from llm_serving.model_executor.layers.linear import Linear, VocabEmbedding


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
    unless all of them fit."""
    params = dict(model.parameters_and_names())
    cells = dict(model.cells_and_names())
    host: dict[str, np.ndarray] = {}
    filled: dict[str, set] = {}
    for name, loaded in weights:
        loaded = np.asarray(loaded, dtype=np.float32)
        target, shard = name, None
        for ckpt_part, our_part, idx in stacked_params:
            if ckpt_part in name:
                target, shard = name.replace(ckpt_part, our_part), idx
                break
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} matches no model parameter")
        param = params[target]
        cell = cells.get(target.rsplit(".", 1)[0])
        buf = host.get(target)
        if buf is None:            # a Linear may hold its weight packed: [out, in] here
            shape = (cell.gemm_shape if isinstance(cell, Linear)
                     and target.endswith(".weight") else param.shape)
            buf = host[target] = np.zeros(shape, np.float32)
        filled.setdefault(target, set()).add(shard or 0)
        if isinstance(cell, (Linear, VocabEmbedding)):
            cell.weight_loader(buf, loaded, shard or 0, target.endswith(".bias"))
        else:
            if buf.shape != loaded.shape:
                raise ValueError(f"{name}: checkpoint shape {loaded.shape} does not match "
                                 f"the model's {buf.shape}")
            buf[...] = loaded
    missing = sorted(n for n, p in params.items()
                     if (n in filled or not _loading.partial)
                     and len(filled.get(n, ())) < len(getattr(cells.get(n.rsplit(".", 1)[0]),
                                                              "output_sizes", [0])))
    if missing:
        lacks = ("lacks parts of these fused weights (give them in the same update): "
                 if _loading.partial else "lacks weights for: ")
        raise KeyError(f"checkpoint {lacks}{', '.join(missing[:8])}"
                       + (" ..." if len(missing) > 8 else ""))
    for target in list(host):
        buf = host.pop(target)           # freed as it is stored
        cell = cells.get(target.rsplit(".", 1)[0])
        if isinstance(cell, Linear) and target.endswith(".weight"):
            cell.set_weight(buf, _loading.reload)  # packed, bf16 bits if the layer holds bf16
        elif isinstance(cell, VocabEmbedding) and target.endswith(".weight"):
            cell.set_weight(buf)
        else:
            params[target].set_data(Tensor(buf))
