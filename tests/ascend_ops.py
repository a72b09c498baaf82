"""Numpy stand-ins for the Ascend-only fused ops the Ascend attention backend calls.

Test-only. Each has the primitive's constructor and call signature, takes and returns
MindSpore tensors, and refuses what the op's contract refuses (dtype, rank, layout, lengths),
so that the backend's calls are checked on CPU the way the NPU would check them. The contract
is MindSpore 2.10.0's op documentation (the docstrings installed with the wheel:
``mindspore/ops/auto_generate/gen_ops_def.py`` ``reshape_and_cache``, ``gen_ops_prim.py``
``FlashAttentionScore`` and ``PagedAttention``); argument order and tensor shapes were checked
against projects that call these ops on Atlas A2 NPUs, cited at each class:

- vllm-mindspore, github.com/mindspore-ai/vllm-mindspore at a7b56a427666 (2026-04-20);
- mindformers, github.com/mindspore-lab/mindformers at fd4deebc1606 (2025-07-24).

Everything is computed in float32 and rounded to the op's float16 output.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor

FP16 = (ms.float16,)


class ContractError(ValueError):
    """A call the real op would refuse (or silently mis-compute)."""


def _check(cond, op, msg):
    if not cond:
        raise ContractError(f"{op}: {msg}")


def _is_int_sequence(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in x)


class ReshapeAndCache:
    """``ReshapeAndCache()(key, value, key_cache, value_cache, slot_mapping)``: writes token t's
    key and value into slot ``slot_mapping[t]`` (block ``s // block_size``, offset
    ``s % block_size``) of the caches, in place; returns ``key``.

    Contract (MindSpore 2.10 ``reshape_and_cache`` doc): key/value float16
    ``(num_tokens, num_head, head_dim)``; caches float16 ``(num_blocks, block_size, num_head,
    head_dim)``; slot_mapping int32 ``(num_tokens,)``.
    Checked against: vllm-mindspore ``vllm_mindspore/v1/attention/layer.py:110-111`` (call
    order key, value, key_cache, value_cache, slot_mapping; its key is the flattened
    ``[num_tokens, kv_hidden]`` form) and ``:152-155`` (cache ``[num_block, block_size,
    kv_heads, head_size]``); mindformers ``mindformers/modules/paged_attention_mgr.py:62`` (same
    call) and ``mindformers/modules/infer_attention.py:287-290`` (the 4-D cache on Atlas A2;
    the 3-D ``[..., kv_heads * head_dim]`` cache only where ``need_nz()``, i.e. 310P).
    """

    calls: list = []

    def __init__(self):
        pass

    def __call__(self, key, value, key_cache, value_cache, slot_mapping):
        op = "ReshapeAndCache"
        _check(key_cache.ndim == 4, op, f"key_cache must be 4-D (num_blocks, block_size, "
               f"num_head, head_dim), got shape {tuple(key_cache.shape)}")
        _check(value_cache.shape == key_cache.shape, op, "key and value caches differ in shape")
        nb, bs, n, d = key_cache.shape
        _check(slot_mapping.dtype == ms.int32 and slot_mapping.ndim == 1, op,
               f"slot_mapping must be 1-D int32, got {slot_mapping.dtype} {slot_mapping.shape}")
        t = slot_mapping.shape[0]
        for name, x, cache in (("key", key, key_cache), ("value", value, value_cache)):
            _check(x.dtype in FP16 and cache.dtype == x.dtype, op,
                   f"{name} ({x.dtype}) and its cache ({cache.dtype}) must both be float16")
            _check(x.shape[-1] in (d, n * d) and int(np.prod(x.shape)) == t * n * d, op,
                   f"{name} of shape {tuple(x.shape)} is not {t} tokens of {n} heads x {d}")
        slots = slot_mapping.asnumpy()
        _check(slots.min(initial=0) >= 0 and slots.max(initial=0) < nb * bs, op,
               f"slot out of range [0, {nb * bs})")
        _check(len(np.unique(slots)) == t, op, "two tokens write the same slot")
        type(self).calls.append(t)
        # On CPU, asnumpy() views the Parameter's memory: this is the in-place write.
        for x, cache in ((key, key_cache), (value, value_cache)):
            cache.asnumpy().reshape(nb * bs, n, d)[slots] = x.asnumpy().reshape(t, n, d)
        return key


def _softmax_attend(q, k, v, mask, scale):
    """q [S1, N1, D], k/v [S2, N2, D] float32, mask [S1, S2] True = keep -> [S1, N1, D]."""
    rep = q.shape[1] // k.shape[1]
    k = np.repeat(k, rep, axis=1)            # query head h reads kv head h // rep
    v = np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


class FlashAttentionScore:
    """``FlashAttentionScore(head_num, keep_prob, scale_value, pre_tokens, next_tokens,
    inner_precise, input_layout, sparse_mode)(query, key, value, real_shift, drop_mask,
    padding_mask, attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen)`` ->
    ``(softmax_max, softmax_sum, softmax_out, attention_out)``.

    Only what the backend uses is implemented: ``input_layout="TND"`` with ``sparse_mode=3``
    (right-down causal: query i of a sequence with S1 queries and S2 keys sees keys
    ``j <= i + S2 - S1``), no dropout, shift, padding mask or prefix.
    Contract (MindSpore 2.10 ``FlashAttentionScore`` doc): query ``(T1, N1, D)``, key/value
    ``(T2, N2, D)`` float16, N1 % N2 == 0, D a multiple of 16 up to 512;
    ``actual_seq_qlen``/``actual_seq_kvlen`` are List/Tuple[int64] of *cumulative* lengths
    ending at T1/T2, with no empty key sequence and S1 <= S2 under sparse_mode 3; attn_mask
    the compressed ``(2048, 2048)`` uint8/bool mask (1 = discard); next_tokens 0;
    attention_out (index 3) has the query's shape and dtype.
    Checked against: mindformers
    ``mindformers/parallel_core/inference/transformer/flash_attention.py:96-104`` (constructor
    keywords) and ``:130-134`` (positional order, ``_, _, _, context = ...``);
    ``mindformers/parallel_core/training_graph/transformer/flash_attention.py:252-262`` (the
    TND call with actual_seq_qlen/kvlen); vllm-mindspore
    ``vllm_mindspore/v1/attention/layer.py:138-141`` (same order, output index 3).
    """

    calls: list = []

    def __init__(self, head_num, keep_prob=1.0, scale_value=1.0, pre_tokens=2147483647,
                 next_tokens=2147483647, inner_precise=0, input_layout="BSH", sparse_mode=0):
        op = "FlashAttentionScore"
        if input_layout != "TND" or sparse_mode != 3:
            raise NotImplementedError(f"{op} stand-in: only input_layout='TND' with "
                                      f"sparse_mode=3, got {input_layout!r}, {sparse_mode}")
        _check(keep_prob == 1.0, op, "dropout is not modelled")
        _check(next_tokens == 0, op, "TND needs next_tokens=0")
        self.head_num, self.scale, self.pre_tokens = head_num, scale_value, pre_tokens

    def __call__(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None,
                 attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        op = "FlashAttentionScore"
        _check(real_shift is None and drop_mask is None and padding_mask is None
               and prefix is None, op, "real_shift/drop_mask/padding_mask/prefix not modelled")
        _check(query.ndim == 3 and key.ndim == 3 and value.shape == key.shape, op,
               f"TND wants query (T1, N1, D), key = value (T2, N2, D); got "
               f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        t1, n1, d = query.shape
        t2, n2, dk = key.shape
        _check(all(x.dtype in FP16 for x in (query, key, value)), op,
               f"query/key/value must be float16, got {query.dtype}/{key.dtype}/{value.dtype}")
        _check(n1 == self.head_num, op, f"query has {n1} heads, head_num is {self.head_num}")
        _check(dk == d and n1 % n2 == 0, op, f"key heads {n2} x {dk} do not fit {n1} x {d}")
        _check(d % 16 == 0 and d <= 512, op, f"head dim {d} must be a multiple of 16, <= 512")
        _check(attn_mask is not None and tuple(attn_mask.shape) == (2048, 2048)
               and attn_mask.dtype in (ms.uint8, ms.bool_), op,
               "sparse_mode=3 needs the (2048, 2048) uint8/bool compressed mask")
        mask = attn_mask.asnumpy().astype(bool)
        _check(np.array_equal(mask, np.triu(np.ones((2048, 2048), bool), 1)), op,
               "the compressed causal mask must be 1 strictly above the diagonal")
        for name, cu, total in (("actual_seq_qlen", actual_seq_qlen, t1),
                                ("actual_seq_kvlen", actual_seq_kvlen, t2)):
            _check(_is_int_sequence(cu), op, f"{name} must be a list/tuple of ints, got "
                   f"{type(cu).__name__}")
            _check(len(cu) >= 1 and len(cu) <= 1024, op, f"{name}: 1 to 1024 sequences")
            _check(all(b >= a for a, b in zip((0,) + tuple(cu), cu)) and cu[-1] == total, op,
                   f"{name} must be cumulative (non-decreasing) and end at {total}, got {cu}")
        _check(len(actual_seq_qlen) == len(actual_seq_kvlen), op, "q and kv batch differ")
        q, k, v = (x.asnumpy().astype(np.float32) for x in (query, key, value))
        out = np.zeros_like(q)
        qb, kb = (0,) + tuple(actual_seq_qlen), (0,) + tuple(actual_seq_kvlen)
        lens = []
        for b in range(len(actual_seq_qlen)):
            s1, s2 = qb[b + 1] - qb[b], kb[b + 1] - kb[b]
            _check(s2 > 0 and s1 <= s2, op, f"sequence {b}: S1={s1}, S2={s2} (need 0 < S1 <= S2)")
            _check(self.pre_tokens >= s1, op, "pre_tokens must be >= max S1")
            keep = np.arange(s2)[None, :] <= np.arange(s1)[:, None] + (s2 - s1)
            out[qb[b]:qb[b + 1]] = _softmax_attend(q[qb[b]:qb[b + 1]], k[kb[b]:kb[b + 1]],
                                                   v[kb[b]:kb[b + 1]], keep, self.scale)
            lens.append(s1)
        type(self).calls.append(lens)
        stats = Tensor(np.zeros((t1, n1, d), np.float32))     # softmax_max/sum: not modelled
        return stats, stats, Tensor(np.zeros((), np.float16)), Tensor(out.astype(np.float16))


class PagedAttention:
    """``PagedAttention(head_num, scale_value, kv_head_num)(query, key_cache, value_cache,
    block_tables, context_lens)``: row b's query attends to the first ``context_lens[b]``
    tokens of the cache, found through ``block_tables[b]``.

    Only the decode form is implemented (one query token per row: no q_seq_lens, attn_mask,
    alibi or quantization). Contract (MindSpore 2.10 ``PagedAttention`` doc): float16 query,
    caches ``(num_blocks, block_size, kv_head_num, head_dim)``, block_tables int32
    ``(batch, max_blocks)``, context_lens int32 ``(batch,)``; the output has the query's shape.
    The doc's query is ``(num_tokens, num_head, head_dim)``; the callers pass
    ``[batch, 1, hidden]``; both are accepted.
    Checked against: vllm-mindspore ``vllm_mindspore/v1/attention/layer.py:84-86``
    (constructor: head_num, scale_value, kv_head_num) and ``:159-161`` (call order; query
    ``[batch_size, 1, hidden_size]``, 4-D caches); mindformers
    ``mindformers/modules/paged_attention_mgr.py:51-53`` and ``:70`` (the five-argument
    decode call).
    """

    calls: list = []

    def __init__(self, head_num, scale_value, kv_head_num, kv_cache_quant_mode="DEFAULT",
                 mask_mode="MASK_DEFAULT", mla_v_dim=0):
        _check(kv_cache_quant_mode == "DEFAULT" and mla_v_dim == 0, "PagedAttention",
               "quantized and MLA caches are not modelled")
        self.head_num, self.scale, self.kv_head_num = head_num, scale_value, kv_head_num

    def __call__(self, query, key_cache, value_cache, block_tables=None, context_lens=None,
                 antiquant_scale=None, antiquant_offset=None, attn_mask=None, q_seq_lens=None,
                 alibi_mask=None):
        op = "PagedAttention"
        _check(antiquant_scale is None and antiquant_offset is None and attn_mask is None
               and q_seq_lens is None and alibi_mask is None, op,
               "only the decode form (one query per row, no mask) is modelled")
        _check(query.dtype in FP16 and key_cache.dtype == query.dtype
               and value_cache.dtype == query.dtype, op,
               f"query and caches must be float16, got {query.dtype}, {key_cache.dtype}")
        _check(key_cache.ndim == 4 and value_cache.shape == key_cache.shape, op,
               f"caches must be (num_blocks, block_size, kv_head_num, head_dim), got "
               f"{tuple(key_cache.shape)}")
        nb, bs, n2, d = key_cache.shape
        _check(n2 == self.kv_head_num and self.head_num % n2 == 0, op,
               f"cache has {n2} kv heads, kv_head_num is {self.kv_head_num}")
        bsz = query.shape[0]
        _check(tuple(query.shape) in ((bsz, 1, self.head_num * d), (bsz, self.head_num, d)),
               op, f"query {tuple(query.shape)} is neither (B, 1, {self.head_num * d}) nor "
               f"(B, {self.head_num}, {d})")
        _check(block_tables.dtype == ms.int32 and block_tables.ndim == 2
               and block_tables.shape[0] == bsz, op,
               f"block_tables must be int32 (B={bsz}, max_blocks), got {block_tables.dtype} "
               f"{tuple(block_tables.shape)}")
        _check(context_lens.dtype == ms.int32 and tuple(context_lens.shape) == (bsz,), op,
               f"context_lens must be int32 (B={bsz},), got {context_lens.dtype} "
               f"{tuple(context_lens.shape)}")
        tables, ctx = block_tables.asnumpy(), context_lens.asnumpy()
        _check(ctx.min(initial=1) >= 1 and ctx.max(initial=0) <= tables.shape[1] * bs, op,
               f"context_lens must be in [1, {tables.shape[1] * bs}]")
        q = query.asnumpy().astype(np.float32).reshape(bsz, self.head_num, d)
        kc, vc = key_cache.asnumpy(), value_cache.asnumpy()
        out = np.zeros_like(q)
        for b in range(bsz):
            used = tables[b, :(ctx[b] + bs - 1) // bs]
            _check(used.min() >= 0 and used.max() < nb, op, f"row {b}: block id out of range")
            k = kc[used].reshape(-1, n2, d)[:ctx[b]].astype(np.float32)
            v = vc[used].reshape(-1, n2, d)[:ctx[b]].astype(np.float32)
            out[b] = _softmax_attend(q[b:b + 1], k, v, np.ones((1, ctx[b]), bool),
                                     self.scale)[0]
        type(self).calls.append(bsz)
        return Tensor(out.reshape(tuple(query.shape)).astype(np.float16))


STANDINS = {"ReshapeAndCache": ReshapeAndCache, "FlashAttentionScore": FlashAttentionScore,
            "PagedAttention": PagedAttention}


def reset_calls() -> None:
    for cls in STANDINS.values():
        cls.calls = []
