"""vLLM's Model FLOPs Utilization estimates (``--enable-mfu-metrics``): the floating point
operations, bytes read and bytes written one device does for a step, estimated from the model's
shape and what the step runs, with vLLM 0.32's formulas (vllm/v1/metrics/perf.py).

A step runs rows (sequences) of ``n`` tokens each, which then have ``ctx`` tokens of context
(their KV included). A row is a prefill when it runs more than one token or is still in its
prompt; the others are decodes. Over the step, with T = sum(n) and TC = sum(n * ctx), for L
layers of hidden size D, q query and kv KV heads of head_dim d (per device: the heads, the MLP
and the vocabulary are split over tensor_parallel_size ranks):

- attention: 2·T·D·(q + 2kv)·d·L (q/k/v projections), 2·T·D·q·d·L (output projection),
  2·2·q·TC·d·L (QK^T and AV);
- MLP, as vLLM counts it (three GEMMs): 2·3·D·I·T per dense layer, 2·3·D·I_moe·T·k per
  mixture-of-experts layer (k experts a token; vLLM counts every layer of a model with experts
  as one);
- LM head: 2·D·V per logits row (one per prefill, one per decode token).

Bytes read and written count the weights once per step, the activations in and out of each
GEMM, the K/V read by attention (a decode's from the KV cache) and written to it, at the model
dtype's size (the KV cache's for the cache). Each step costs a few array sums and a handful of
integer products, whatever the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llm_serving.config import KV_DTYPE_BYTES, EngineConfig
from llm_serving.engine.metrics import EngineStats


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a model, per device."""
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int           # a dense MLP's, per device
    moe_layers: int
    experts: int                # routed experts (per device: no expert parallelism here)
    experts_per_token: int
    moe_intermediate: int       # an expert's, per device
    vocab: int                  # the LM head's rows, per device
    weight_bytes: int
    cache_bytes: float          # per KV value, the mean over layers (kv_cache_dtype_skip_layers)

    @classmethod
    def of(cls, config: EngineConfig) -> "ModelShape":
        """The shape of ``config``'s model on one of its tensor-parallel ranks."""
        hf, tp = config.model.hf, config.parallel.tensor_parallel_size
        return cls(layers=hf.num_layers, hidden=hf.hidden_size,
                   q_heads=max(1, hf.num_heads // tp), kv_heads=max(1, hf.num_kv_heads // tp),
                   head_dim=hf.head_dim, intermediate=hf.intermediate_size // tp,
                   moe_layers=hf.num_layers if hf.num_experts else 0, experts=hf.num_experts,
                   experts_per_token=hf.num_experts_per_tok,
                   moe_intermediate=hf.moe_intermediate_size // tp, vocab=hf.vocab_size // tp,
                   weight_bytes=KV_DTYPE_BYTES[config.model.weight_dtype],
                   cache_bytes=float(np.mean([KV_DTYPE_BYTES[d]
                                              for d in config.model.kv_layer_dtypes])))


class MfuEstimator:
    def __init__(self, shape: ModelShape, stats: EngineStats):
        self.shape = shape
        self.stats = stats

    def observe(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                prompt_lens: np.ndarray) -> None:
        """Add one step's estimates to ``stats``: its rows' token offsets (StepInput's
        query_start_loc), context lengths after the step (seq_lens) and prompt lengths."""
        n = np.diff(query_start_loc).astype(np.int64)
        ctx = seq_lens.astype(np.int64)
        prefill = (n > 1) | (ctx <= prompt_lens)
        t, tc = int(n.sum()), int(n @ ctx)
        prefill_tokens, prefill_ctx = int(n[prefill].sum()), int(ctx[prefill].sum())
        decode_tokens, decode_ctx = t - prefill_tokens, int(ctx.sum()) - prefill_ctx
        logits = int(prefill.sum()) + decode_tokens
        flops, read, written = self.estimate(t, tc, prefill_tokens, prefill_ctx, decode_tokens,
                                             decode_ctx, logits)
        st = self.stats
        st.estimated_flops += flops
        st.estimated_read_bytes += read
        st.estimated_write_bytes += written

    def estimate(self, t: int, tc: int, prefill_tokens: int, prefill_ctx: int,
                 decode_tokens: int, decode_ctx: int, logits: int) -> tuple[int, int, int]:
        """(FLOPs, bytes read, bytes written) of a step of ``t`` tokens (see the module's
        docstring for the terms)."""
        m = self.shape
        L, D, q, kv, d = m.layers, m.hidden, m.q_heads, m.kv_heads, m.head_dim
        a = w = m.weight_bytes          # activations and weights: the model dtype's size
        c = m.cache_bytes
        dense, moe = L - m.moe_layers, m.moe_layers
        routed = t * m.experts_per_token                     # tokens through an expert
        active = min(routed, m.experts)                      # experts whose weights are read
        I, Im, V = m.intermediate, m.moe_intermediate, m.vocab
        qkv = (q + 2 * kv) * d
        flops = (2 * t * D * qkv * L + 2 * t * D * q * d * L + 4 * q * tc * d * L
                 + 6 * D * I * t * dense + 6 * D * Im * routed * moe + 2 * logits * D * V)
        read = ((t * D * a + D * qkv * w + t * q * d * a + q * d * D * w) * L
                + ((prefill_tokens + decode_tokens) * q * d * a + 2 * prefill_ctx * kv * d * a
                   + 2 * decode_ctx * kv * d * c) * L
                + (t * D * a + 3 * D * I * w + 3 * t * I * a) * dense
                + (routed * D * a + 3 * D * Im * active * w + 3 * routed * Im * a) * moe
                + logits * D * a + D * V * w)
        written = ((t * qkv * a + 2 * t * kv * d * c + t * D * a) * L
                   + (3 * t * I * a + t * D * a) * dense
                   + (3 * routed * Im * a + routed * D * a) * moe
                   + logits * V * a)
        return flops, int(read), int(written)
