"""Linear layers, weights kept as [out, in] (HF layout; fastest at M=1 with transpose_b).

Fused projections (q/k/v -> qkv, gate/up -> gate_up) and tensor-parallel shards are loaded
through ``weight_loader``: each layer knows which slice of its parameter a checkpoint tensor
fills, so a new model adds a name mapping, not a new loader.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops


def _param(shape) -> Parameter:
    return Parameter(Tensor(np.zeros(shape, np.float32)), requires_grad=False)


class Linear(nn.Cell):
    """y = x @ W.T (+ b). ``output_sizes`` lists the fused parts' sizes, in order."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, parallel: str = "none"):
        super().__init__()
        if parallel == "column":
            for s in output_sizes:
                if s % tp_size:
                    raise ValueError(f"output size {s} is not divisible by tp_size {tp_size}")
            output_sizes = [s // tp_size for s in output_sizes]
        elif parallel == "row" and input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        self.parallel, self.tp_rank, self.tp_size = parallel, tp_rank, tp_size
        self.input_size = input_size // tp_size if parallel == "row" else input_size
        self.output_sizes = list(output_sizes)
        self.offsets = np.concatenate([[0], np.cumsum(output_sizes)]).tolist()
        out = self.offsets[-1]
        self.weight = _param((out, self.input_size))
        self.bias = _param((out,)) if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        y = self.matmul(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y

    def weight_loader(self, host: np.ndarray, loaded: np.ndarray, shard: int = 0,
                      is_bias: bool = False) -> None:
        """Copy checkpoint tensor ``loaded`` (fused part ``shard``) into host buffer ``host``."""
        size = self.output_sizes[shard]
        if self.parallel == "column":
            loaded = loaded[self.tp_rank * size:(self.tp_rank + 1) * size]
        elif self.parallel == "row" and not is_bias:
            n = self.input_size
            loaded = loaded[:, self.tp_rank * n:(self.tp_rank + 1) * n]
        dst = host[self.offsets[shard]:self.offsets[shard] + size]
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {loaded.shape} does not fit "
                             f"a parameter slice of shape {dst.shape}")
        dst[...] = loaded


class VocabEmbedding(nn.Cell):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = _param((vocab_size, hidden_size))

    def construct(self, input_ids):
        return ops.gather(self.weight, input_ids, 0)
