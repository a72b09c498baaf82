"""ALiBi slopes (Press et al.; BLOOM's build_alibi_tensor and Baichuan2-13B's _get_interleave,
which agree): head h of n gets start ** (h + 1), start = 2 ** (-8 / n), for n a power of two;
otherwise the first c = 2 ** floor(log2 n) heads take those of c heads and the other n - c
take every other slope of 2c heads (the 1st, 3rd, 5th, ...). A score of query position i on
key position j gets ``slope * (j - i)``: the attention backends add it (their
``alibi_slopes``, one per query head of the rank)."""
from __future__ import annotations

import math

import numpy as np


def _power_of_2_slopes(n: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """float32 [num_heads]: every head's slope, in head order."""
    c = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_2_slopes(c) + _power_of_2_slopes(2 * c)[0::2][:num_heads - c]
    return np.asarray(slopes, np.float32)


def rank_slopes(num_heads: int, tp_rank: int, tp_size: int) -> np.ndarray:
    """The slopes of tensor-parallel rank ``tp_rank``'s heads (a contiguous block of
    num_heads / tp_size, as the column-parallel q projection splits them)."""
    per = num_heads // tp_size
    return np.ascontiguousarray(alibi_slopes(num_heads)[tp_rank * per:(tp_rank + 1) * per])
