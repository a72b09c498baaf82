"""The CPU linear layers' GEMM candidates (layers/gemm.py): every implementation the start-up
probe can pick (and MatMul, which LLM_SERVING_GEMM can force) computes x @ W.T (+ bias) like
NumPy in float64, within fp32 tolerance, for plain, fused-split and LM-head layers, on weights
loaded through ``set_weight`` (packed for our kernels); the probe's choice is cached per CPU
and reused."""
import numpy as np
import pytest
from mindspore import Tensor

from llm_serving.errors import ConfigError
from llm_serving.model_executor.device import init_device
from llm_serving.model_executor.layers import gemm
from llm_serving.model_executor.layers import linear as L


def reference(x, w, bias=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if bias is None else y + bias


@pytest.fixture(scope="module", autouse=True)
def cpu():
    init_device("cpu")


@pytest.fixture
def plan_for(monkeypatch):
    """Layers built after ``plan_for(impl)`` run with a fresh plan forcing ``impl`` (MatMul
    must be forced before a layer is built: the weights then stay unpacked)."""
    def use(impl):
        monkeypatch.setenv("LLM_SERVING_GEMM", impl)
        monkeypatch.setattr(gemm, "_plan", gemm.GemmPlan(None))
    return use


def test_openblas_is_a_candidate():
    """scipy-openblas32 is a dependency, so the probe always has OpenBLAS to choose."""
    assert gemm.available() == gemm.CANDIDATES


@pytest.mark.parametrize("impl", gemm.FORCEABLE)
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_linear_candidates_match_float64(impl, split, plan_for):
    plan_for(impl)
    rng = np.random.default_rng(3)
    layer = L.Linear(96, [48, 16, 16], bias=True, split_output=split)
    assert layer.packed == (impl != "matmul")
    w = rng.standard_normal((80, 96)).astype(np.float32)
    b = rng.standard_normal(80).astype(np.float32)
    layer.set_weight(w)
    layer.bias.set_data(Tensor(b))
    for m in (1, 3, 17, 70, 300):
        x = rng.standard_normal((m, 96)).astype(np.float32)
        got = layer(Tensor(x))
        got = np.concatenate([g.asnumpy() for g in got], 1) if split else got.asnumpy()
        np.testing.assert_allclose(got, reference(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", gemm.FORCEABLE)
def test_lm_head_candidates_match_float64(impl, plan_for):
    plan_for(impl)
    rng = np.random.default_rng(4)
    head = L.VocabEmbedding(1000, 64)
    for w in [rng.standard_normal((1000, 64)).astype(np.float32) for _ in range(2)]:
        head.set_weight(w)          # a new weight: the packed copy follows
        for m in (1, 5, 130):
            x = rng.standard_normal((m, 64)).astype(np.float32)
            got = head.compute_logits(Tensor(x))
            np.testing.assert_allclose(got, reference(x, w), rtol=1e-4, atol=1e-4)
        ids = Tensor(np.array([0, 999, 3], np.int32))          # the embedding: unpacked rows
        np.testing.assert_array_equal(head(ids).asnumpy(), w[[0, 999, 3]])


def test_layer_forward_uses_the_plan_and_matches(monkeypatch, tmp_path):
    """Layers probe their shape once, compute the right result at any row count, and keep one
    implementation for every row count (batch invariance); the choice is saved and a new
    process's plan reuses it without probing."""
    monkeypatch.delenv("LLM_SERVING_GEMM", raising=False)
    monkeypatch.delenv("LLM_SERVING_GEMM_PER_BUCKET", raising=False)
    path = tmp_path / "plan.json"
    plan = gemm.GemmPlan(path)
    monkeypatch.setattr(gemm, "_plan", plan)
    rng = np.random.default_rng(5)
    layers = [L.Linear(64, [128]) for _ in range(3)]
    ws = [rng.standard_normal((128, 64)).astype(np.float32) for _ in layers]
    for layer, w in zip(layers, ws):
        layer.set_weight(w)
    for m in (1, 20, 300):
        x = rng.standard_normal((m, 64)).astype(np.float32)
        for layer, w in zip(layers, ws):
            np.testing.assert_allclose(layer(Tensor(x)).asnumpy(), reference(x, w),
                                       rtol=1e-4, atol=1e-4)
    impl = plan.choices["128,64"]
    assert impl == "kernel" or gemm.batch_invariant(layers[0], impl)
    assert set(plan.choices) == {"128,64"}          # one choice for every row count
    again = gemm.GemmPlan(path)
    assert again.choices == plan.choices
    assert again.choose(layers[0], 17) == plan.choose(layers[0], 17) and not again.timings


def test_kernel_rows_do_not_depend_on_the_batch():
    """What batch invariance rests on: our kernel gives a row the same bits at any row count
    and position (OpenBLAS is only used by default where the probe finds the same)."""
    assert gemm.batch_invariant(L.Linear(768, [256, 64, 64], split_output=True), "kernel")
    assert gemm.batch_invariant(L.VocabEmbedding(500, 96), "kernel")


@pytest.mark.parametrize("n,k", [(384, 768), (77, 100), (1000, 64), (768, 2048)])
def test_kernel_row_alone_equals_row_in_any_batch(n, k):
    """A row's output from our kernel is bit-identical whether it is computed alone or inside
    batches of any size and at any position, decode-sized or prefill-sized (the kernel tiles
    few and many rows differently), including tail columns (n not a multiple of the panel)
    and K blocks, with bias and split outputs."""
    rng = np.random.default_rng(7)
    layer = L.Linear(k, [n - 2 * (n // 4), n // 4, n // 4], bias=True, split_output=True)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    layer.set_weight(w)
    layer.bias.set_data(Tensor(b))
    row = rng.standard_normal(k).astype(np.float32)

    def out(x):
        return np.concatenate([t.asnumpy() for t in layer.gemm("kernel", Tensor(x))], 1)
    alone = out(row[None])[0]
    np.testing.assert_allclose(alone, reference(row[None], w, b)[0], rtol=1e-4, atol=1e-4)
    for m in (2, 3, 5, 8, 13, 64, 257):
        for pos in {0, m // 2, m - 1}:
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[pos] = row
            np.testing.assert_array_equal(out(x)[pos], alone, err_msg=f"{m} rows, at {pos}")


def test_weight_of_the_wrong_shape_is_refused():
    layer = L.Linear(64, [32])
    with pytest.raises(ValueError, match="shape"):
        layer.set_weight(np.zeros((64, 32), np.float32))


def test_per_bucket_mode_probes_each_bucket(monkeypatch, tmp_path):
    monkeypatch.delenv("LLM_SERVING_GEMM", raising=False)
    monkeypatch.setenv("LLM_SERVING_GEMM_PER_BUCKET", "1")
    plan = gemm.GemmPlan(tmp_path / "plan.json")
    monkeypatch.setattr(gemm, "_plan", plan)
    layer = L.Linear(64, [96])
    for m in (1, 9):
        layer(Tensor(np.ones((m, 64), np.float32)))
    assert set(plan.choices) == {"96,64,1", "96,64,16"}
    assert set(plan.timings["96,64,16"]) == set(gemm.CANDIDATES)


def test_forced_candidate_and_bad_value(monkeypatch):
    monkeypatch.setenv("LLM_SERVING_GEMM", "matmul")
    assert gemm.GemmPlan(None).choose(L.Linear(8, [8]), 5) == "matmul"
    monkeypatch.setenv("LLM_SERVING_GEMM", "mkl")
    with pytest.raises(ConfigError, match="LLM_SERVING_GEMM"):
        gemm.GemmPlan(None)


def test_buckets():
    assert [gemm.m_bucket(m) for m in (1, 2, 3, 4, 5, 64, 65, 10**6)] == \
        [1, 2, 4, 4, 8, 64, 128, gemm.MAX_BUCKET]
