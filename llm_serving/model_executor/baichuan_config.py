"""Baichuan's config.json (BaichuanForCausalLM, or BaiChuanForCausalLM for the first
Baichuan-7B; model_type baichuan, loaded by its remote code in transformers): which layout a
checkpoint has, and the file written back.

Baichuan2-7B is a Llama with rotary positions; Baichuan2-13B (and Baichuan-13B) put ALiBi
biases on the attention scores instead. Their config.json files do not say which: the remote
code differs per checkpoint. vLLM's baichuan.py tells them apart by size (hidden_size 4096:
rotary, else ALiBi); the 7B's file also names max_position_embeddings, the 13B's only
model_max_length. Here: 4096 is rotary and 5120 ALiBi, as in vLLM, and another size (a small
test model) is rotary when the file names max_position_embeddings.

Baichuan2's lm_head is a NormHead (rows L2-normalized before the matmul), the first
Baichuan's (Baichuan-7B, Baichuan-13B) a plain one; vLLM tells them apart by the vocabulary,
Baichuan2's 125696 tokens against the first Baichuan's 64000. Here a vocabulary of 64000 is
the first Baichuan's and any other size Baichuan2's (whose NormHead a small test model has).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

BAICHUAN_7B_HIDDEN, BAICHUAN_13B_HIDDEN = 4096, 5120
BAICHUAN1_VOCAB = 64000


def has_norm_head(vocab_size: int) -> bool:
    """Whether a Baichuan checkpoint's lm_head is Baichuan2's NormHead."""
    return vocab_size != BAICHUAN1_VOCAB


def uses_alibi(cfg: Mapping[str, Any], hidden_size: int) -> bool:
    """Whether a Baichuan config.json is the ALiBi layout (Baichuan2-13B's)."""
    if hidden_size in (BAICHUAN_7B_HIDDEN, BAICHUAN_13B_HIDDEN):
        return hidden_size == BAICHUAN_13B_HIDDEN
    return cfg.get("max_position_embeddings") is None


def check_baichuan(cfg: Mapping[str, Any], err) -> None:
    """Refuse what the Baichuan layers do not have (``err(msg)`` makes the exception)."""
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise err(f"BaichuanForCausalLM packs q, k and v of the same size in W_pack: "
                  f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads})")


def baichuan_hf_dict(d: Dict[str, Any], alibi: bool) -> Dict[str, Any]:
    """A Llama-style config dict as Baichuan2's config.json has it (the 13B's, without
    max_position_embeddings and rope_theta, when ``alibi``)."""
    drop = ("num_key_value_heads", "head_dim", "rope_scaling", "attention_bias")
    if alibi:
        drop += ("max_position_embeddings", "rope_theta")
    out = {k: v for k, v in d.items() if k not in drop}
    out["model_max_length"] = d["max_position_embeddings"]
    return out
