"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, ops

from llm_serving.model_executor.cpu_graph import launch
from llm_serving.model_executor.layers.custom_op import CustomOp, cpu_layer_ops, empty, ptr


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
