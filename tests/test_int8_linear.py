"""W8A8 int8 linear layers (``Linear.use_int8_weight``, ``lls_linear_int8``) against an
independent NumPy reference of vLLM-CPU's compressed-tensors int8 numerics: per-token
sx = max |x| / 127 (or one static scale), xq = clamp(rint(x * (1 / sx)), -128, 127) (half to
even; a zero row quantizes to zeros), int64 sums, then in float32 the orders of vLLM-CPU's
oneDNN int8 matmul, whose outputs this gives bit for bit: dynamic fma(sum * scale, sx, bias)
with one rounding (without a bias, (sum * scale) * sx), static (sum * sx) * scale + bias.
Every build variant of the kernel (VNNI, AVX-VNNI, the exact VPMADDWD paths of CPUs without
VNNI, scalar) gives those bits, whatever the batch."""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from mindspore import Tensor

from llm_serving.executor.protocol import StepInput
from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.device import init_device
from llm_serving.model_executor.forward_context import ForwardContext, set_forward_context
from llm_serving.model_executor.layers import gemm
from llm_serving.model_executor.layers.custom_op import load_layer_ops
from llm_serving.model_executor.layers.linear import Linear
from llm_serving.model_executor.lora import StepLoRA

# Build flags -> the int8 instructions they select on a CPU with AVX512-VNNI and AVX-VNNI;
# a CPU without some of them builds a narrower path under the same flags (still tested).
VARIANTS = {"native": (), "no-avx512vnni": ("-mno-avx512vnni",),
            "ymm": ("-mno-avx512f",), "ymm-no-vnni": ("-mno-avx512f", "-mno-avxvnni"),
            "scalar": ("-mno-avx",)}


@pytest.fixture(scope="module", autouse=True)
def cpu():
    init_device("cpu")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def lib(request):
    return load_layer_ops(VARIANTS[request.param])


def test_the_variants_cover_the_exact_widening_and_scalar_paths():
    kinds = {load_layer_ops(f).lls_int8_dot_kind().decode() for f in VARIANTS.values()}
    assert "scalar" in kinds and kinds & {"avx2-madd", "avx512bw-madd"}


def reference(x, q, scale, bias=None, input_scale=None):
    x = np.asarray(x, np.float32)
    if input_scale is None:
        sx = (np.abs(x).max(1) / np.float32(127)).astype(np.float32)
    else:
        sx = np.full(len(x), input_scale, np.float32)
    inv = np.zeros_like(sx)
    inv[sx > 0] = np.float32(1) / sx[sx > 0]
    xq = np.clip(np.rint(x * inv[:, None]), -128, 127).astype(np.int64)
    acc = (xq @ q.astype(np.int64).T).astype(np.float32)
    if input_scale is not None:
        y = (acc * sx[:, None]) * scale[None, :]
        return y if bias is None else y + bias
    t = acc * scale[None, :]
    if bias is None:
        return t * sx[:, None]
    return fma32(t, np.broadcast_to(sx[:, None], t.shape), np.broadcast_to(bias, t.shape))


