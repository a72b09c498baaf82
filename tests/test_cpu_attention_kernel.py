"""CPU paged-attention kernels against an independent dense NumPy reference."""

import os

import numpy as np
import pytest

from llm_serving.model_executor.attention import kernels as K

RTOL = 1e-5
ATOL = 2e-6


# ---------------------------------------------------------------------------------------------
# Reference and a small paged-cache harness (history kept in plain arrays)


def dense_reference(q, k_hist, v_hist, scale):
    """q [n, H, D] for the last n positions of a sequence whose full K/V are k_hist/v_hist
    [L, KVH, D]. Dense causal softmax attention in float64."""
    n, h, d = q.shape
    L, kvh, _ = k_hist.shape
    g = h // kvh
    out = np.empty((n, h, d), np.float64)
    for i in range(n):
        pos = L - n + i
        for head in range(h):
            kk = k_hist[: pos + 1, head // g].astype(np.float64)
            vv = v_hist[: pos + 1, head // g].astype(np.float64)
            s = kk @ q[i, head].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ vv
    return out


def bf16_round(x):
    """float32 -> nearest bfloat16 (ties to even) -> float32, by torch (independent of ours)."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def f16_round(x):
    """float32 -> nearest float16 (ties to even; beyond +-65504: +-65504, as our caches store
    it) -> float32, by NumPy (independent of ours). Clipped in float32: a float64 clip would
    round twice."""
    x = np.ascontiguousarray(x, np.float32)
    return np.clip(x, np.float32(-65504), np.float32(65504)).astype(np.float16).astype(np.float32)


def f8_round(kind, largest):
    """float32 -> nearest FP8 (ties to even; beyond the largest finite: it, as our caches store
    it) -> float32, by torch (independent of ours)."""
    def rnd(x):
        import torch
        x = np.clip(np.ascontiguousarray(x, np.float32), np.float32(-largest),
                    np.float32(largest))
        return torch.from_numpy(x).to(getattr(torch, kind)).float().numpy()
    return rnd


STORED = {"float32": lambda x: x, "bfloat16": bf16_round, "float16": f16_round,
          "fp8_e4m3": f8_round("float8_e4m3fn", 448), "fp8_e5m2": f8_round("float8_e5m2", 57344)}
NARROW = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]


def widen(cache):
    """A cache's values as float32 (bf16 caches hold uint16 bits)."""
    if cache.dtype == np.uint16:
        return (cache.astype(np.uint32) << 16).view(np.float32)
    return cache.astype(np.float32)


class PagedHarness:
    def __init__(self, num_blocks, block_size, h, kvh, d, max_blocks_per_seq, seed=0,
                 cache_dtype="float32"):
        self.rng = np.random.default_rng(seed)
        self.bs, self.h, self.kvh, self.d = block_size, h, kvh, d
        self.max_blocks = max_blocks_per_seq
        # NaN-filled so that reading an unwritten slot shows up in the result
        shape = (num_blocks, block_size, kvh, d)
        self.cache_dtype = cache_dtype
        nan = np.uint16(0x7FC0) if cache_dtype == "bfloat16" else np.nan
        self.k_cache = np.full(shape, nan, K.CACHE_DTYPES[cache_dtype])
        self.v_cache = np.full(shape, nan, K.CACHE_DTYPES[cache_dtype])
        self.free = list(self.rng.permutation(num_blocks))  # shuffled, non-contiguous ids
        self.blocks = {}
        self.k_hist = {}
        self.v_hist = {}
        self.scale = 1.0 / np.sqrt(d)

    def slot(self, sid, pos):
        blocks = self.blocks.setdefault(sid, [])
        while len(blocks) <= pos // self.bs:
            blocks.append(int(self.free.pop()))
        return blocks[pos // self.bs] * self.bs + pos % self.bs

    def make_step(self, work, pad_rows=0):
        """work: list of (seq_id, n_new). Returns the kernel inputs (numpy)."""
        qs, ks, vs, slots, qsl, seq_lens = [], [], [], [], [0], []
        for sid, n in work:
            L0 = len(self.k_hist.get(sid, ()))
            q = self.rng.standard_normal((n, self.h, self.d)).astype(np.float32)
            k = self.rng.standard_normal((n, self.kvh, self.d)).astype(np.float32)
            v = self.rng.standard_normal((n, self.kvh, self.d)).astype(np.float32)
            qs.append(q), ks.append(k), vs.append(v)
            slots += [self.slot(sid, L0 + i) for i in range(n)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(L0 + n)
        for _ in range(pad_rows):
            qs.append(self.rng.standard_normal((1, self.h, self.d)).astype(np.float32))
            ks.append(self.rng.standard_normal((1, self.kvh, self.d)).astype(np.float32))
            vs.append(self.rng.standard_normal((1, self.kvh, self.d)).astype(np.float32))
            slots.append(-1)
        bt = np.zeros((len(work), self.max_blocks), np.int32)
        for i, (sid, _) in enumerate(work):
            b = self.blocks[sid]
            bt[i, : len(b)] = b
        return dict(
            query=np.concatenate(qs), key=np.concatenate(ks), value=np.concatenate(vs),
            slot_mapping=np.array(slots, np.int32), block_tables=bt,
            query_start_loc=np.array(qsl, np.int32), seq_lens=np.array(seq_lens, np.int32))

    def commit(self, work, inp):
        """Append this step's K/V to the history and return the per-row reference output."""
        ref = np.zeros(inp["query"].shape, np.float64)
        qsl = inp["query_start_loc"]
        stored = STORED[self.cache_dtype]   # what the cache holds
        for i, (sid, n) in enumerate(work):
            a, b = qsl[i], qsl[i + 1]
            inp = dict(inp, key=stored(inp["key"]), value=stored(inp["value"]))
            self.k_hist[sid] = np.concatenate([self.k_hist.get(sid, np.zeros((0, self.kvh, self.d), np.float32)), inp["key"][a:b]])
            self.v_hist[sid] = np.concatenate([self.v_hist.get(sid, np.zeros((0, self.kvh, self.d), np.float32)), inp["value"][a:b]])
            ref[a:b] = dense_reference(inp["query"][a:b], self.k_hist[sid], self.v_hist[sid], self.scale)
        return ref

    def run(self, work, fused=True, pad_rows=0):
        inp = self.make_step(work, pad_rows)
        ref = self.commit(work, inp)
        if fused:
            out = K.attention_fused(inp["query"], inp["key"], inp["value"], self.k_cache,
                                    self.v_cache, inp["slot_mapping"], inp["block_tables"],
                                    inp["query_start_loc"], inp["seq_lens"], self.scale)
        else:
            K.reshape_and_cache(inp["key"], inp["value"], self.k_cache, self.v_cache,
                                inp["slot_mapping"])
            out = K.paged_attention(inp["query"], self.k_cache, self.v_cache, inp["block_tables"],
                                    inp["query_start_loc"], inp["seq_lens"], self.scale)
        return inp, out, ref

    def check_cache(self):
        for sid, hist in self.k_hist.items():
            for pos in range(len(hist)):
                s = self.slot(sid, pos)
                b, o = divmod(s, self.bs)
                np.testing.assert_array_equal(widen(self.k_cache[b, o]), hist[pos])
                np.testing.assert_array_equal(widen(self.v_cache[b, o]), self.v_hist[sid][pos])


def assert_close(out, ref):
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


MIXED_STEPS = [
    # fresh prefills of several lengths; seq 3 is the first chunk of a chunked prefill
    [(0, 37), (1, 20), (2, 5), (3, 70)],
    # decodes, the second chunk of seq 3, and a fresh prefill in the same batch
    [(0, 1), (1, 1), (2, 1), (3, 50), (4, 33)],
    # decodes of different lengths plus a third chunk
    [(4, 1), (0, 1), (3, 17), (2, 1), (1, 1)],
    [(3, 1), (4, 1), (0, 1), (1, 1), (2, 1), (5, 1)],
]


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("h,kvh", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa"])
def test_mixed_ragged_batches(block_size, h, kvh):
    d = 64
    hs = PagedHarness(num_blocks=(400 // block_size + 8) * 2, block_size=block_size, h=h,
                      kvh=kvh, d=d, max_blocks_per_seq=200 // block_size + 2,
                      seed=block_size * 7 + h)
    for i, work in enumerate(MIXED_STEPS):
        inp, out, ref = hs.run(work, fused=(i % 2 == 0))
        assert out.shape == inp["query"].shape
        assert_close(out, ref)
    hs.check_cache()


@pytest.mark.parametrize("cache_dtype", NARROW)
@pytest.mark.parametrize("d", [8, 40, 64, 128, 160, 256])
@pytest.mark.parametrize("block_size", [1, 16])
def test_narrow_caches(block_size, d, cache_dtype):
    """A bfloat16, float16 or FP8 cache holds each K/V value rounded to nearest even (bits as
    torch, or NumPy, rounds them) and attention over it equals float64 attention over those
    rounded values, to the float32 tolerance: only the storage loses precision, not the
    arithmetic."""
    hs = PagedHarness(num_blocks=(400 // block_size + 8) * 2, block_size=block_size, h=8,
                      kvh=2, d=d, max_blocks_per_seq=200 // block_size + 2, seed=d + block_size,
                      cache_dtype=cache_dtype)
    for i, work in enumerate(MIXED_STEPS):
        inp, out, ref = hs.run(work, fused=(i % 2 == 0))
        assert_close(out, ref)
    hs.check_cache()


def test_bf16_cache_rounds_ties_to_even_and_keeps_specials():
    k = np.array([[1.0, 1.00390625, 1.01171875, -2.0078125, 3.0e38, np.inf, -np.inf, 1e-40]],
                 np.float32)       # exact, tie to even (down), tie to even (up), ..., denormal
    hs = PagedHarness(num_blocks=2, block_size=4, h=1, kvh=1, d=k.shape[1], max_blocks_per_seq=1,
                      cache_dtype="bfloat16")
    K.reshape_and_cache(k, k, hs.k_cache, hs.v_cache, np.array([5], np.int32))
    np.testing.assert_array_equal(widen(hs.k_cache[1, 1, 0]), bf16_round(k)[0])
    assert widen(hs.k_cache[1, 1, 0])[1] == 1.0 and widen(hs.k_cache[1, 1, 0])[2] == 1.015625
    nan = np.array([[np.nan] * k.shape[1]], np.float32)
    K.reshape_and_cache(nan, nan, hs.k_cache, hs.v_cache, np.array([6], np.int32))
    assert np.isnan(widen(hs.k_cache[1, 2, 0])).all()


F16_EDGES = np.array([[1.0, 1 + 2**-11, 1 + 3 * 2**-11, -2 - 2**-10, 65504, 65519, 65520, 1e6,
                        -1e6, np.inf, -np.inf, 2**-24, 3 * 2**-25, 2**-25, 5 * 2**-26, 1e-5,
                        -0.0, 1e-40, 6.1e-5]], np.float32)
# exact, tie to even (down), tie to even (up), a negative tie, the largest half, rounds to it,
# rounds past it (saturates), far past, infinities (saturate), the smallest subnormal, subnormal
# ties (up to even, down to zero), just above a tie, a subnormal, -0, a float32 denormal, just
# below the smallest normal half


@pytest.mark.parametrize("lib_flags", [(), ("-mno-f16c",), ("-DLLS_FORCE_SCALAR",)],
                         ids=["native", "no-f16c", "scalar"])
def test_f16_cache_rounds_ties_to_even_saturates_and_keeps_nan(monkeypatch, lib_flags):
    """Every build stores float16 as NumPy rounds it, to nearest even, and a value beyond the
    range (infinities too) as +-65504: F16C's conversions, and the portable C++ one that a
    build without F16C (a CPU other than x86) runs, over edge cases and 200 k random values of
    every magnitude from subnormal to overflow. A NaN stays a NaN."""
    monkeypatch.setattr(K, "_default_lib", K.load_library(list(lib_flags)))
    rng = np.random.default_rng(7)
    rand = (rng.standard_normal((3200, 64))
            * np.exp(rng.uniform(-25, 12, (3200, 64)))).astype(np.float32)
    for x in (F16_EDGES, rand):
        t, d = x.shape
        k = np.full((t // 4 + 1, 4, 1, d), np.nan, np.float16)
        v = k.copy()
        K.reshape_and_cache(x, -x, k, v, np.arange(t, dtype=np.int32))
        got_k, got_v = k.reshape(-1, d)[:t], v.reshape(-1, d)[:t]
        np.testing.assert_array_equal(got_k.view(np.uint16),
                                      f16_round(x).astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(got_v.view(np.uint16),
                                      f16_round(-x).astype(np.float16).view(np.uint16))
    nan = np.full((1, 8), np.nan, np.float32)
    k = np.zeros((1, 4, 1, 8), np.float16)
    K.reshape_and_cache(nan, nan, k, k.copy(), np.array([2], np.int32))
    assert np.isnan(k[0, 2, 0]).all() and not np.isnan(k[0, :2]).any()


F8_EDGES = np.array([[1.0, 1.0625, 1.1875, -2.125, 448, 463.9, 464, 1e6, 57344, 61439, 61440,
                       -np.inf, np.inf, 2**-9, 3 * 2**-11, 2**-10, 5 * 2**-11, 2**-16,
                       3 * 2**-18, 2**-17, 0.0136, 0.0156, -0.0, 1e-40, 1e-3]], np.float32)
# exact, E4M3 ties to even (down, up), a negative tie, E4M3's largest, rounds to it, rounds past
# it (saturates), far past, E5M2's largest, rounds to it, rounds past it, infinities (saturate),
# E4M3's smallest subnormal and subnormal ties (up to even, down to zero, up), E5M2's smallest
# subnormal and its ties, just below and at E4M3's smallest normal, -0, a float32 denormal


@pytest.mark.parametrize("lib_flags", [(), ("-mno-avx512f",), ("-DLLS_FORCE_SCALAR",)],
                         ids=["native", "avx2-build", "scalar"])
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_rounds_ties_to_even_saturates_keeps_nan_and_reads_back(monkeypatch, kind,
                                                                          lib_flags):
    """Every build stores an FP8 value as torch rounds it, to nearest even, and a value beyond
    the range (infinities too) as the largest finite one, over edge cases and 200 k random
    values of every magnitude from below the subnormals to overflow; a NaN stays a NaN. Each
    build's attention reads the stored values back exactly: with one context position, the
    output is its V row."""
    monkeypatch.setattr(K, "_default_lib", K.load_library(list(lib_flags)))
    rng = np.random.default_rng(8)
    rand = (rng.standard_normal((3200, 64))
            * np.exp(rng.uniform(-14, 12, (3200, 64)))).astype(np.float32)
    for x in (F8_EDGES, rand):
        t, d = x.shape
        k = np.full((t // 4 + 1, 4, 1, d), np.nan, K.CACHE_DTYPES[kind])
        v = k.copy()
        K.reshape_and_cache(x, -x, k, v, np.arange(t, dtype=np.int32))
        got_k, got_v = k.reshape(-1, d)[:t], v.reshape(-1, d)[:t]
        np.testing.assert_array_equal(got_k.astype(np.float32), STORED[kind](x))
        np.testing.assert_array_equal(got_v.astype(np.float32), STORED[kind](-x))
        np.testing.assert_array_equal(np.signbit(got_v.astype(np.float32)), np.signbit(-x))
    # read back: row r attends to its own position only (a one-token context), giving V
    rows = 64
    raw = (rng.standard_normal((rows, 32))
           * np.exp(rng.uniform(-12, 8, (rows, 32)))).astype(np.float32)
    raw[0, :3] = [2**-9, -(2**-16), 0.0]                      # subnormals of both kinds, zero
    x = STORED[kind](raw)
    k = np.zeros((rows, 1, 1, 32), K.CACHE_DTYPES[kind])
    v = k.copy()
    K.reshape_and_cache(x, x, k, v, np.arange(rows, dtype=np.int32))
    out = K.paged_attention(np.zeros((rows, 32), np.float32), k, v,
                            np.arange(rows, dtype=np.int32).reshape(rows, 1),
                            np.arange(rows + 1, dtype=np.int32), np.ones(rows, np.int32), 1.0)
    np.testing.assert_array_equal(out, x)
    nan = np.full((1, 8), np.nan, np.float32)
    k = np.zeros((1, 4, 1, 8), K.CACHE_DTYPES[kind])
    K.reshape_and_cache(nan, nan, k, k.copy(), np.array([2], np.int32))
    assert np.isnan(k[0, 2, 0].astype(np.float32)).all()
    assert not np.isnan(k[0, :2].astype(np.float32)).any()
    out = K.paged_attention(np.zeros((1, 8), np.float32), k, k.copy(),
                            np.zeros((1, 1), np.int32), np.array([0, 1], np.int32),
                            np.array([3], np.int32), 1.0)
    assert np.isnan(out).all()                  # a NaN read back is a NaN


def test_cache_dtype_mismatch_is_refused():
    k = np.zeros((2, 4, 1, 8), np.float32)
    with pytest.raises(K.KernelArgumentError, match="differ"):
        K.reshape_and_cache(np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32), k,
                            k.astype(np.uint16), np.array([0], np.int32))


@pytest.mark.parametrize("d", [8, 40, 128, 160, 256])
def test_head_dims(d):
    hs = PagedHarness(num_blocks=64, block_size=16, h=4, kvh=2, d=d, max_blocks_per_seq=16, seed=d)
    for work in MIXED_STEPS[:3]:
        _, out, ref = hs.run(work)
        assert_close(out, ref)


def test_chunked_prefill_matches_one_shot():
    d, h, kvh, bs = 64, 8, 2, 16
    a = PagedHarness(num_blocks=64, block_size=bs, h=h, kvh=kvh, d=d, max_blocks_per_seq=16, seed=3)
    b = PagedHarness(num_blocks=64, block_size=bs, h=h, kvh=kvh, d=d, max_blocks_per_seq=16, seed=4)
    one = a.make_step([(0, 150)])
    a.commit([(0, 150)], one)
    out_one = K.attention_fused(one["query"], one["key"], one["value"], a.k_cache, a.v_cache,
                                one["slot_mapping"], one["block_tables"], one["query_start_loc"],
                                one["seq_lens"], a.scale)
    # same tokens, two chunks (61 + 89), in another cache with other block ids
    outs = []
    for lo, hi in ((0, 61), (61, 150)):
        slots = np.array([b.slot(0, p) for p in range(lo, hi)], np.int32)
        bt = np.zeros((1, 16), np.int32)
        bt[0, : len(b.blocks[0])] = b.blocks[0]
        outs.append(K.attention_fused(
            one["query"][lo:hi], one["key"][lo:hi], one["value"][lo:hi], b.k_cache, b.v_cache,
            slots, bt, np.array([0, hi - lo], np.int32), np.array([hi], np.int32), a.scale))
    out_chunked = np.concatenate(outs)
    ref = dense_reference(one["query"], one["key"], one["value"], a.scale)
    assert_close(out_one, ref)
    assert_close(out_chunked, ref)
    np.testing.assert_allclose(out_chunked, out_one, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("lib_flags", [(), ("-mno-avx512f",)], ids=["avx512", "avx2-build"])
@pytest.mark.parametrize("cache_dtype", ["float32", *NARROW])
@pytest.mark.parametrize("h,kvh,d,bs", [(12, 12, 64, 16), (8, 2, 36, 16), (6, 1, 160, 1)],
                         ids=["mha-d64", "gqa-d36", "mqa-d160"])
def test_decode_row_equals_the_same_row_in_a_prefill_chunk(monkeypatch, lib_flags, cache_dtype,
                                                           h, kvh, d, bs):
    """Decode rows read the cache position by position, prefill chunks head by head; both sum
    in the same order, so a token's attention output does not depend on whether it was
    computed alone (decode) or inside a chunk (prefill, recompute after preemption): the
    same bits, not just close. Also in the build a CPU without AVX-512 gets (the portable
    path), which must match the float64 reference too."""
    if lib_flags:
        lib = K.load_library(list(lib_flags))
        assert lib.lls_has_avx512() == 0
        monkeypatch.setattr(K, "_default_lib", lib)
    hs = PagedHarness(num_blocks=150 // bs + 2, block_size=bs, h=h, kvh=kvh, d=d,
                      max_blocks_per_seq=150 // bs + 2, seed=d + bs, cache_dtype=cache_dtype)
    step = hs.make_step([(0, 150)])
    hs.commit([(0, 150)], step)
    K.reshape_and_cache(step["key"], step["value"], hs.k_cache, hs.v_cache,
                        step["slot_mapping"])
    bt, q = step["block_tables"], step["query"]
    for n in (1, 37, 150):          # the last n positions as one chunk, and each alone
        chunk = K.paged_attention(q[150 - n:], hs.k_cache, hs.v_cache, bt,
                                  np.array([0, n], np.int32), np.array([150], np.int32), hs.scale)
        ref = dense_reference(q, hs.k_hist[0], hs.v_hist[0], hs.scale)[150 - n:]
        assert_close(chunk.reshape(ref.shape), ref)
        for r in sorted({0, n // 2, n - 1}):
            pos = 150 - n + r
            alone = K.paged_attention(q[pos:pos + 1], hs.k_cache, hs.v_cache, bt,
                                      np.array([0, 1], np.int32),
                                      np.array([pos + 1], np.int32), hs.scale)
            np.testing.assert_array_equal(alone[0], chunk[r])


def alibi_reference(q, k_hist, v_hist, scale, slopes):
    """dense_reference with ALiBi: score + slope[head] * (key position - query position)."""
    n, h, d = q.shape
    L, kvh, _ = k_hist.shape
    out = np.empty((n, h, d), np.float64)
    for i in range(n):
        pos = L - n + i
        for head in range(h):
            kk = k_hist[: pos + 1, head // (h // kvh)].astype(np.float64)
            vv = v_hist[: pos + 1, head // (h // kvh)].astype(np.float64)
            s = kk @ q[i, head].astype(np.float64) * scale
            s += float(slopes[head]) * (np.arange(pos + 1) - pos)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ vv
    return out


@pytest.mark.parametrize("lib_flags", [(), ("-mno-avx512f",), ("-DLLS_FORCE_SCALAR",)],
                         ids=["avx512", "avx2-build", "scalar"])
@pytest.mark.parametrize("h,kvh,cache_dtype", [(6, 6, "float32"), (8, 2, "float32"),
                                               (6, 6, "bfloat16"), (6, 6, "float16")],
                         ids=["mha6", "gqa4", "mha6-bf16", "mha6-f16"])
def test_alibi_in_mixed_ragged_batches_and_split_decodes(monkeypatch, lib_flags, h, kvh,
                                                          cache_dtype):
    """ALiBi slopes (Baichuan2-13B's, 6 heads: not a power of two) in new prefills, prefill
    chunks continuing from the cache, decodes batched, and a lone decode of a context longer
    than a segment (split between threads), fused and not; steep slopes (x 8) so that a bias
    on the wrong key position shows."""
    from llm_serving.model_executor.attention.alibi import alibi_slopes
    monkeypatch.setattr(K, "_default_lib", K.load_library(list(lib_flags)))
    slopes = alibi_slopes(h) * np.float32(8)
    hs = PagedHarness(num_blocks=64, block_size=16, h=h, kvh=kvh, d=40, max_blocks_per_seq=16,
                      seed=h, cache_dtype=cache_dtype)
    for i, work in enumerate(MIXED_STEPS + [[(3, 1)], [(3, 1), (5, 1)], [(5, 40)]]):
        inp = hs.make_step(work)
        hs.commit(work, inp)        # (the history holds K/V as the cache stores them)
        ref = np.concatenate([
            alibi_reference(inp["query"][a:b], hs.k_hist[sid], hs.v_hist[sid], hs.scale,
                            slopes)
            for (sid, _), a, b in zip(work, inp["query_start_loc"][:-1],
                                      inp["query_start_loc"][1:])])
        if i % 2:
            K.reshape_and_cache(inp["key"], inp["value"], hs.k_cache, hs.v_cache,
                                inp["slot_mapping"])
            out = K.paged_attention(inp["query"], hs.k_cache, hs.v_cache, inp["block_tables"],
                                    inp["query_start_loc"], inp["seq_lens"], hs.scale,
                                    alibi_slopes=slopes)
        else:
            out = K.attention_fused(inp["query"], inp["key"], inp["value"], hs.k_cache,
                                    hs.v_cache, inp["slot_mapping"], inp["block_tables"],
                                    inp["query_start_loc"], inp["seq_lens"], hs.scale,
                                    alibi_slopes=slopes)
        assert_close(out, ref)
        if i == 0:                   # without the slopes: plain causal attention
            plain = K.paged_attention(inp["query"], hs.k_cache, hs.v_cache, inp["block_tables"],
                                      inp["query_start_loc"], inp["seq_lens"], hs.scale)
            assert np.abs(plain - ref).max() > 1e-2
    with pytest.raises(K.KernelArgumentError, match="alibi_slopes"):
        K.paged_attention(inp["query"], hs.k_cache, hs.v_cache, inp["block_tables"],
                          inp["query_start_loc"], inp["seq_lens"], hs.scale,
                          alibi_slopes=slopes[:-1])


@pytest.mark.parametrize("lib_flags", [(), ("-mno-avx512f",)], ids=["avx512", "avx2-build"])
def test_alibi_decode_row_equals_the_same_row_in_a_prefill_chunk(monkeypatch, lib_flags):
    from llm_serving.model_executor.attention.alibi import alibi_slopes
    monkeypatch.setattr(K, "_default_lib", K.load_library(list(lib_flags)))
    slopes = alibi_slopes(6)
    hs = PagedHarness(num_blocks=12, block_size=16, h=6, kvh=6, d=64, max_blocks_per_seq=12)
    step = hs.make_step([(0, 150)])
    hs.commit([(0, 150)], step)
    K.reshape_and_cache(step["key"], step["value"], hs.k_cache, hs.v_cache,
                        step["slot_mapping"])
    bt, q = step["block_tables"], step["query"]
    chunk = K.paged_attention(q[100:], hs.k_cache, hs.v_cache, bt, np.array([0, 50], np.int32),
                              np.array([150], np.int32), hs.scale, alibi_slopes=slopes)
    for pos in (100, 129, 149):
        alone = K.paged_attention(q[pos:pos + 1], hs.k_cache, hs.v_cache, bt,
                                  np.array([0, 1], np.int32), np.array([pos + 1], np.int32),
                                  hs.scale, alibi_slopes=slopes)
        np.testing.assert_array_equal(alone[0], chunk[pos - 100])


def test_padding_slots_are_skipped():
    hs = PagedHarness(num_blocks=32, block_size=16, h=4, kvh=4, d=64, max_blocks_per_seq=8, seed=9)
    hs.run([(0, 10), (1, 3)])
    before_k, before_v = hs.k_cache.copy(), hs.v_cache.copy()
    inp, out, ref = hs.run([(0, 1), (1, 1)], pad_rows=3)
    assert_close(out[:2], ref[:2])
    np.testing.assert_array_equal(out[2:], 0.0)  # padding rows are zeroed
    changed = ~np.isclose(hs.k_cache, before_k, equal_nan=True).all(axis=(2, 3))
    assert changed.sum() == 2  # only the two real tokens were written
    hs.check_cache()
    assert np.isnan(hs.v_cache).sum() == np.isnan(before_v).sum() - 2 * 4 * 64


@pytest.mark.parametrize("lib_flags", [(), ("-DLLS_FORCE_SCALAR",)], ids=["avx512", "scalar"])
def test_large_scores_are_stable(monkeypatch, lib_flags):
    # scores of several hundred: exp overflows without the running max; many probabilities
    # underflow to exactly zero
    monkeypatch.setattr(K, "_default_lib", K.load_library(list(lib_flags)))
    hs = PagedHarness(num_blocks=64, block_size=16, h=4, kvh=2, d=64, max_blocks_per_seq=16, seed=8)
    inp = hs.make_step([(0, 40), (1, 90)])
    inp["query"] *= 60.0
    ref = hs.commit([(0, 40), (1, 90)], inp)
    out = K.attention_fused(inp["query"], inp["key"], inp["value"], hs.k_cache, hs.v_cache,
                            inp["slot_mapping"], inp["block_tables"], inp["query_start_loc"],
                            inp["seq_lens"], hs.scale)
    assert np.isfinite(out).all()
    # fp32 scores of magnitude ~500 carry ~1e-4 absolute error, so the softmax does too
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)


def test_strided_rows_from_fused_qkv():
    h, kvh, d = 8, 2, 32
    hs = PagedHarness(num_blocks=32, block_size=4, h=h, kvh=kvh, d=d, max_blocks_per_seq=16, seed=5)
    inp = hs.make_step([(0, 9), (1, 4)])
    ref = hs.commit([(0, 9), (1, 4)], inp)
    T = inp["query"].shape[0]
    qkv = np.concatenate([inp["query"].reshape(T, -1), inp["key"].reshape(T, -1),
                          inp["value"].reshape(T, -1)], axis=1)
    q, k, v = qkv[:, : h * d], qkv[:, h * d: (h + kvh) * d], qkv[:, (h + kvh) * d:]
    assert not q.flags.c_contiguous
    out = K.attention_fused(q, k, v, hs.k_cache, hs.v_cache, inp["slot_mapping"],
                            inp["block_tables"], inp["query_start_loc"], inp["seq_lens"], hs.scale)
    assert_close(out.reshape(T, h, d), ref)


@pytest.mark.parametrize("lib_flags", [(), ("-mno-avx512f",)], ids=["avx512", "avx2-build"])
@pytest.mark.parametrize("cache_dtype", ["float32", *NARROW])
@pytest.mark.parametrize("h,kvh", [(12, 12), (8, 2)], ids=["mha", "gqa"])
def test_a_decode_row_has_the_same_bits_alone_in_a_batch_and_on_any_thread_count(
        monkeypatch, lib_flags, cache_dtype, h, kvh):
    """A decode step of fewer sequences than threads gives the segments of each long context
    to different threads (in the AVX-512 path and the portable one), and folds them
    afterwards. A row's bits must not depend on it: the last position of contexts of one, two
    and several 128-position segments (and one just past a boundary), computed alone on 2
    threads and on 1, in a batch of four decodes, and inside a prefill chunk, is the same every
    time, and matches the float64 reference."""
    if lib_flags:
        lib = K.load_library(list(lib_flags))
        assert lib.lls_has_avx512() == 0
        monkeypatch.setattr(K, "_default_lib", lib)
    lens = {0: 700, 1: 129, 2: 100, 3: 256}
    hs = PagedHarness(num_blocks=sum(lens.values()) // 16 + 8, block_size=16, h=h, kvh=kvh,
                      d=64, max_blocks_per_seq=700 // 16 + 1, seed=5, cache_dtype=cache_dtype)
    work = list(lens.items())
    step = hs.make_step(work)
    ref = hs.commit(work, step)
    K.reshape_and_cache(step["key"], step["value"], hs.k_cache, hs.v_cache,
                        step["slot_mapping"])
    qsl, bt, q = step["query_start_loc"], step["block_tables"], step["query"]
    last = qsl[1:] - 1                      # each sequence's last row
    lens_arr = np.array(list(lens.values()), np.int32)

    def decode(rows, threads):
        K.set_num_threads(threads)
        try:
            return K.paged_attention(q[last[rows]], hs.k_cache, hs.v_cache, bt[rows],
                                     np.arange(len(rows) + 1, dtype=np.int32), lens_arr[rows],
                                     hs.scale)
        finally:
            K.set_num_threads(0)

    batch = decode([0, 1, 2, 3], 2)
    chunk = K.paged_attention(q, hs.k_cache, hs.v_cache, bt, qsl, lens_arr, hs.scale)
    for i in range(len(lens)):
        assert_close(batch[i].reshape(h, 64), ref[last[i]])
        np.testing.assert_array_equal(decode([i], 2)[0], batch[i])
        np.testing.assert_array_equal(decode([i], 1)[0], batch[i])
        np.testing.assert_array_equal(chunk[last[i]], batch[i])


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_agree(threads):
    try:
        K.set_num_threads(threads)
        hs = PagedHarness(num_blocks=128, block_size=16, h=12, kvh=12, d=64, max_blocks_per_seq=40, seed=11)
        for work in MIXED_STEPS:
            _, out, ref = hs.run(work)
            assert_close(out, ref)
    finally:
        K.set_num_threads(0)


def test_long_prefill_parallel_cache_write():
    # large enough for the parallel reshape_and_cache and many work items per sequence
    hs = PagedHarness(num_blocks=64, block_size=16, h=8, kvh=2, d=64, max_blocks_per_seq=48, seed=12)
    _, out, ref = hs.run([(0, 600), (1, 3)])
    assert_close(out, ref)
    _, out, ref = hs.run([(0, 1), (1, 1)])
    assert_close(out, ref)
    hs.check_cache()


def test_concurrent_callers():
    # ctypes releases the GIL: calls from several threads overlap; a busy thread pool must fall
    # back to running on the calling thread, with identical results
    import threading

    hs = PagedHarness(num_blocks=128, block_size=16, h=12, kvh=4, d=64, max_blocks_per_seq=40, seed=13)
    hs.run([(0, 300), (1, 200), (2, 50)])
    inp = hs.make_step([(0, 1), (1, 1), (2, 1)])
    ref = hs.commit([(0, 1), (1, 1), (2, 1)], inp)
    K.reshape_and_cache(inp["key"], inp["value"], hs.k_cache, hs.v_cache, inp["slot_mapping"])
    errors = []

    def worker():
        try:
            for _ in range(50):
                out = K.paged_attention(inp["query"], hs.k_cache, hs.v_cache, inp["block_tables"],
                                        inp["query_start_loc"], inp["seq_lens"], hs.scale)
                assert_close(out, ref)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_works_in_forked_child():
    import os

    hs = PagedHarness(num_blocks=64, block_size=16, h=8, kvh=2, d=64, max_blocks_per_seq=40, seed=15)
    _, out, ref = hs.run([(0, 300), (1, 20)])  # the parent's pool has started its helpers
    assert_close(out, ref)
    pid = os.fork()
    if pid == 0:  # child: same calls must work (and not wait for the parent's helpers)
        code = 1
        try:
            _, out, ref = hs.run([(0, 200), (1, 1)])
            code = 0 if np.allclose(out, ref, rtol=RTOL, atol=ATOL) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_out_of_memory_is_an_error_not_the_end_of_the_process():
    """Under an address-space limit, a call whose work buffers cannot be allocated raises
    MemoryError, a pool whose helper threads the system refuses to start still runs, and the
    same process goes on computing the same bits (before, both C++ exceptions ended it)."""
    import resource

    hs = PagedHarness(num_blocks=64, block_size=16, h=8, kvh=2, d=64, max_blocks_per_seq=40,
                      seed=16)
    inp, out, ref = hs.run([(0, 300), (1, 20)])
    assert_close(out, ref)
    args = (inp["query"], hs.k_cache, hs.v_cache, inp["block_tables"], inp["query_start_loc"],
            inp["seq_lens"], hs.scale)
    # 20 M empty sequences: valid, but the call's per-sequence work lists need ~300 MB
    s = 20_000_000
    huge = (np.zeros((1, 8, 64), np.float32), hs.k_cache, hs.v_cache, np.zeros((s, 1), np.int32),
            np.zeros(s + 1, np.int32), np.zeros(s, np.int32), hs.scale)
    pid = os.fork()
    if pid == 0:  # child: a fresh pool, no helper thread started yet
        code = 1
        try:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
            # 4 MB more address space: less than a thread's stack
            resource.setrlimit(resource.RLIMIT_AS, ((vm + 4096) * 1024,) * 2)
            K.set_num_threads(64)     # the pool asks for 63 helpers
            code = 2
            try:
                same = np.array_equal(K.paged_attention(*args), out)
            except MemoryError:       # a helper started but could not allocate: also an error
                same = True
            if same:
                code = 3
                try:
                    K.paged_attention(*huge)
                except MemoryError as e:
                    code = 4 if "out of memory" in str(e) else 5
            if code == 4:
                K.set_num_threads(1)
                code = 0 if np.array_equal(K.paged_attention(*args), out) else 6
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child was killed by signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == 0


def test_scalar_fallback(monkeypatch):
    lib = K.load_library(["-DLLS_FORCE_SCALAR"])
    assert lib.lls_has_avx512() == 0
    monkeypatch.setattr(K, "_default_lib", lib)
    for h, kvh, bs, d in [(8, 2, 16, 64), (4, 4, 1, 40), (6, 1, 128, 64)]:
        hs = PagedHarness(num_blocks=300, block_size=bs, h=h, kvh=kvh, d=d, max_blocks_per_seq=200, seed=bs)
        for work in MIXED_STEPS:
            _, out, ref = hs.run(work)
            assert_close(out, ref)


def test_openmp_build_variant(monkeypatch):
    # optional build: OpenMP "parallel for" instead of the built-in thread pool
    monkeypatch.setattr(K, "_default_lib", K.load_library(["-DLLS_USE_OPENMP", "-fopenmp"]))
    hs = PagedHarness(num_blocks=128, block_size=16, h=8, kvh=2, d=64, max_blocks_per_seq=40, seed=14)
    for work in MIXED_STEPS:
        _, out, ref = hs.run(work)
        assert_close(out, ref)
    hs.check_cache()


def test_argument_errors_leave_cache_untouched():
    hs = PagedHarness(num_blocks=8, block_size=16, h=4, kvh=2, d=64, max_blocks_per_seq=4, seed=1)
    inp = hs.make_step([(0, 5)])
    args = [inp["query"], inp["key"], inp["value"], hs.k_cache, hs.v_cache, inp["slot_mapping"],
            inp["block_tables"], inp["query_start_loc"], inp["seq_lens"], hs.scale]
    with pytest.raises(K.KernelArgumentError, match="float32"):
        K.attention_fused(inp["query"].astype(np.float64), *args[1:])
    with pytest.raises(K.KernelArgumentError, match="int32"):
        K.attention_fused(*args[:5], inp["slot_mapping"].astype(np.int64), *args[6:])
    bad_bt = inp["block_tables"].copy()
    bad_bt[0, 0] = 99
    with pytest.raises(K.KernelArgumentError, match="out of range"):
        K.attention_fused(*args[:6], bad_bt, *args[7:])
    bad_slots = inp["slot_mapping"].copy()
    bad_slots[1] = 8 * 16
    with pytest.raises(K.KernelArgumentError, match="slot_mapping"):
        K.attention_fused(*args[:5], bad_slots, *args[6:])
    with pytest.raises(K.KernelArgumentError, match="seq_len"):
        K.attention_fused(*args[:8], np.array([3], np.int32), hs.scale)
    with pytest.raises(K.KernelArgumentError, match="heads"):
        K.paged_attention(inp["query"][:, :3], hs.k_cache, hs.v_cache, *args[6:])
    assert np.isnan(hs.k_cache).all() and np.isnan(hs.v_cache).all()


def test_build_is_cached_and_keyed_by_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path))
    p1 = K.build_library(["-DLLS_FORCE_SCALAR"])
    assert p1.parent == tmp_path / "kernels" and p1.exists()
    mtime = p1.stat().st_mtime_ns
    assert K.build_library(["-DLLS_FORCE_SCALAR"]) == p1 and p1.stat().st_mtime_ns == mtime
    assert not list(p1.parent.glob("*.tmp.so"))


def test_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setenv("LLM_SERVING_CXX", "definitely-not-a-compiler-xyz")
    with pytest.raises(K.KernelBuildError, match="g\\+\\+"):
        K.build_library(["-DSOMETHING_NEW"])


# ---------------------------------------------------------------------------------------------
# MindSpore bridge


@pytest.fixture(scope="module")
def ms():
    mindspore = pytest.importorskip("mindspore")
    mindspore.runtime.launch_blocking()
    return mindspore


def test_mindspore_bridge_ctypes(ms):
    h, kvh, d = 8, 2, 64
    hs = PagedHarness(num_blocks=64, block_size=16, h=h, kvh=kvh, d=d, max_blocks_per_seq=16, seed=21)
    for step, work in enumerate(MIXED_STEPS):
        inp = hs.make_step(work)
        ref = hs.commit(work, inp)
        T = inp["query"].shape[0]
        if step % 2 == 0:
            q = ms.Tensor(inp["query"].reshape(T, h * d))
            k = ms.Tensor(inp["key"].reshape(T, kvh * d))
            v = ms.Tensor(inp["value"].reshape(T, kvh * d))
        else:  # views of a fused QKV tensor (not contiguous)
            qkv = ms.Tensor(np.concatenate([inp["query"].reshape(T, -1), inp["key"].reshape(T, -1),
                                            inp["value"].reshape(T, -1)], axis=1)) * 1.0
            q, k, v = ms.ops.split(qkv, [h * d, kvh * d, kvh * d], axis=1)
        out = K.attention_forward(q, k, v, hs.k_cache, hs.v_cache, inp["slot_mapping"],
                                  inp["block_tables"], inp["query_start_loc"], inp["seq_lens"],
                                  hs.scale)
        assert isinstance(out, ms.Tensor) and out.shape == (T, h * d)
        assert_close(out.asnumpy().reshape(T, h, d), ref)
        # the output tensor is usable by MindSpore ops
        assert_close((out * 2.0).asnumpy().reshape(T, h, d), 2.0 * ref)
    hs.check_cache()


def _aot_inputs(ms, inp, h, kvh, d, scale):
    T = inp["query"].shape[0]
    return [ms.Tensor(inp["query"].reshape(T, h * d)), ms.Tensor(inp["key"].reshape(T, kvh * d)),
            ms.Tensor(inp["value"].reshape(T, kvh * d))], [
        ms.Tensor(inp["slot_mapping"]), ms.Tensor(inp["block_tables"]),
        ms.Tensor(inp["query_start_loc"]), ms.Tensor(inp["seq_lens"]),
        ms.Tensor(np.array([scale], np.float32))]


def test_mindspore_bridge_aot_updates_cache_in_place(ms):
    h, kvh, d = 8, 2, 64
    hs = PagedHarness(num_blocks=64, block_size=16, h=h, kvh=kvh, d=d, max_blocks_per_seq=16, seed=22)
    kc = ms.Parameter(ms.Tensor(np.zeros_like(hs.k_cache)), name="kc")
    vc = ms.Parameter(ms.Tensor(np.zeros_like(hs.v_cache)), name="vc")
    op = K.aot_attention_op()
    for work in MIXED_STEPS[:3]:
        inp = hs.make_step(work)
        ref = hs.commit(work, inp)
        qkv, meta = _aot_inputs(ms, inp, h, kvh, d, hs.scale)
        out = op(*qkv, kc, vc, *meta)
        T = inp["query"].shape[0]
        assert_close(out.asnumpy().reshape(T, h, d), ref)
    # the cache tensors really changed, in place
    hs.k_cache[...] = kc.asnumpy()
    hs.v_cache[...] = vc.asnumpy()
    hs.check_cache()


def test_mindspore_bridge_aot_in_jit(ms):
    h, kvh, d = 4, 4, 64
    hs = PagedHarness(num_blocks=32, block_size=16, h=h, kvh=kvh, d=d, max_blocks_per_seq=8, seed=23)
    kc = ms.Parameter(ms.Tensor(np.zeros_like(hs.k_cache)), name="kc_jit")
    vc = ms.Parameter(ms.Tensor(np.zeros_like(hs.v_cache)), name="vc_jit")
    op = K.aot_attention_op()

    @ms.jit
    def step(q, k, v, sm, bt, qsl, sl, sc):
        return op(q, k, v, kc, vc, sm, bt, qsl, sl, sc) * 1.0

    for work in ([(0, 12), (1, 7)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]):
        inp = hs.make_step(work)
        ref = hs.commit(work, inp)
        qkv, meta = _aot_inputs(ms, inp, h, kvh, d, hs.scale)
        out = step(*qkv, *meta)
        T = inp["query"].shape[0]
        assert_close(out.asnumpy().reshape(T, h, d), ref)
    hs.k_cache[...] = kc.asnumpy()
    hs.v_cache[...] = vc.asnumpy()
    hs.check_cache()


def test_both_bridges_share_one_cache(ms):
    # MindSpore Parameters as the cache; their asnumpy() views (zero-copy on CPU) feed the
    # ctypes path, the Parameters themselves the aot path: steps can alternate freely
    h, kvh, d = 8, 2, 64
    hs = PagedHarness(num_blocks=64, block_size=16, h=h, kvh=kvh, d=d, max_blocks_per_seq=16, seed=24)
    kc = ms.Parameter(ms.Tensor(np.zeros_like(hs.k_cache)), name="kc_shared")
    vc = ms.Parameter(ms.Tensor(np.zeros_like(hs.v_cache)), name="vc_shared")
    k_np, v_np = kc.asnumpy(), vc.asnumpy()
    assert k_np.ctypes.data == kc.data_ptr()
    op = K.aot_attention_op()
    for step, work in enumerate(MIXED_STEPS):
        inp = hs.make_step(work)
        ref = hs.commit(work, inp)
        qkv, meta = _aot_inputs(ms, inp, h, kvh, d, hs.scale)
        if step % 2 == 0:
            out = K.attention_forward(*qkv, k_np, v_np, inp["slot_mapping"], inp["block_tables"],
                                      inp["query_start_loc"], inp["seq_lens"], hs.scale)
        else:
            out = op(*qkv, kc, vc, *meta)
        T = inp["query"].shape[0]
        assert_close(out.asnumpy().reshape(T, h, d), ref)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("cache_dtype,itemsize", [("auto", 4), ("bfloat16", 2), ("float16", 2),
                                                  ("fp8", 1), ("fp8_e5m2", 1)])
def test_kv_cache_is_zeroed_and_committed_when_allocated(cache_dtype, itemsize):
    """The CPU backend's cache arrays are zeros of the kernels' storage type, writable and
    contiguous, and their memory is committed at allocation (start-up), not page by page by
    the steps that first write each block."""
    from llm_serving.model_executor.attention.cpu import CPUAttentionBackend
    backend = CPUAttentionBackend(8, 2, 64, kv_cache_dtype=cache_dtype)
    before = _rss_bytes()
    k, v = backend.allocate_kv_cache(1024, 16)        # 4 or 8 MB each
    grown = _rss_bytes() - before
    for c in (k, v):
        assert c.shape == (1024, 16, 2, 64) and c.itemsize == itemsize
        assert c.flags.c_contiguous and c.flags.writeable and not c.any()
    assert grown >= 0.9 * (k.nbytes + v.nbytes)
    # and the kernels take them
    hs = PagedHarness(num_blocks=1024, block_size=16, h=8, kvh=2, d=64, max_blocks_per_seq=8,
                      cache_dtype={"auto": "float32", "fp8": "fp8_e4m3"}.get(cache_dtype,
                                                                             cache_dtype))
    hs.k_cache, hs.v_cache = k, v
    for work in MIXED_STEPS[:2]:
        _, out, ref = hs.run(work)
        assert_close(out, ref)


def test_kv_cache_larger_than_available_memory_is_a_config_error(monkeypatch):
    """A cache that cannot be committed fails at allocation with an error naming the setting
    to lower, not with the kernel's OOM killer during the run."""
    from llm_serving.errors import ConfigError
    from llm_serving.model_executor.attention import cpu
    monkeypatch.setattr(cpu, "_available_memory", lambda: 3 << 20)
    backend = cpu.CPUAttentionBackend(8, 2, 64)
    before = _rss_bytes()
    with pytest.raises(ConfigError, match="kv_cache_space: the KV cache does not fit"):
        backend.allocate_kv_cache(1024, 16)           # 8 MB each
    assert _rss_bytes() - before < 4 << 20


def test_swap_pool_is_committed_only_as_it_is_used():
    """The host pool swapped-out blocks go to (preemption_mode="swap", swap_space GiB) takes
    no memory until blocks land in it."""
    from llm_serving.model_executor.attention.cpu import CPUAttentionBackend
    backend = CPUAttentionBackend(8, 2, 64)
    before = _rss_bytes()
    k, v = backend.allocate_host_cache(8192, 16)      # 32 MB each
    assert _rss_bytes() - before < 0.1 * (k.nbytes + v.nbytes)
    assert k.shape == v.shape == (8192, 16, 2, 64) and k.flags.writeable
