"""The Llama family in MindSpore: Llama 2/3 (llama3 rope scaling), GQA/MQA, Qwen2's q/k/v
bias, Qwen3's per-head q/k RMSNorm, tied embeddings, and Qwen3-MoE's sparse expert layers
(``layers/moe.py``: an MoE layer's ``forward_ffn`` runs that block instead of the MLP).
Layers take tensors and return tensors; attention finds its cache and metadata in the
forward context (``forward_context.py``). Decoder layers split into ``forward_attn`` and
``forward_ffn``, and the model is enabled for multi-stream by seed 000's four steps
(docs/multistream.md): the imports, ``SupportsMultiStream`` and a ``multistream_config`` on
the causal LM, the pre/post layers around the decoder loop, and ``@support_multi_stream`` on
the decoder layer. Qwen2, Qwen3, Qwen3-MoE, InternLM (v1: q/k/v/o biases) and InternLM2
(``internlm2.py``: its weight names) run through these same classes.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
from mindspore import nn

from llm_serving.model_executor.attention.backend import AttentionBackend
from llm_serving.model_executor.attention.layer import Attention
from llm_serving.model_executor.layers.activation import SiluAndMul
from llm_serving.model_executor.layers.layernorm import HeadRMSNorm, RMSNorm
from llm_serving.model_executor.layers.linear import Linear, VocabEmbedding
from llm_serving.model_executor.layers.moe import SparseMoeBlock
from llm_serving.model_executor.layers.rotary_embedding import RotaryEmbedding
from llm_serving.model_executor.models.weights import load_named_weights
from llm_serving.config import kv_heads_per_rank
# Multi-stream, step 1: the imports.
from llm_serving.model_executor.multistream.config import MultiStreamConfig
from llm_serving.model_executor.multistream.decorators import support_multi_stream
from llm_serving.model_executor.multistream.interfaces import SupportsMultiStream
from llm_serving.model_executor.multistream.layers import (MultiStreamPostTransformerLayer,
                                                           MultiStreamPreTransformerLayer)
from llm_serving.model_executor.multistream.metadata import make_multistream_metadata


class LlamaMLP(nn.Cell):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel (its
    partial sums all-reduced unless ``reduce_results`` is False: a MoE expert's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank=0, tp_size=1,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, False, tp_rank,
                                   tp_size, "column")
        self.down_proj = Linear(intermediate_size, [hidden_size], False, tp_rank, tp_size,
                                "row", reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def construct(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Cell):
    def __init__(self, config, backend: AttentionBackend, layer_idx: int, tp_rank=0,
                 tp_size=1):
        super().__init__()
        d = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(config.num_kv_heads, tp_size)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # KV heads fewer than ranks are replicated: groups of kv_replicas ranks share one.
        kv_replicas = max(1, tp_size // config.num_kv_heads)
        self.qkv_proj = Linear(
            config.hidden_size,
            [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d],
            config.qkv_bias, tp_rank, tp_size, "column", split_output=True,
            replicas=[1, kv_replicas, kv_replicas])
        self.o_proj = Linear(config.num_heads * d, [config.hidden_size], config.o_bias,
                             tp_rank, tp_size, "row")
        # Qwen3: q and k are normalized per head (weights [head_dim], the same on every rank).
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = HeadRMSNorm(d, config.rms_norm_eps)
            self.k_norm = HeadRMSNorm(d, config.rms_norm_eps)
        # ALiBi (Baichuan2-13B) instead of rotary: the attention backend adds its biases.
        self.rotary_emb = None if config.alibi else RotaryEmbedding(
            d, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self.attn = Attention(backend, layer_idx)

    def construct(self, positions, hidden_states):
        q, k, v = self.qkv_proj(hidden_states)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


# Multi-stream, step 4: forward split into forward_attn / forward_ffn, and the decorator.
@support_multi_stream(
    dynamic_arg_ms={
        "forward": ["positions", "hidden_states", "residual"],
        "forward_attn": ["positions", "hidden_states", "residual"],
        "forward_ffn": ["hidden_states", "residual"],
    },
    unpacked_arg=set(),      # the KV cache is in the forward context, not an argument
)
class LlamaDecoderLayer(nn.Cell):
    def __init__(self, config, backend: AttentionBackend, layer_idx: int, tp_rank=0,
                 tp_size=1):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer_idx, tp_rank, tp_size)
        if config.is_moe_layer(layer_idx):          # Qwen3-MoE: the sparse experts
            experts = [LlamaMLP(config.hidden_size, config.moe_intermediate_size, tp_rank,
                                tp_size, reduce_results=False)
                       for _ in range(config.num_experts)]
            self.mlp = SparseMoeBlock(config, experts, tp_rank, tp_size)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_attn(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.self_attn(positions, hidden_states), residual

    def forward_ffn(self, hidden_states, residual):
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def construct(self, positions, hidden_states, residual):
        return self.forward_ffn(*self.forward_attn(positions, hidden_states, residual))


class LlamaModel(nn.Cell):
    def __init__(self, config, backend: AttentionBackend, tp_rank=0, tp_size=1,
                 multistream_config: Optional[MultiStreamConfig] = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp_rank,
                                           tp_size)
        self.layers = nn.CellList([LlamaDecoderLayer(config, backend, i, tp_rank, tp_size)
                                   for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Multi-stream, step 3: the metadata and the layers that cut and join micro-batches.
        self.multistream_metadata = make_multistream_metadata(
            start_layer=0, end_layer=config.num_layers,
            causal_lm=getattr(config, "causal_lm", True),
            multistream_config=multistream_config)
        self.ms_pre_layer = MultiStreamPreTransformerLayer(self.multistream_metadata)
        self.ms_post_layer = MultiStreamPostTransformerLayer(self.multistream_metadata)

    def construct(self, input_ids, positions):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        positions, hidden_states, residual = self.ms_pre_layer(
            [positions, hidden_states, residual])
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, residual = self.ms_post_layer([hidden_states, residual])
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# Multi-stream, step 2: the causal LM declares it and passes its config to the model.
class LlamaForCausalLM(nn.Cell, SupportsMultiStream):
    # checkpoint name fragment -> (our parameter fragment, fused part index)
    stacked_params = [
        (".q_proj.", ".qkv_proj.", 0),
        (".k_proj.", ".qkv_proj.", 1),
        (".v_proj.", ".qkv_proj.", 2),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]

    def __init__(self, config, backend: AttentionBackend, tp_rank=0, tp_size=1,
                 multistream_config: Optional[MultiStreamConfig] = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, tp_rank, tp_size,
                                multistream_config=multistream_config)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, tp_rank,
                                          tp_size)

    def construct(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states):
        """float32 numpy logits [M, vocab] (None on tensor-parallel ranks other than 0)."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Fill parameters from (HF name, array) pairs; every parameter must be covered."""
        tied = self.config.tie_word_embeddings
        load_named_weights(self, ((name, w) for name, w in weights
                                  if "rotary_emb.inv_freq" not in name
                                  and not (tied and name == "lm_head.weight")),
                           self.stacked_params)


class LlamaEmbeddingModel(nn.Cell):
    """The decoder alone, for a pooling runner (vLLM's ``--runner pooling`` on these
    architectures): its final-norm hidden states, no LM head. It loads a causal LM's
    checkpoint (its lm_head left out), a base model's (HF ``LlamaModel``, ``Qwen3Model``:
    names without the "model." prefix) and a sequence classifier's (HF
    ``LlamaForSequenceClassification``: its ``score`` head, ``num_labels`` rows, replicated
    on every tensor-parallel rank)."""
    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config, backend: AttentionBackend, tp_rank=0, tp_size=1,
                 multistream_config: Optional[MultiStreamConfig] = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, tp_rank, tp_size)
        self.score = (Linear(config.hidden_size, [config.num_labels])
                      if config.num_labels else None)

    def construct(self, input_ids, positions):
        return self.model(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        load_named_weights(self, ((name if name.startswith(("model.", "score.")) else
                                   "model." + name, w)
                                  for name, w in weights
                                  if "rotary_emb.inv_freq" not in name
                                  and not name.startswith("lm_head.")),
                           self.stacked_params)