def fma32(a, b, c):
    """float32 a * b + c rounded once: the product is exact in float64, the sum is s + err
    exactly (TwoSum), and s rounds to float32 as s + err does unless s lies exactly halfway
    between two float32 values, where err's sign decides."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    other = np.where(r.astype(np.float64) > s, np.nextafter(r, np.float32(-np.inf)),
                     np.nextafter(r, np.float32(np.inf)))
    tie = (r.astype(np.float64) + other.astype(np.float64)) / 2 == s
    towards_other = (err > 0) == (other.astype(np.float64) > s)
    return np.where(tie & (err != 0) & towards_other, other, r)


def run_kernel(lib, x, q, scale, bias=None, input_scale=None, parts=None):
    """lls_linear_int8 of ``lib`` on q packed by pack_weight_int8; parts: widths of outputs
    written to their own NaN-filled buffers (one wider than needed). Returns them joined."""
    m, k = x.shape
    n = q.shape[0]
    parts = parts or [n]
    split = np.concatenate([[0], np.cumsum(parts)]).astype(np.int64)
    outs = [np.full((m, p + 1), np.nan, np.float32) for p in parts]
    packed, comp = gemm.pack_weight_int8(q), gemm.int8_compensation(q)
    static = None if input_scale is None else np.array([input_scale], np.float32)
    rc = lib.lls_linear_int8(
        x.ctypes.data, x.strides[0] // 4, packed.ctypes.data, comp.ctypes.data,
        scale.ctypes.data, None if static is None else static.ctypes.data,
        None if bias is None else bias.ctypes.data, m, n, k, len(parts),
        (ctypes.c_int64 * len(split))(*split.tolist()),
        (ctypes.c_void_p * len(parts))(*[o.ctypes.data for o in outs]),
        (ctypes.c_int64 * len(parts))(*[p + 1 for p in parts]))
    if rc:
        raise ValueError(f"lls_linear_int8 returned {rc}")
    assert all(np.isnan(o[:, -1]).all() for o in outs)      # nothing past a part's columns
    return np.concatenate([o[:, :-1] for o in outs], 1)


def weights(rng, n, k):
    return (rng.integers(-128, 128, (n, k), dtype=np.int8),
            (rng.random(n, dtype=np.float32) * 0.02 + 1e-4).astype(np.float32))


@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (16, 4), (67, 17), (130, 768), (300, 2048)])
def test_kernel_matches_the_reference_bit_for_bit(lib, n, k):
    rng = np.random.default_rng(n * 7 + k)
    q, scale = weights(rng, n, k)
    bias = rng.standard_normal(n, dtype=np.float32)
    for m in (1, 2, 5, 7, 13, 33):
        x = rng.standard_normal((m, k), dtype=np.float32) * 3
        x[m // 2, : k // 2] *= 100                  # a row with outliers: coarse steps
        parts = [n // 3, n - n // 3] if n > 2 else None
        for b, static in ((None, None), (bias, None), (None, 0.05), (bias, 0.05)):
            np.testing.assert_array_equal(run_kernel(lib, x, q, scale, b, static, parts),
                                          reference(x, q, scale, b, static))


def test_extreme_weights_and_activations_sum_exactly(lib):
    # every product at its largest magnitude (-128 x -128 and 127 x -128): a VPMADDUBSW path
    # would saturate its int16 pair sums here
    k = 4096
    q = np.full((48, k), -128, np.int8)
    q[1::2] = 127
    scale = np.ones(48, np.float32)
    x = np.full((3, k), -1.0, np.float32)
    x[1] = 1.0
    x[2, ::2] = 1.0
    np.testing.assert_array_equal(run_kernel(lib, x, q, scale), reference(x, q, scale))


def test_rounding_is_half_to_even_and_static_scales_clamp(lib):
    # x * (1 / 0.5) lands on halves: 0.25 -> 0.5 -> 0, 0.75 -> 1.5 -> 2, 1.25 -> 2.5 -> 2;
    # 100 and -100 clamp to 127 and -128
    x = np.array([[0.25, 0.75, 1.25, -0.25, -0.75, -1.25, 100.0, -100.0]], np.float32)
    q = np.eye(8, dtype=np.int8)
    y = run_kernel(lib, x, q, np.ones(8, np.float32), input_scale=0.5)
    np.testing.assert_array_equal(y[0], np.array([0, 2, 2, 0, -2, -2, 127, -128]) * 0.5)


def test_a_zero_row_gives_the_bias(lib):
    rng = np.random.default_rng(3)
    q, scale = weights(rng, 40, 64)
    bias = rng.standard_normal(40, dtype=np.float32)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    x[1] = 0
    y = run_kernel(lib, x, q, scale, bias)
    np.testing.assert_array_equal(y[1], bias)
    np.testing.assert_array_equal(y, reference(x, q, scale, bias))


def test_rows_do_not_depend_on_the_batch(lib):
    rng = np.random.default_rng(4)
    q, scale = weights(rng, 2304, 768)

    def run(rows):
        return run_kernel(lib, np.ascontiguousarray(rows), q, scale)
    assert gemm.rows_alike(run, 768, rng)


def test_all_build_variants_give_the_same_bits():
    rng = np.random.default_rng(5)
    q, scale = weights(rng, 200, 300)
    x = rng.standard_normal((9, 300), dtype=np.float32)
    outs = [run_kernel(load_layer_ops(f), x, q, scale) for f in VARIANTS.values()]
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_bad_kernel_arguments_are_refused():
    lib = load_layer_ops()
    q = np.zeros((16, 65540), np.int8)          # K over 65536: the int32 sums could overflow
    with pytest.raises(ValueError, match="returned -1"):
        run_kernel(lib, np.zeros((1, 65540), np.float32), q, np.ones(16, np.float32))


# ---- Linear ---------------------------------------------------------------------------------

def int8_layer(rng, k, outs, bias=False, split=False, static=None, **kw):
    layer = Linear(k, outs, bias=bias, split_output=split, **kw)
    layer.use_int8_weight(static_input_scale=static is not None)
    q, scale = weights(rng, layer.gemm_shape[0], layer.gemm_shape[1])
    layer.set_int8_weight(q, scale, static)
    b = None
    if bias:
        b = rng.standard_normal(layer.gemm_shape[0], dtype=np.float32)
        layer.bias.set_data(Tensor(b))
    return layer, q, scale, b


def joined(y):
    return np.concatenate([t.asnumpy() for t in y], 1) if isinstance(y, tuple) else y.asnumpy()


@pytest.mark.parametrize("static", [None, 0.03])
def test_layer_forward_with_split_outputs_and_bias(static):
    rng = np.random.default_rng(6)
    layer, q, scale, b = int8_layer(rng, 96, [64, 32, 32], bias=True, split=True, static=static)
    assert layer.int8 and str(layer.weight.dtype) == "Int8"
    for m in (1, 4, 20):
        x = rng.standard_normal((m, 96), dtype=np.float32)
        y = layer(Tensor(x))
        assert [t.shape for t in y] == [(m, 64), (m, 32), (m, 32)]
        np.testing.assert_array_equal(joined(y), reference(x, q, scale, b, static))


def test_lora_adds_its_product_on_top_of_the_int8_output():
    rng = np.random.default_rng(11)
    layer, q, scale, _ = int8_layer(rng, 64, [32, 16], split=True)
    layer.lora_name = "qkv"
    a = rng.standard_normal((4, 64), dtype=np.float32)
    b = rng.standard_normal((16, 4), dtype=np.float32)
    adapter = SimpleNamespace(layers={"qkv": (a, [(1, 0, 4, b)])})     # part 1 only
    x = rng.standard_normal((5, 64), dtype=np.float32)
    rows = np.array([1, 3])
    with set_forward_context(ForwardContext(None, lora=StepLoRA([(adapter, rows)]))):
        y = joined(layer(Tensor(x)))
    want = reference(x, q, scale)
    want[rows, 32:] += (x[rows] @ a.T) @ b.T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(y[[0, 2, 4]], reference(x, q, scale)[[0, 2, 4]])


def test_reload_in_place_keeps_the_address_and_takes_the_new_values():
    rng = np.random.default_rng(7)
    layer, _, _, _ = int8_layer(rng, 64, [48], static=0.1)
    address = layer.weight.data_ptr()
    q, scale = weights(rng, 48, 64)
    layer.set_int8_weight(q, scale[:, None], input_scale=0.2, in_place=True)
    assert layer.weight.data_ptr() == address
    x = rng.standard_normal((3, 64), dtype=np.float32)
    np.testing.assert_array_equal(layer(Tensor(x)).asnumpy(), reference(x, q, scale, None, 0.2))


def test_tensor_parallel_slices_quantize_their_own_input():
    rng = np.random.default_rng(8)
    q, scale = weights(rng, 40, 128)
    x = rng.standard_normal((5, 128), dtype=np.float32)
    x[:, 70] = 50.0                 # rank 1's slice holds the outlier; rank 0's scale ignores it
    partial = []
    for rank in (0, 1):
        row = Linear(128, [40], tp_rank=rank, tp_size=2, parallel="row")
        row.use_int8_weight()
        cols = slice(64 * rank, 64 * rank + 64)
        row.set_int8_weight(np.ascontiguousarray(q[:, cols]), scale)
        y = row.gemm("kernel", Tensor(np.ascontiguousarray(x[:, cols])), with_bias=False)
        np.testing.assert_array_equal(y.asnumpy(), reference(x[:, cols], q[:, cols], scale))
        partial.append(y.asnumpy())
    assert not np.array_equal(partial[0] + partial[1], reference(x, q, scale))
    col = Linear(128, [40], tp_rank=1, tp_size=2, parallel="column")
    col.use_int8_weight()
    col.set_int8_weight(q[20:], scale[20:])
    np.testing.assert_array_equal(col(Tensor(x)).asnumpy(), reference(x, q[20:], scale[20:]))


def test_bad_weights_and_orders_are_refused(monkeypatch):
    rng = np.random.default_rng(9)
    layer = Linear(32, [16])
    q, scale = weights(rng, 16, 32)
    with pytest.raises(ValueError, match="use_int8_weight"):
        layer.set_int8_weight(q, scale)
    layer.use_int8_weight()
    for bad_q, bad_s, match in ((q.astype(np.int16), scale, "int8 array"),
                                (q[:, :31], scale, "shape"),
                                (q, scale.astype(np.float64), "float32"),
                                (q, scale[:15], "float32 of shape"),
                                (q, np.full(16, np.inf, np.float32), "non-finite")):
        with pytest.raises(ValueError, match=match):
            layer.set_int8_weight(bad_q, bad_s)
    with pytest.raises(ValueError, match="static_input_scale=True"):
        layer.set_int8_weight(q, scale, input_scale=0.1)
    with pytest.raises(ValueError, match="set_int8_weight"):
        layer.set_weight(np.zeros((16, 32), np.float32))
    with pytest.raises(ValueError, match="int8"):
        layer.use_bf16_weight()
    with pytest.raises(ValueError, match="float32 activations"):
        layer(Tensor(np.zeros((1, 32), np.float16)))
    static = Linear(32, [16])
    static.use_int8_weight(static_input_scale=True)
    with pytest.raises(ValueError, match="required"):
        static.set_int8_weight(q, scale)
    with pytest.raises(ValueError, match="positive"):
        static.set_int8_weight(q, scale, input_scale=0.0)
    with pytest.raises(ValueError, match="at most 65536 inputs"):
        Linear(65540, [16]).use_int8_weight()
    monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")      # MindSpore's ops, not our kernels
    with pytest.raises(ValueError, match="CPU-kernel feature"):
        Linear(32, [16]).use_int8_weight()


def test_a_captured_step_replays_the_int8_layer():
    rng = np.random.default_rng(10)
    layer, q, scale, b = int8_layer(rng, 64, [24, 40], bias=True)
    table = rng.standard_normal((500, 64), dtype=np.float32)

    def gather(ids, out):
        np.take(table, ids, axis=0, out=out)

    def forward(ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens):
        x = cpu_graph.empty((len(ids), 64), np.float32)
        cpu_graph.launch(gather, ids, x)
        return layer(Tensor.from_numpy(x)).asnumpy()

    graphs = cpu_graph.CpuGraphs(forward, max_batch=4, max_blocks_per_seq=2)
    for start in range(0, 100, 10):
        ids = list(range(start, start + 3))
        step = StepInput(np.array(ids, np.int32), np.zeros(3, np.int32),
                         np.arange(3, dtype=np.int32), np.zeros((3, 2), np.int32),
                         np.arange(4, dtype=np.int32), np.ones(3, np.int32),
                         np.arange(3, dtype=np.int32))
        got = graphs.logits(step, np.arange(3))
        if got is not None:
            np.testing.assert_array_equal(got, reference(table[ids], q, scale, b))
    assert graphs.stats.replayed_steps >= 5
