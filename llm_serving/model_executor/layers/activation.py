"""SwiGLU's activation: silu(gate) * up on a fused [.., 2F] gate_up projection."""
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
