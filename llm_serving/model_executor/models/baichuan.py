"""Baichuan2 and the first Baichuan (BaichuanForCausalLM, BaiChuanForCausalLM): the Llama
layers, with the checkpoint's two differences taken at load time.

- ``self_attn.W_pack`` holds q, k and v stacked by rows ([q; k; v], as many heads each), the
  Llama attention's qkv_proj parts in that order;
- Baichuan2's ``lm_head`` is a NormHead (``config.norm_head``): its remote code L2-normalizes
  the rows before the matmul (at the first forward pass, in eval mode), so the rows are
  normalized here once, as loaded; the first Baichuan's is a plain one.

Baichuan2-13B's ALiBi positions are the attention backend's (``config.alibi``), not this file's.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from llm_serving.model_executor.models.llama import LlamaForCausalLM

_W_PACK = ".self_attn.W_pack."


def normalize_rows(weight: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (torch.nn.functional.normalize, eps 1e-12)."""
    w = np.asarray(weight, np.float32)
    norm = np.sqrt(np.einsum("ij,ij->i", w, w, dtype=np.float64)).astype(np.float32)
    return w / np.maximum(norm, np.float32(1e-12))[:, None]


class BaichuanForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights):
        """(HF name, array) pairs with W_pack unpacked and the head normalized."""
        q = self.config.q_size
        for name, loaded in weights:
            if _W_PACK in name:
                if loaded.shape[0] != q + 2 * self.config.kv_size:
                    raise ValueError(f"{name}: checkpoint shape {loaded.shape} is not [q; k; v] "
                                     f"of {q} rows each")
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    yield (name.replace("W_pack", part), loaded[i * q:(i + 1) * q])
            elif name == "lm_head.weight" and self.config.norm_head:
                yield name, normalize_rows(loaded)
            else:
                yield name, loaded
