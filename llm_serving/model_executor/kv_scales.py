"""A checkpoint's own FP8 KV-cache scales (k_scale, v_scale), folded into the weights at load.

With an FP8 KV cache, vLLM stores fp8(k / k_scale) and attention reads it times k_scale (the
same for v), one scale per layer from the checkpoint (compressed-tensors' ``kv_cache_scheme``,
llm-compressor's calibration; a deprecated lone ``kv_scale`` serves both, a layer without one
gets 1.0); with any other cache the scales are not used. Here nothing changes in attention:
since q . k = (q * k_scale) . (k / k_scale) and the output is v_scale * sum p (v / v_scale),
the k rows of the layer's fused q/k/v projection (weight and bias) are divided by k_scale, its
q rows multiplied by it (rotary is linear, so this commutes; with Qwen3's per-head q_norm and
k_norm, which would undo a scale on the projection, their weights are scaled instead), its v
rows divided by v_scale, and the output projection's weight (not its bias) multiplied by
v_scale. The cache then holds fp8(k / k_scale) as vLLM's does, and a step costs nothing more.
A W8A8 int8 layer has its per-channel weight scales scaled instead (and the output
projection's static input scale divided by v_scale, so it quantizes the same integers).

``load_named_weights`` (``models/weights.py``) hands every checkpoint tensor to ``take`` first,
then ``fold``s the host buffers before they are stored, for the layers whose KV cache is FP8
(``kv_cache_dtype_skip_layers``' are not). The scales of the first load are kept on the model:
a reload folds them again, and refuses a scale tensor that differs from them (the cache's
blocks were written with them).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.errors import ModelLoadError

logger = logging.getLogger(__name__)

# a decoder layer's tensors: model.layers.N. (Llama family) or transformer.h.N. (GPTBigCode)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.(.+)$")
# the checkpoint's names of KV scales (vLLM's maybe_remap_kv_scale_name takes these): a leaf
# k_scale / v_scale under the layer's attention (self_attn.k_scale, self_attn.k_proj.k_scale,
# self_attn.qkv_proj.k_scale, ...), the deprecated kv_scale, and k_proj.output_scale
_LEAF = re.compile(r"(?:^|\.)(?:([qkv]|kv|prob)_scale|([kqv])_proj\.output_scale"
                   r"|([qkv])_zero_point)$")


@dataclass(frozen=True)
class _AttentionParts:
    qkv: str                   # the fused q/k/v Linear
    o: str                     # the output projection
    q_norm: Optional[str]      # Qwen3's per-head norms (None: none)
    k_norm: Optional[str]


def set_kv_layer_dtypes(model, dtypes) -> None:
    """Tell ``model`` each layer's KV cache dtype (before loading): the FP8 ones get the
    checkpoint's scales folded in."""
    model.kv_fp8_layers = frozenset(i for i, d in enumerate(dtypes) if str(d).startswith("fp8"))


