"""InternLM2 (InternLM2ForCausalLM: internlm2-chat-7b, internlm2.5, ...): Llama's math under other
weight names, with q, k and v packed in one ``attention.wqkv`` per KV group (for each KV head,
its num_heads / num_kv_heads query heads, then its key, then its value), as transformers'
remote code and vLLM's internlm2.py read it. The model is ``LlamaForCausalLM``; only the names
and the packing differ, so the checkpoint is read as Llama's (tensor parallelism then shards
q, k and v as for Llama). A W8A8 int8 checkpoint's wqkv (one quantized layer, as vLLM's) has
its int8 rows and per-channel ``weight_scale`` rows cut as the float weight is; its
quantization_config names the checkpoint's modules (``attention.wqkv``, ``output``), which
``checkpoint_modules`` gives for our layers.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import numpy as np

from llm_serving.model_executor.models.llama import LlamaForCausalLM
from llm_serving.model_executor.models.weights import check_float_head, split_packed

_GLOBAL_NAMES = {
    "model.tok_embeddings.weight": "model.embed_tokens.weight",
    "model.norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|weight_scale|input_scale"
                       r"|weight_zero_point|input_zero_point)$")
_OWN_NAMES = {llama: own for own, llama in _LAYER_PARTS.items()}
_OWN_NAMES.update(dict.fromkeys(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                "attention.wqkv"))
_MODULE_RE = re.compile(r"^(model\.layers\.\d+\.)(.+)$")


class InternLM2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_modules(names: list[str]) -> list[str]:
        """The checkpoint's module names of Llama's (q_proj, k_proj, v_proj -> one wqkv)."""
        def own(name: str) -> str:
            m = _MODULE_RE.match(name)
            return m.group(1) + _OWN_NAMES[m.group(2)] if m and m.group(2) in _OWN_NAMES else name
        return list(dict.fromkeys(own(n) for n in names))

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights) -> Iterator[tuple[str, np.ndarray]]:
        """(Llama name, array) for each InternLM2 checkpoint tensor; wqkv unpacked."""
        for name, loaded in weights:
            if name.startswith("output."):
                check_float_head(name, loaded)
            if name in _GLOBAL_NAMES:
                yield _GLOBAL_NAMES[name], loaded
                continue
            m = _LAYER_RE.match(name)
            if m is None:
                yield name, loaded          # rotary_emb.inv_freq, or refused by name below
                continue
            layer, part, kind = m.groups()
            prefix = f"model.layers.{layer}."
            if part == "attention.wqkv":
                parts = split_packed(name, loaded, lambda t: self._unpack_qkv(name, t))
                for proj, tensor in zip("qkv", parts):
                    yield f"{prefix}self_attn.{proj}_proj.{kind}", tensor
            elif part in _LAYER_PARTS:
                yield f"{prefix}{_LAYER_PARTS[part]}.{kind}", loaded
            else:
                yield name, loaded

    def _unpack_qkv(self, name: str, packed: np.ndarray):
        """wqkv rows [kv heads, groups + 2, head_dim] -> q, k, v rows in Llama's order."""
        c = self.config
        groups = c.num_heads // c.num_kv_heads
        if packed.shape[0] != c.q_size + 2 * c.kv_size:
            raise ValueError(f"{name}: checkpoint shape {packed.shape} does not match the "
                             f"model's {c.q_size + 2 * c.kv_size} rows of q, k and v")
        rows = packed.reshape(c.num_kv_heads, groups + 2, c.head_dim, *packed.shape[1:])
        rest = packed.shape[1:]
        return (rows[:, :groups].reshape(c.q_size, *rest),
                rows[:, groups].reshape(c.kv_size, *rest),
                rows[:, groups + 1].reshape(c.kv_size, *rest))
