"""CPU layer kernels (layers/kernels/cpu_layer_ops.cpp) against NumPy references: the linear
kernel (weights packed in panels) in every build variant (AVX-512, AVX2, SSE vector widths),
and the element-wise kernels on the shared thread pool."""

import ctypes
import platform
import threading

import numpy as np
import pytest

from llm_serving.model_executor.layers.custom_op import load_layer_ops
from llm_serving.model_executor.layers.gemm import pack_weight

# Vector width of the build -> extra flags (a CPU without AVX-512 builds the 8-wide variant).
VARIANTS = {16: (), 8: ("-mno-avx512f",), 4: ("-mno-avx",)}


@pytest.fixture(scope="module", params=sorted(VARIANTS), ids=lambda w: f"vw{w}")
def lib(request):
    lib = load_layer_ops(VARIANTS[request.param])
    native = load_layer_ops().lls_layer_ops_vector_width()
    if request.param > native:
        pytest.skip(f"this CPU builds {native}-wide vectors natively")  # pragma: no cover
    assert lib.lls_layer_ops_vector_width() == request.param
    return lib


def run_linear(lib, x, w, bias=None, parts=None, out_ld_pad=0, fn="lls_linear_f32",
               untrimmed=False):
    """Call lls_linear_f32 (or ``fn``, same arguments) on w [N, K] packed for ``lib``; parts:
    list of part widths, each written to its own [M, width + out_ld_pad] buffer, NaN-filled.
    Returns the list of part outputs (trimmed, or with ``untrimmed`` the whole buffers)."""
    m, k = x.shape
    n = w.shape[0]
    wp = pack_weight(w, lib.lls_layer_ops_panel_width())
    parts = parts or [n]
    split = np.concatenate([[0], np.cumsum(parts)]).astype(np.int64)
    outs = [np.full((m, p + out_ld_pad), np.nan, np.float32) for p in parts]
    c_split = (ctypes.c_int64 * len(split))(*split.tolist())
    c_out = (ctypes.c_void_p * len(parts))(*[o.ctypes.data for o in outs])
    c_ld = (ctypes.c_int64 * len(parts))(*[o.shape[1] for o in outs])
    ldx = x.strides[0] // 4 if m > 1 else k
    rc = getattr(lib, fn)(x.ctypes.data, ldx, wp.ctypes.data,
                            None if bias is None else bias.ctypes.data, m, n, k, len(parts),
                            c_split, c_out, c_ld)
    assert rc == 0
    return outs if untrimmed else [o[:, :p] for o, p in zip(outs, parts)]


def reference(x, w, bias=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if bias is None else y + bias


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 33])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 15), (4, 16), (5, 17), (64, 31), (67, 64),
                                 (130, 768), (300, 2048)])
