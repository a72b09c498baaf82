"""RMSNorm and LayerNorm (with a bias, as in GPT-2 and GPTBigCode), optionally fused with the
residual add that precedes them, and RMSNorm per head."""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, ops

from llm_serving.model_executor.cpu_graph import launch
from llm_serving.model_executor.layers.custom_op import (CustomOp, cpu_layer_ops, empty, ptr,
                                                        row_stride)


class RMSNorm(CustomOp):
    """``norm(x)``, or with a residual: ``residual = x + residual; return norm(residual), residual``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = Parameter(Tensor(np.ones(hidden_size, np.float32)), name="weight")

    def forward_native(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        var = ops.mean(ops.square(x), -1, keep_dims=True)
        out = x * ops.rsqrt(var + self.eps) * self.weight
        return out if residual is None else (out, residual)

    def forward_cpu(self, x, residual=None):
        rows = x.shape[0]
        _, out = empty(x.shape)
        lib = cpu_layer_ops()
        if residual is None:
            launch(lib.rms_norm_f32, ptr(x), ptr(self.weight), ptr(out), rows,
                   self.hidden_size, self.eps)
            return out
        launch(lib.add_rms_norm_f32, ptr(x), ptr(residual), ptr(self.weight), ptr(out), rows,
               self.hidden_size, self.eps)
        return out, residual


class HeadRMSNorm(CustomOp):
    """RMSNorm over each head of ``x`` [T, heads * head_dim], with one weight [head_dim] for
    every head (Qwen3's q_norm and k_norm). On CPU it works in place: ``x`` is this step's
    slice of the fused qkv output."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim
        self.eps = float(eps)
        self.weight = Parameter(Tensor(np.ones(head_dim, np.float32)), name="weight")

    def forward_native(self, x):
        t = x.shape[0]
        heads = x.reshape(t, -1, self.head_dim)
        var = ops.mean(ops.square(heads), -1, keep_dims=True)
        return (heads * ops.rsqrt(var + self.eps) * self.weight).reshape(t, -1)

    def forward_cpu(self, x):
        launch(cpu_layer_ops().head_rms_norm_f32, ptr(x), ptr(self.weight), x.shape[0],
               x.shape[1] // self.head_dim, self.head_dim, row_stride(x), self.eps)
        return x


class LayerNorm(CustomOp):
    """LayerNorm with a bias over the last dimension (GPTBigCode's ``ln_1``, ``ln_2``, ``ln_f``):
    ``norm(x)``, or with a residual: ``residual = x + residual; return norm(residual), residual``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = Parameter(Tensor(np.ones(hidden_size, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(hidden_size, np.float32)), name="bias")

    def forward_native(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        centered = x - ops.mean(x, -1, keep_dims=True)
        var = ops.mean(ops.square(centered), -1, keep_dims=True)
        out = centered * ops.rsqrt(var + self.eps) * self.weight + self.bias
        return out if residual is None else (out, residual)

    def forward_cpu(self, x, residual=None):
        rows = x.shape[0]
        _, out = empty(x.shape)
        lib = cpu_layer_ops()
        if residual is None:
            launch(lib.layer_norm_f32, ptr(x), ptr(self.weight), ptr(self.bias), ptr(out), rows,
                   self.hidden_size, self.eps)
            return out
        launch(lib.add_layer_norm_f32, ptr(x), ptr(residual), ptr(self.weight), ptr(self.bias),
               ptr(out), rows, self.hidden_size, self.eps)
        return out, residual
