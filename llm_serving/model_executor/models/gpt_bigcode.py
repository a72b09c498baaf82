"""GPTBigCode in MindSpore: StarCoder, WizardCoder, SantaCoder (transformers'
``GPTBigCodeForCausalLM``, which MindSpore's llm-serving served as ``wizard_coder``).

A GPT-2 layout: the token embedding ``wte`` plus a learned absolute position embedding
``wpe`` (positions come from the step, as rotary's do), pre-LayerNorm blocks with biases
(``ln_1``, ``ln_2``, ``ln_f``), multi-query attention (``multi_query``: one KV head, which
tensor-parallel ranks replicate as GQA's KV heads fewer than ranks; else one per head), the
MLP ``c_fc`` -> GELU -> ``c_proj``, biases on every projection, and the LM head tied to
``wte``. Parameters carry the checkpoint's names; ``c_attn`` is one fused q/k/v Linear. A W8A8
int8 checkpoint's ``c_attn`` (one quantized layer, as vLLM's) has its int8 rows and
per-channel ``weight_scale`` rows cut as the float weight is, its biases stay float (added in
the int8 kernel's epilogue); ``checkpoint_modules`` names our q, k and v parts ``c_attn``.
Attention runs through the Attention layer and the forward context, as Llama's does; decoder
layers split into ``forward_attn`` / ``forward_ffn`` for multi-stream (docs/multistream.md).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

import numpy as np
from mindspore import nn

from llm_serving.config import kv_heads_per_rank
from llm_serving.model_executor.attention.backend import AttentionBackend
from llm_serving.model_executor.attention.layer import Attention
from llm_serving.model_executor.layers.activation import GELU
from llm_serving.model_executor.layers.layernorm import LayerNorm
from llm_serving.model_executor.layers.linear import Linear, VocabEmbedding
from llm_serving.model_executor.layers.position_embedding import PositionEmbedding
from llm_serving.model_executor.models.weights import (check_float_head, load_named_weights,
                                                       split_packed)
from llm_serving.model_executor.multistream.config import MultiStreamConfig
from llm_serving.model_executor.multistream.decorators import support_multi_stream
from llm_serving.model_executor.multistream.interfaces import SupportsMultiStream
from llm_serving.model_executor.multistream.layers import (MultiStreamPostTransformerLayer,
                                                           MultiStreamPreTransformerLayer)
from llm_serving.model_executor.multistream.metadata import make_multistream_metadata


class GPTBigCodeAttention(nn.Cell):
    def __init__(self, config, backend: AttentionBackend, layer_idx: int, tp_rank=0,
                 tp_size=1):
        super().__init__()
        d, heads, kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
        self.num_heads = heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(kv_heads, tp_size)
        kv_replicas = max(1, tp_size // kv_heads)
        self.c_attn = Linear(config.hidden_size, [heads * d, kv_heads * d, kv_heads * d], True,
                             tp_rank, tp_size, "column", split_output=True,
                             replicas=[1, kv_replicas, kv_replicas])
        self.c_proj = Linear(heads * d, [config.hidden_size], True, tp_rank, tp_size, "row")
        self.attn = Attention(backend, layer_idx)

    def construct(self, hidden_states):
        q, k, v = self.c_attn(hidden_states)
        return self.c_proj(self.attn(q, k, v))


class GPTBigCodeMLP(nn.Cell):
    def __init__(self, config, tp_rank=0, tp_size=1):
        super().__init__()
        self.c_fc = Linear(config.hidden_size, [config.intermediate_size], True, tp_rank,
                           tp_size, "column")
        self.act = GELU(config.gelu_approximate)
        self.c_proj = Linear(config.intermediate_size, [config.hidden_size], True, tp_rank,
                             tp_size, "row")

    def construct(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


@support_multi_stream(
    dynamic_arg_ms={
        "forward": ["positions", "hidden_states", "residual"],
        "forward_attn": ["positions", "hidden_states", "residual"],
        "forward_ffn": ["hidden_states", "residual"],
    },
    unpacked_arg=set(),      # the KV cache is in the forward context, not an argument
)
class GPTBigCodeBlock(nn.Cell):
    def __init__(self, config, backend: AttentionBackend, layer_idx: int, tp_rank=0,
                 tp_size=1):
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config, backend, layer_idx, tp_rank, tp_size)
        self.ln_2 = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mlp = GPTBigCodeMLP(config, tp_rank, tp_size)

    def forward_attn(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.ln_1(hidden_states)
        else:
            hidden_states, residual = self.ln_1(hidden_states, residual)
        return self.attn(hidden_states), residual

    def forward_ffn(self, hidden_states, residual):
        hidden_states, residual = self.ln_2(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def construct(self, positions, hidden_states, residual):
        return self.forward_ffn(*self.forward_attn(positions, hidden_states, residual))


class GPTBigCodeModel(nn.Cell):
    def __init__(self, config, backend: AttentionBackend, tp_rank=0, tp_size=1,
                 multistream_config: Optional[MultiStreamConfig] = None):
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.wpe = PositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.CellList([GPTBigCodeBlock(config, backend, i, tp_rank, tp_size)
                              for i in range(config.num_layers)])
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.multistream_metadata = make_multistream_metadata(
            start_layer=0, end_layer=config.num_layers,
            causal_lm=getattr(config, "causal_lm", True),
            multistream_config=multistream_config)
        self.ms_pre_layer = MultiStreamPreTransformerLayer(self.multistream_metadata)
        self.ms_post_layer = MultiStreamPostTransformerLayer(self.multistream_metadata)

    def construct(self, input_ids, positions):
        hidden_states = self.wpe(self.wte(input_ids), positions)
        residual = None
        positions, hidden_states, residual = self.ms_pre_layer(
            [positions, hidden_states, residual])
        for layer in self.h:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, residual = self.ms_post_layer([hidden_states, residual])
        hidden_states, _ = self.ln_f(hidden_states, residual)
        return hidden_states


class GPTBigCodeForCausalLM(nn.Cell, SupportsMultiStream):
    # c_attn's q, k and v parts (split by load_weights) -> the fused Linear's parts
    stacked_params = [
        (".c_attn.q.", ".c_attn.", 0),
        (".c_attn.k.", ".c_attn.", 1),
        (".c_attn.v.", ".c_attn.", 2),
    ]

    def __init__(self, config, backend: AttentionBackend, tp_rank=0, tp_size=1,
                 multistream_config: Optional[MultiStreamConfig] = None):
        super().__init__()
        self.config = config
        self.transformer = GPTBigCodeModel(config, backend, tp_rank, tp_size,
                                           multistream_config=multistream_config)
        if config.tie_word_embeddings:
            self.lm_head = self.transformer.wte
        else:
            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, tp_rank,
                                          tp_size)

    @staticmethod
    def checkpoint_modules(names: list[str]) -> list[str]:
        """The checkpoint's module names of our layer parts (c_attn's q, k, v -> c_attn)."""
        return list(dict.fromkeys(re.sub(r"\.c_attn\.[qkv]$", ".c_attn", n) for n in names))

    def construct(self, input_ids, positions):
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states):
        """float32 numpy logits [M, vocab] (None on tensor-parallel ranks other than 0)."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Fill parameters from (HF name, array) pairs; every parameter must be covered."""
        load_named_weights(self, self._checkpoint_parts(weights), self.stacked_params)

    def _checkpoint_parts(self, weights) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors, with ``c_attn`` (its weight, bias, and a W8A8 checkpoint's
        scale rows) cut into its q, k and v parts, and without the causal-mask buffers old
        checkpoints carry and a tied LM head; a quantized LM head is refused by name."""
        c = self.config
        for name, w in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")) and ".c_attn." not in name:
                continue
            if name.startswith("lm_head."):
                check_float_head(name, w)
                if c.tie_word_embeddings:
                    continue
            if ".c_attn." not in name:
                yield name, w
                continue
            for part, value in zip("qkv", split_packed(name, w, self._unpack_qkv)):
                yield name.replace(".c_attn.", f".c_attn.{part}."), value

    def _unpack_qkv(self, w: np.ndarray):
        """c_attn's rows (and their scales) -> q, k, v rows."""
        c = self.config
        d, heads, kv_heads = c.head_dim, c.num_heads, c.num_kv_heads
        if not c.multi_query:       # [heads, (q, k, v), head_dim] -> [(q, k, v), heads, ...]
            w = w.reshape(heads, 3, d, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
        return np.split(w, [heads * d, (heads + kv_heads) * d])
