"""The sparse mixture-of-experts block of Qwen3-MoE, as transformers' Qwen3MoeSparseMoeBlock
computes it: a router (``gate``, [num_experts, hidden], no bias) gives each token a softmax
over the experts; the token goes to its top ``num_experts_per_tok`` experts, weighted by their
probabilities (renormalized to sum to 1 with ``norm_topk_prob``); each expert is a SwiGLU MLP.

Each expert runs once per step on the rows routed to it (gathered, its GEMMs, scattered back
with their weights, experts in ascending order as transformers adds them): no expert computes
rows that did not choose it, and the only Python loop is over the experts a step uses.

Tensor parallel: the router is replicated; every expert is split as the dense MLP is (gate/up
column-parallel, down row-parallel), and the block's output, the sum of the experts' partial
outputs, is all-reduced once.

On CPU the whole block is one call recorded by the CPU graphs (``cpu_graph.launch``, a Python
callable, as the embedding's gather): a replayed decode step calls it on the step's hidden
states, so the routing is made again from each step's data; inside, the router and the experts
run on our GEMM kernels, unrecorded. ``forward_native`` (Ascend, ``LLM_SERVING_NATIVE_OPS=1``)
is the same in MindSpore ops, the routing read on the host to pick each expert's rows.
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.layers.custom_op import CustomOp, empty
from llm_serving.model_executor.layers.linear import Linear
from llm_serving.model_executor.parallel_state import get_tp_group


def route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (weights [T, top_k] float32, experts [T, top_k]), each row's
    most probable experts first (the lower index first on a tie, as torch.topk)."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, -1)
    if renormalize:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


class SparseMoeBlock(CustomOp):
    """``experts``: the expert cells (x [rows, hidden] -> [rows, hidden]), their row-parallel
    outputs not yet all-reduced."""

    def __init__(self, config, experts: list, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if len(experts) != config.num_experts:
            raise ValueError(f"{len(experts)} experts for a model of {config.num_experts}")
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.tp_size = tp_size
        self.gate = Linear(config.hidden_size, [config.num_experts])    # replicated
        self.experts = nn.CellList(experts)

    def _reduce(self, out):
        if self.tp_size > 1:
            cpu_graph.unsupported("a tensor-parallel all-reduce")
            get_tp_group().all_reduce(out)
        return out

    def forward_native(self, x):
        logits = self.gate(x).astype(mstype.float32)
        weights, experts = ops.topk(ops.softmax(logits, -1), self.top_k)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdims=True)
        weights = weights.astype(x.dtype)
        chosen = experts.asnumpy()
        out = ops.zeros_like(x)
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)
            index = Tensor(rows.astype(np.int32))
            w = ops.gather_nd(weights, Tensor(np.stack([rows, slot], -1).astype(np.int32)))
            y = self.experts[int(e)](ops.gather(x, index, 0)) * w.expand_dims(-1)
            out = ops.tensor_scatter_add(out, index.expand_dims(-1), y)
        return self._reduce(out)

    def forward_cpu(self, x):
        arr, out = empty(tuple(x.shape))
        cpu_graph.launch(self._mix, x.asnumpy(), arr)
        return self._reduce(out)

    def _mix(self, x: np.ndarray, out: np.ndarray) -> None:
        """out = the experts' weighted outputs for rows x (both [T, hidden], float32)."""
        with cpu_graph.paused():        # one recorded call: the routing is the data's
            logits = self.gate(Tensor.from_numpy(x)).asnumpy()
            weights, experts = route(logits, self.top_k, self.renormalize)
            out[...] = 0
            for e in np.unique(experts):
                rows, slot = np.nonzero(experts == e)
                y = self.experts[int(e)](Tensor.from_numpy(x[rows])).asnumpy()
                out[rows] += y * weights[rows, slot, None]