class KVScales:
    """One load's KV scales: ``take`` the checkpoint's scale tensors, then ``fold`` them."""

    def __init__(self, model, cells: dict, reload: bool):
        self.model, self.cells, self.reload = model, cells, reload
        self.given: dict[int, dict] = {}    # layer -> {"k" | "v" | "kv": scale}
        self.unused: set = set()            # q_scale, prob_scale: attention runs in float

    def take(self, name: str, loaded) -> bool:
        """Whether ``name`` is a KV scale (kept, or checked and dropped); ModelLoadError for
        one that is not served."""
        m = _LAYER.search(name)
        leaf = _LEAF.search(m.group(2)) if m else None
        if leaf is None:
            return False
        value = np.asarray(loaded, np.float32)
        if leaf.group(3):
            if np.any(value):
                raise ModelLoadError(f"checkpoint tensor {name!r}: nonzero zero points "
                                     "(asymmetric KV quantization) are not served")
            return True
        if value.size != 1:
            raise ModelLoadError(f"checkpoint tensor {name!r} holds {value.size} scales: "
                                 "per-head KV scales (kv_cache_scheme strategy attn_head) are "
                                 "not served; one k_scale and one v_scale per layer are")
        kind = leaf.group(1) or leaf.group(2)
        if kind in ("q", "prob"):
            self.unused.add(f"{kind}_scale")
            return True
        scale = float(value.reshape(-1)[0])
        if not (np.isfinite(scale) and scale > 0):
            raise ModelLoadError(f"checkpoint tensor {name!r}: a KV scale must be a positive "
                                 f"finite number, got {scale}")
        self.given.setdefault(int(m.group(1)), {})[kind] = scale
        return True

    def fold(self, host: dict) -> None:
        """Scale the host buffers of the FP8 layers' attention projections (and norms)."""
        scales = self._scales()
        fp8 = getattr(self.model, "kv_fp8_layers", frozenset())
        if self.unused and not self.reload:
            logger.info("the checkpoint's %s are not used: attention runs in float here "
                        "(as vLLM-CPU's)", " and ".join(sorted(self.unused)))
        if not scales:
            return
        parts = _attention_parts(self.cells)
        missing = sorted(set(scales) - set(parts))
        if missing:
            raise ModelLoadError(f"checkpoint KV scales for layer {missing[0]}, which the model "
                                 "does not have")
        folded = sorted(set(scales) & fp8)
        if not self.reload:
            if folded:
                logger.info("the checkpoint's KV scales folded into %d layers' attention "
                            "weights for the FP8 KV cache (k_scale %.4g..%.4g, v_scale "
                            "%.4g..%.4g)", len(folded),
                            *_span(scales[i][0] for i in folded),
                            *_span(scales[i][1] for i in folded))
            if len(folded) < len(scales):
                logger.info("the checkpoint's KV scales of %d layers are not used: their KV "
                            "cache is not FP8", len(scales) - len(folded))
        folds = {}
        for layer in folded:
            folds.update(self._fold_layer(host, parts[layer], *scales[layer]))
        self.model.kv_folds = folds

    def _scales(self) -> dict:
        """{layer: (k_scale, v_scale)}: this load's, or on a reload the ones held (the new
        tensors must equal them)."""
        given = {}
        for layer, s in self.given.items():
            k = s.get("k", s.get("kv", s.get("v")))     # a lone one serves both (vLLM's)
            v = s.get("v", s.get("kv", k))
            given[layer] = (k, v)
        if not self.reload:
            self.model.kv_scales = given
            return given
        held = getattr(self.model, "kv_scales", {})
        for layer, kv in given.items():
            if np.float32(kv).tolist() != np.float32(held.get(layer, (1.0, 1.0))).tolist():
                raise ModelLoadError(f"layer {layer}'s KV scales {kv} differ from the ones "
                                     f"loaded at start {held.get(layer, (1.0, 1.0))}: the KV "
                                     "cache holds values written with those; restart the "
                                     "server to change them")
        return held

    def _fold_layer(self, host: dict, p: _AttentionParts, ks: float, vs: float) -> dict:
        """Fold one layer's scales; {qkv: its parts' row factors, o: its input factor}."""
        qkv = self.cells[p.qkv]
        norms = p.q_norm is not None
        factors = (1.0, 1.0, 1 / vs) if norms else (ks, 1 / ks, 1 / vs)
        for leaf in ("weight", "bias", "weight_scale"):
            buf = host.get(f"{p.qkv}.{leaf}")
            if buf is None or buf.dtype == np.int8:   # an int8 weight: its scales are folded
                continue
            for part, f in enumerate(factors):
                start = qkv.offsets[part]
                buf[start:start + qkv.output_sizes[part]] *= np.float32(f)
        for name, f in ((p.q_norm, ks), (p.k_norm, 1 / ks)) if norms else ():
            if f"{name}.weight" in host:
                host[f"{name}.weight"] *= np.float32(f)
        for leaf, f in (("weight", vs), ("weight_scale", vs), ("input_scale", 1 / vs)):
            buf = host.get(f"{p.o}.{leaf}")
            if buf is not None and buf.dtype != np.int8:
                buf *= np.float32(f)
        return {p.qkv: factors, p.o: vs}


def fold_lora(model, layers: dict) -> dict:
    """A LoRA adapter's {layer: (A, [(part, first row of A, end row, B)])} (``lora.py``) with
    the model's KV scales folded in as into its weights: a q/k/v part's B rows times the
    part's factor, the output projection's A (its input side) times v_scale."""
    folds = getattr(model, "kv_folds", None)
    if not folds:
        return layers
    out = {}
    for name, (a, parts) in layers.items():
        f = folds.get(name)
        if isinstance(f, tuple):
            parts = [(part, lo, hi, b * np.float32(f[part])) for part, lo, hi, b in parts]
        elif f is not None:
            a = a * np.float32(f)
        out[name] = (a, parts)
    return out


def _span(values) -> tuple:
    values = list(values)
    return min(values), max(values)


def _attention_parts(cells: dict) -> dict:
    """{layer index: its attention's parts}: the cell holding each Attention layer has the
    fused q/k/v Linear (three parts) and the output Linear beside it."""
    from llm_serving.model_executor.attention.layer import Attention
    from llm_serving.model_executor.layers.linear import Linear
    parts = {}
    for name, cell in cells.items():
        if not isinstance(cell, Attention):
            continue
        parent = name.rsplit(".", 1)[0]
        linears = {n: c for n, c in cells[parent].name_cells().items() if isinstance(c, Linear)}
        qkv = [n for n, c in linears.items() if len(c.output_sizes) == 3]
        o = [n for n in linears if n not in qkv]
        if len(qkv) != 1 or len(o) != 1:
            raise ModelLoadError(f"{parent}: KV scales need one fused q/k/v projection and one "
                                 "output projection beside the attention")
        norm = (f"{parent}.q_norm", f"{parent}.k_norm") if getattr(
            cells[parent], "q_norm", None) is not None else (None, None)
        parts[cell.layer_idx] = _AttentionParts(f"{parent}.{qkv[0]}", f"{parent}.{o[0]}", *norm)
    return parts
