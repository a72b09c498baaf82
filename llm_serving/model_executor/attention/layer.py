"""The attention layer model code calls: tensors in, tensors out.

It finds its KV cache and the step's metadata in the forward context by ``layer_idx``.
"""
from __future__ import annotations

from mindspore import nn

from llm_serving.model_executor.attention.backend import AttentionBackend
from llm_serving.model_executor.forward_context import get_forward_context


class Attention(nn.Cell):
    def __init__(self, backend: AttentionBackend, layer_idx: int):
        super().__init__()
        self.backend = backend
        self.layer_idx = layer_idx

    def construct(self, q, k, v):
        ctx = get_forward_context()
        return self.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata)
