"""Rotary position embedding (rotate-half layout, as HF Llama), with linear, llama3, YaRN and
dynamic NTK rope scaling."""
from __future__ import annotations

import math

import numpy as np
from mindspore import Tensor, ops

from llm_serving.model_executor.cpu_graph import launch
from llm_serving.model_executor.layers.custom_op import CustomOp, cpu_layer_ops, ptr, row_stride


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> np.ndarray:
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default", "dynamic"):
        # dynamic NTK (InternLM2's configs have it) changes the base only for sequences longer
        # than max_position_embeddings, in transformers and in vLLM (which keeps it without
        # max_trained_positions); positions end there here.
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    if kind == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, base, rope_scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     "(supported: default, linear, llama3, yarn, dynamic)")


def yarn_inv_freq(inv_freq: np.ndarray, head_dim: int, base: float,
                  rope_scaling: dict) -> np.ndarray:
    """YaRN (static, as transformers and vLLM apply it): frequencies that turn fewer than
    ``beta_slow`` times over the original context are interpolated by ``factor``, those that
    turn more than ``beta_fast`` times are kept, with a linear ramp between."""
    factor = float(rope_scaling["factor"])
    old_len = float(rope_scaling["original_max_position_embeddings"])

    def dim_of(rotations):
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dim_of(rope_scaling.get("beta_fast") or 32)
    high = dim_of(rope_scaling.get("beta_slow") or 1)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (``attention_factor``, else
    from ``factor`` and ``mscale`` / ``mscale_all_dim``), 1 for every other kind."""
    if not rope_scaling or rope_scaling.get("rope_type") != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale()


class RotaryEmbedding(CustomOp):
    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0,
                 rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
        # [max_position, head_dim]: cos in the first half, sin in the second.
        cache = np.concatenate([np.cos(freqs), np.sin(freqs)], -1)
        cache = (cache * rope_attention_factor(rope_scaling)).astype(np.float32)
        self.cos_sin_np = np.ascontiguousarray(cache)
        self.cos_sin_cache = Tensor.from_numpy(self.cos_sin_np)

    def forward_native(self, positions, q, k):
        """q: [T, Hq*D], k: [T, Hk*D]; returns rotated copies."""
        cos_sin = ops.gather(self.cos_sin_cache, positions, 0)
        cos, sin = ops.chunk(cos_sin, 2, -1)
        cos, sin = cos.expand_dims(1), sin.expand_dims(1)

        def rotate(x):
            t = x.shape[0]
            x = x.reshape(t, -1, self.head_dim)
            x1, x2 = ops.chunk(x, 2, -1)
            return ops.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(t, -1)

        return rotate(q), rotate(k)

    def forward_cpu(self, positions, q, k):
        """Rotates q and k in place: they are this step's slices of the fused qkv output."""
        t = q.shape[0]
        launch(cpu_layer_ops().rotary_embedding_f32, ptr(q), ptr(k), ptr(positions),
               self.cos_sin_np.ctypes.data, t, q.shape[1] // self.head_dim,
               k.shape[1] // self.head_dim, self.head_dim, row_stride(q), row_stride(k))
        return q, k
