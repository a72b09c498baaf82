"""Activations: SwiGLU's silu(gate) * up on a fused [.., 2F] gate_up projection, and GELU."""
from __future__ import annotations

from mindspore import ops

from llm_serving.model_executor.cpu_graph import launch
from llm_serving.model_executor.layers.custom_op import CustomOp, cpu_layer_ops, empty, ptr


class SiluAndMul(CustomOp):
    def forward_native(self, x):
        gate, up = ops.chunk(x, 2, -1)
        return ops.silu(gate) * up

    def forward_cpu(self, x):
        rows, two_f = x.shape
        _, out = empty((rows, two_f // 2))
        launch(cpu_layer_ops().silu_and_mul_f32, ptr(x), ptr(out), rows, two_f // 2)
        return out


class GELU(CustomOp):
    """gelu(x), exact (erf) or with PyTorch's tanh approximation (``approximate="tanh"``:
    transformers' ``gelu_pytorch_tanh``, ``gelu_new``)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', not {approximate!r}")
        self.approximate = approximate

    def forward_native(self, x):
        return ops.gelu(x, approximate=self.approximate)

    def forward_cpu(self, x):
        rows, dim = x.shape
        _, out = empty((rows, dim))
        launch(cpu_layer_ops().gelu_f32, ptr(x), ptr(out), rows, dim,
               int(self.approximate == "tanh"))
        return out
