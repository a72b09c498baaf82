"""Baichuan2 and the first Baichuan (BaichuanForCausalLM, BaiChuanForCausalLM): the Llama
layers, with the checkpoint's two differences taken at load time.

- ``self_attn.W_pack`` holds q, k and v stacked by rows ([q; k; v], as many heads each), the
  Llama attention's qkv_proj parts in that order;
- Baichuan2's ``lm_head`` is a NormHead (``config.norm_head``): its remote code L2-normalizes
  the rows before the matmul (at the first forward pass, in eval mode), so the rows are
  normalized here once, as loaded; the first Baichuan's is a plain one.

Baichuan2-13B's ALiBi positions are the attention backend's (``config.alibi``), not this file's.
A W8A8 int8 checkpoint's W_pack (one quantized layer, as vLLM's) has its int8 rows and
per-channel ``weight_scale`` rows cut as the float weight is; its quantization_config names the
checkpoint's modules (``self_attn.W_pack``), which ``checkpoint_modules`` gives for our layers.
The NormHead stays float: a quantized lm_head is refused by name (``check_float_head``).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from llm_serving.model_executor.models.llama import LlamaForCausalLM
from llm_serving.model_executor.models.weights import check_float_head, split_packed

_W_PACK = ".self_attn.W_pack."
_QKV = tuple(f".self_attn.{p}_proj" for p in "qkv")


def normalize_rows(weight: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (torch.nn.functional.normalize, eps 1e-12)."""
    w = np.asarray(weight, np.float32)
    norm = np.sqrt(np.einsum("ij,ij->i", w, w, dtype=np.float64)).astype(np.float32)
    return w / np.maximum(norm, np.float32(1e-12))[:, None]


class BaichuanForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_modules(names: list[str]) -> list[str]:
        """The checkpoint's module names of Llama's (q_proj, k_proj, v_proj -> one W_pack)."""
        own = [n[:-len(_QKV[0])] + _W_PACK[:-1] if n.endswith(_QKV) else n for n in names]
        return list(dict.fromkeys(own))

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights):
        """(HF name, array) pairs with W_pack unpacked and the head normalized."""
        for name, loaded in weights:
            if _W_PACK in name:
                for part, rows in zip(("q_proj", "k_proj", "v_proj"),
                                      split_packed(name, loaded,
                                                   lambda t: self._unpack_w_pack(name, t))):
                    yield name.replace("W_pack", part), rows
            elif name.startswith("lm_head."):
                check_float_head(name, loaded)          # (never normalize int8 rows)
                norm = name == "lm_head.weight" and self.config.norm_head
                yield name, normalize_rows(loaded) if norm else loaded
            else:
                yield name, loaded

    def _unpack_w_pack(self, name: str, packed: np.ndarray) -> list:
        q = self.config.q_size
        if packed.shape[0] != q + 2 * self.config.kv_size:
            raise ValueError(f"{name}: checkpoint shape {packed.shape} is not [q; k; v] "
                             f"of {q} rows each")
        return [packed[i * q:(i + 1) * q] for i in range(3)]