def test_linear_matches_numpy(lib, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    (y,) = run_linear(lib, x, w)
    np.testing.assert_allclose(y, reference(x, w), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_linear_bias_parts_and_strides(lib):
    """Fused-qkv use: bias, three parts into separate buffers (with padded rows), and x a
    column slice of a wider buffer (strided rows); large enough to run on the pool."""
    rng = np.random.default_rng(0)
    m, k, parts = 6, 96, [128, 32, 32]
    n = sum(parts)
    wide = rng.standard_normal((m, k + 40)).astype(np.float32)
    x = wide[:, 8:8 + k]
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    outs = run_linear(lib, x, w, b, parts, out_ld_pad=3)
    ref = reference(x, w, b)
    np.testing.assert_allclose(np.concatenate(outs, 1), ref, rtol=1e-4, atol=1e-4)


def test_linear_large_uses_pool_and_agrees_across_threads(lib):
    from llm_serving.model_executor.attention import kernels as attn
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    w = rng.standard_normal((2304, 768)).astype(np.float32)
    results = []
    try:
        for threads in (1, 2, 3):
            attn.set_num_threads(threads)
            results.append(run_linear(lib, x, w)[0])
    finally:
        attn.set_num_threads(0)
    for y in results:
        np.testing.assert_array_equal(y, results[0])  # same per-output arithmetic whatever split
    np.testing.assert_allclose(results[0], reference(x, w), rtol=1e-4, atol=3e-3)


def test_linear_concurrent_callers(lib):
    """Two Python threads sharing the pool: the busy pool runs the second call inline."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((1024, 512)).astype(np.float32)
    xs = [rng.standard_normal((2, 512)).astype(np.float32) for _ in range(2)]
    errors = []

    def work(x):
        for _ in range(20):
            y = run_linear(lib, x, w)[0]
            if not np.allclose(y, reference(x, w), rtol=1e-4, atol=3e-3):
                errors.append("mismatch")

    ts = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def fma_chain_reference(x, w, bias=None):
    """Every output as ONE float32 FMA chain over k in order from 0 (then + bias): the
    kernel's documented arithmetic. An FMA is emulated in float64 (the product of two float32
    is exact there) and rounded once to float32."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    for k in range(x.shape[1]):
        acc = (np.outer(x64[:, k], w64[:, k]) + acc).astype(np.float32)
    return acc if bias is None else acc + bias


def _chain_cases():
    rng = np.random.default_rng(16)
    cases = [(1, 5, 7), (2, 130, 9), (3, 12, 8), (7, 13, 9), (47, 25, 301), (48, 70, 300),
             (130, 77, 100), (600, 29, 131)]   # 600 rows: cut into row chunks
    for _ in range(6):
        cases.append((int(rng.integers(1, 301)), int(rng.integers(1, 200)),
                      int(rng.integers(1, 400))))
    return cases


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("m,n,k", _chain_cases())
def test_linear_is_one_fma_chain_per_output(lib, m, n, k, with_bias):
    """Each output is exactly the in-order float32 FMA chain over k, whatever path computes
    it: one or two panels per tile (few rows), row-tile tails, K blocks, row chunks (600
    rows), column tails (N not a multiple of the panel width), strided x, bias and split
    outputs with padded rows. Without a bias, the panels that fall inside one part keep their
    sums (the K blocks' partial ones too) in the output itself; the others, and every panel
    with a bias, go through the thread's buffer. That is what makes a row's bits independent
    of its batch. Nothing is written past a part's columns."""
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    wide = rng.standard_normal((m, k + 5)).astype(np.float32)
    x = wide[:, 3:3 + k]
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if with_bias else None
    parts = [n - n // 2, n // 2] if n > 1 else [n]
    outs = run_linear(lib, x, w, b, parts, out_ld_pad=3, untrimmed=True)
    got = np.concatenate([o[:, :p] for o, p in zip(outs, parts)], 1)
    np.testing.assert_array_equal(got, fma_chain_reference(x, w, b))
    for o, p in zip(outs, parts):
        assert np.isnan(o[:, p:]).all()


@pytest.mark.parametrize("n,k", [(130, 768), (64, 2053), (300, 96)])
def test_linear_row_alone_equals_row_in_any_batch(lib, n, k):
    """Batch invariance at the kernel: a row's output has the same bits alone (tiles of up to
    four panels; 300 columns end in a group of three) and at any position of batches of 3 to
    700 rows (two-panel tiles, row tiles, K blocks, chunks)."""
    rng = np.random.default_rng(n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((700, k)).astype(np.float32)
    alone = np.concatenate([run_linear(lib, x[i:i + 1], w)[0] for i in (0, 5, 699)])
    for m in (3, 7, 64, 700):
        batch = run_linear(lib, x[:m], w)[0]
        for j, i in enumerate((0, 5, 699)):
            if i < m:
                np.testing.assert_array_equal(batch[i], alone[j])


def test_many_rows_concurrent_callers(lib):
    """Two Python threads calling the many-rows path at once on the shared pool: each item's
    partial sums live in its worker's own buffer."""
    rng = np.random.default_rng(12)
    w = rng.standard_normal((700, 520)).astype(np.float32)
    xs = [rng.standard_normal((m, 520)).astype(np.float32) for m in (37, 90)]
    want = [run_linear(lib, x, w)[0] for x in xs]
    errors = []

    def work(x, y0):
        for _ in range(10):
            if not np.array_equal(run_linear(lib, x, w)[0], y0):
                errors.append("mismatch")

    ts = [threading.Thread(target=work, args=a) for a in zip(xs, want)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    np.testing.assert_allclose(want[1], reference(xs[1], w), rtol=1e-4, atol=3e-3)


def test_linear_rejects_bad_arguments(lib):
    x = np.zeros((1, 8), np.float32)
    w = np.zeros((4, 8), np.float32)
    y = np.zeros((1, 4), np.float32)
    split = (ctypes.c_int64 * 2)(0, 3)  # does not end at N
    out = (ctypes.c_void_p * 1)(y.ctypes.data)
    ld = (ctypes.c_int64 * 1)(4)
    assert lib.lls_linear_f32(x.ctypes.data, 8, w.ctypes.data, None, 1, 4, 8, 1, split, out,
                              ld) == -1
    split = (ctypes.c_int64 * 2)(0, 4)
    assert lib.lls_linear_f32(x.ctypes.data, 7, w.ctypes.data, None, 1, 4, 8, 1, split, out,
                              ld) == -1  # row stride shorter than a row


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_elementwise_kernels(lib, rows):
    rng = np.random.default_rng(rows)
    dim, eps = 96, 1e-6
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    res = rng.standard_normal((rows, dim)).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)

    def rms(v):
        v = v.astype(np.float64)
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    out = np.empty_like(x)
    lib.rms_norm_f32(x.ctypes.data, w.ctypes.data, out.ctypes.data, rows, dim, eps)
    np.testing.assert_allclose(out, rms(x), rtol=1e-5, atol=1e-5)

    r = res.copy()
    lib.add_rms_norm_f32(x.ctypes.data, r.ctypes.data, w.ctypes.data, out.ctypes.data, rows,
                         dim, eps)
    np.testing.assert_allclose(r, x + res, rtol=1e-6)
    np.testing.assert_allclose(out, rms(x + res), rtol=1e-5, atol=1e-5)

    f = 64
    gu = rng.standard_normal((rows, 2 * f)).astype(np.float32)
    act = np.empty((rows, f), np.float32)
    lib.silu_and_mul_f32(gu.ctypes.data, act.ctypes.data, rows, f)
    g, u = gu[:, :f].astype(np.float64), gu[:, f:]
    np.testing.assert_allclose(act, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)

    # rotary on column slices of one fused [rows, (nq + 2 nk) * D] buffer
    nq, nk, d, max_pos = 3, 1, 16, 64
    qkv = rng.standard_normal((rows, (nq + 2 * nk) * d)).astype(np.float32)
    pos = rng.integers(0, max_pos, rows).astype(np.int32)
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    fr = np.outer(np.arange(max_pos), inv)
    cs = np.concatenate([np.cos(fr), np.sin(fr)], -1).astype(np.float32)
    want = qkv.astype(np.float64).copy()
    for t in range(rows):
        c, s = cs[pos[t], :d // 2], cs[pos[t], d // 2:]
        for h in range(nq + nk):
            v = want[t, h * d:(h + 1) * d]
            a, b = v[:d // 2].copy(), v[d // 2:].copy()
            v[:d // 2], v[d // 2:] = a * c - b * s, b * c + a * s
    lib.rotary_embedding_f32(qkv.ctypes.data, qkv.ctypes.data + 4 * nq * d, pos.ctypes.data,
                             cs.ctypes.data, rows, nq, nk, d, qkv.shape[1], qkv.shape[1])
    np.testing.assert_allclose(qkv, want, rtol=1e-5, atol=1e-5)

    # per-head RMSNorm (Qwen3's q/k norms) in place on the k slice of the fused buffer: only
    # the k heads change
    hw = rng.standard_normal(d).astype(np.float32)
    before = qkv.copy()
    k = before[:, nq * d:(nq + nk) * d].reshape(rows, nk, d).astype(np.float64)
    want_k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps) * hw
    lib.head_rms_norm_f32(qkv.ctypes.data + 4 * nq * d, hw.ctypes.data, rows, nk, d,
                          qkv.shape[1], eps)
    np.testing.assert_allclose(qkv[:, nq * d:(nq + nk) * d], want_k.reshape(rows, -1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(qkv[:, :nq * d], before[:, :nq * d])
    np.testing.assert_array_equal(qkv[:, (nq + nk) * d:], before[:, (nq + nk) * d:])


def test_silu_and_mul_over_the_whole_float_range(lib):
    # The vector exps (libmvec, 8- and 16-wide builds) and the scalar tail: gates from -100
    # (exp overflows: -0) to 100 and widths that leave a tail, within a float32 ulp or two of
    # float64 everywhere; a column's result does not depend on the rows around it.
    width = lib.lls_layer_ops_vector_width()
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert lib.lls_vector_exp_available() == (width > 4)     # glibc ships libmvec there
    rng = np.random.default_rng(7)
    rows = 9
    for f in (16, 37, 2048):
        n = rows * f
        g = np.concatenate([np.linspace(-100, 100, n // 2), rng.standard_normal(n - n // 2) * 4])
        g = rng.permutation(g).astype(np.float32).reshape(rows, f)
        u = rng.standard_normal((rows, f)).astype(np.float32)
        gu = np.ascontiguousarray(np.concatenate([g, u], 1))
        act = np.empty((rows, f), np.float32)
        lib.silu_and_mul_f32(gu.ctypes.data, act.ctypes.data, rows, f)
        g64 = g.astype(np.float64)
        np.testing.assert_allclose(act, g64 / (1 + np.exp(-g64)) * u, rtol=5e-7, atol=1e-30)
        one = np.empty((1, f), np.float32)
        for r in (0, rows - 1):
            lib.silu_and_mul_f32(gu[r:r + 1].ctypes.data, one.ctypes.data, 1, f)
            assert np.array_equal(one[0], act[r])
