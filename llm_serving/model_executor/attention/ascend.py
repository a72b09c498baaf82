"""Ascend attention backend: MindSpore's fused ops.

NEVER RUN ON AN NPU: these machines have none. Its calls are checked on CPU against numpy
stand-ins written from MindSpore's op contracts (tests/ascend_ops.py, tests/test_ascend.py;
docs/ascend.md says what that does and does not prove). It is kept thin on purpose:
- ReshapeAndCache writes the step's keys and values into the paged cache
  ([num_blocks, block_size, KVH, D] float16, the layout MindSpore documents and mindformers /
  vllm-mindspore allocate on Atlas A2);
- FlashAttentionScore (TND layout, cumulative per-sequence lengths, right-down causal mask)
  serves new prefills, whose whole context is in the step's own k/v;
- PagedAttention serves every row that attends to cached context: decodes, and prefill chunks
  continuing from cached tokens, the latter expanded to one row per token with that token's
  causal context length and its sequence's block table.

The model computes in float32; the fused ops take float16 only, so q/k/v are cast on the way
in and the result is cast back.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from llm_serving.errors import ConfigError
from llm_serving.model_executor.attention.backend import AttentionBackend, AttentionMetadata

# The fused ops' data type (KV cache and attention inputs).
KV_DTYPE = ms.float16


class AscendAttentionBackend(AttentionBackend):
    name = "ascend"

    def __init__(self, num_heads, num_kv_heads, head_dim, kv_cache_dtype="auto",
                 alibi_slopes=None):
        # KV is float16, the dtype of the PagedAttention kernel (EngineArgs refuses others).
        if kv_cache_dtype not in ("auto", "float16"):
            raise ValueError(f"the Ascend backend stores KV as float16, not {kv_cache_dtype}")
        if alibi_slopes is not None:
            # FlashAttentionScore takes ALiBi as its pse input and PagedAttention as an
            # alibi_mask; neither is wired here, nor checkable without an NPU.
            raise ConfigError("model", "ALiBi attention (Baichuan2-13B) runs on the CPU backend "
                              "only; the Ascend backend does not pass MindSpore's fused ops "
                              "their ALiBi input")
        super().__init__(num_heads, num_kv_heads, head_dim, kv_cache_dtype)
        from mindspore.ops.operations.nn_ops import (FlashAttentionScore, PagedAttention,
                                                     ReshapeAndCache)
        self.reshape_and_cache = ReshapeAndCache()
        self.flash_attention = FlashAttentionScore(
            head_num=num_heads, scale_value=self.scale, next_tokens=0, input_layout="TND",
            sparse_mode=3)
        self.paged_attention = PagedAttention(num_heads, self.scale, num_kv_heads)
        # sparse_mode=3 takes the compressed causal mask: 2048 x 2048, 1 = masked out.
        self.causal_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))

    def allocate_kv_cache(self, num_blocks, block_size, kv_cache_dtype=None):
        # float16 whatever is asked: EngineArgs resolves every layer's KV to it here
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return (ms.Parameter(ops.zeros(shape, KV_DTYPE), requires_grad=False),
                ms.Parameter(ops.zeros(shape, KV_DTYPE), requires_grad=False))

    # Block moves go through host numpy arrays (one transfer per layer and direction). The
    # host pool keeps the device layout [num_blocks, block_size, KVH, D] in float16.
    def allocate_host_cache(self, num_blocks, block_size, kv_cache_dtype=None):
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return np.zeros(shape, np.float16), np.zeros(shape, np.float16)

    def swap_out(self, kv_cache, host_cache, pairs):
        idx = Tensor(pairs[:, 0])
        for dev, host in zip(kv_cache, host_cache):
            host[pairs[:, 1]] = ops.gather(dev, idx, 0).asnumpy()

    def swap_in(self, host_cache, kv_cache, pairs):
        idx = Tensor(pairs[:, 1])
        for host, dev in zip(host_cache, kv_cache):
            ops.scatter_update(dev, idx, Tensor(host[pairs[:, 0]]))

    def copy_blocks(self, kv_cache, pairs):
        src, dst = Tensor(pairs[:, 0]), Tensor(pairs[:, 1])
        for cache in kv_cache:
            ops.scatter_update(cache, dst, ops.gather(cache, src, 0))

    def prepare(self, md: AttentionMetadata) -> AttentionMetadata:
        q_lens = md.query_lens
        ctx_before = md.seq_lens - q_lens
        fresh = ctx_before == 0
        rows = np.repeat(np.arange(md.num_seqs), q_lens)
        fresh_rows = np.flatnonzero(fresh[rows])
        cached_rows = np.flatnonzero(~fresh[rows])
        # Per-token causal context for rows that read the cache.
        starts = md.query_start_loc[:-1][rows]
        token_ctx = (ctx_before[rows] + np.arange(len(rows)) - starts + 1).astype(np.int32)
        # actual_seq_qlen/kvlen: cumulative ends of each new prefill's rows, as a tuple of
        # ints (the documented type; a new prefill's keys are its queries).
        fresh_cu = tuple(int(x) for x in np.cumsum(q_lens[fresh]))
        md.prepared = {
            "slots": Tensor(np.ascontiguousarray(md.slot_mapping, np.int32)),
            "fresh_rows": Tensor(fresh_rows.astype(np.int32)),
            "fresh_cu": fresh_cu,
            "cached_rows": Tensor(cached_rows.astype(np.int32)),
            "cached_tables": Tensor(np.ascontiguousarray(
                md.block_tables[rows[cached_rows]], np.int32)),
            "cached_ctx": Tensor(token_ctx[cached_rows]),
            "has_fresh": len(fresh_rows) > 0,
            "has_cached": len(cached_rows) > 0,
        }
        return md

    def forward(self, q, k, v, kv_cache, md):
        p = md.prepared
        key_cache, value_cache = kv_cache
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        out_dtype = q.dtype
        q = q.astype(KV_DTYPE)
        k = k.astype(KV_DTYPE).reshape(-1, kvh, d)
        v = v.astype(KV_DTYPE).reshape(-1, kvh, d)
        self.reshape_and_cache(k, v, key_cache, value_cache, p["slots"])
        out = ops.zeros_like(q)
        if p["has_fresh"]:
            idx = p["fresh_rows"]
            qf = ops.gather(q, idx, 0).reshape(-1, h, d)
            kf = ops.gather(k, idx, 0)
            vf = ops.gather(v, idx, 0)
            res = self.flash_attention(qf, kf, vf, None, None, None, self.causal_mask, None,
                                       p["fresh_cu"], p["fresh_cu"])[3]
            out = ops.scatter_update(out, idx, res.reshape(-1, h * d))
        if p["has_cached"]:
            idx = p["cached_rows"]
            qc = ops.gather(q, idx, 0).reshape(-1, 1, h * d)
            res = self.paged_attention(qc, key_cache, value_cache, p["cached_tables"],
                                       p["cached_ctx"])
            out = ops.scatter_update(out, idx, res.reshape(-1, h * d))
        return out.astype(out_dtype)
