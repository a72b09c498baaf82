"""Lower precision on CPU: ``--dtype bfloat16`` (linear weights stored bf16; on a CPU with
AMX or avx512_bf16 the linear layers' inputs may be rounded to bf16 too and multiplied on AMX
tiles or with AVX512-BF16 dot products, else fp32 arithmetic) and ``--kv-cache-dtype
bfloat16`` or ``float16`` (KV stored bf16 or IEEE half, with fp32 or bf16 weights).

References are independent of our code: torch rounds fp32 to bf16 or fp16 (to nearest even),
NumPy computes the GEMM in float64, HF transformers runs the model with the same values
rounded (its linear weights, for bf16 activations its linear layers' inputs, and for a 16-bit
KV cache its keys and values through a registered attention function). Since the rounding is
the same and the sums stay fp32, our results must match those references as closely as fp32
matches fp32: the parity suite's 5e-3 on logits and identical greedy tokens."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from conftest import MODEL_VARIANTS
from test_model_parity import hf_logits_and_greedy
from llm_serving import LLM, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 by torch, as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def bf16_bits(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


# ---- the conversion and the kernel --------------------------------------------------------

def test_rounding_matches_torch_and_keeps_checkpoint_bf16_bits():
    from llm_serving.model_executor.loader import (bfloat16_bits_to_float32,
                                                   float32_to_bfloat16_bits)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 10000), np.array([0.0, -0.0, 1.00390625, 1.01171875, 3.39e38, np.inf, -np.inf,
                                   1e-41], np.float32)]).astype(np.float32)
    np.testing.assert_array_equal(float32_to_bfloat16_bits(x), bf16_bits(x))
    bits = rng.integers(0, 0x7F80, 5000).astype(np.uint16)          # finite bf16 values
    np.testing.assert_array_equal(float32_to_bfloat16_bits(bfloat16_bits_to_float32(bits)), bits)
    assert np.isnan(bfloat16_bits_to_float32(float32_to_bfloat16_bits(
        np.array([np.nan], np.float32)))).all()


# Vector widths our kernel builds for (a CPU without AVX-512 builds the 8-wide variant).
VARIANTS = {16: (), 8: ("-mno-avx512f",), 4: ("-mno-avx",)}


@pytest.fixture(scope="module", params=sorted(VARIANTS), ids=lambda w: f"vw{w}")
def lib(request):
    from llm_serving.model_executor.layers.custom_op import load_layer_ops
    native = load_layer_ops().lls_layer_ops_vector_width()
    if request.param > native:
        pytest.skip(f"this CPU builds {native}-wide vectors natively")  # pragma: no cover
    return load_layer_ops(VARIANTS[request.param])


def run(lib, fn, x, w, bias=None):
    from llm_serving.model_executor.layers.gemm import pack_weight
    m, k = x.shape
    n = w.shape[0]
    out = np.full((m, n), np.nan, np.float32)
    wp = pack_weight(w, lib.lls_layer_ops_panel_width())
    rc = getattr(lib, fn)(x.ctypes.data, k, wp.ctypes.data,
                          None if bias is None else bias.ctypes.data, m, n, k, 1,
                          (ctypes.c_int64 * 2)(0, n), (ctypes.c_void_p * 1)(out.ctypes.data),
                          (ctypes.c_int64 * 1)(n))
    assert rc == 0
    return out


@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 33])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 17), (67, 64), (130, 768), (300, 2048)])
def test_bf16_kernel_matches_float64_on_rounded_weights(lib, m, n, k):
    """y = x @ bf16(W).T + b in fp32: within the fp32 kernel's own tolerance of float64 on the
    rounded weights (rtol 1e-4, atol 1e-4 * sqrt(k): fp32 accumulation over k terms), and bit
    for bit the fp32 kernel's result on those rounded weights (the widening is exact and the
    FMA chain the same)."""
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    y = run(lib, "lls_linear_bf16", x, bf16_bits(w), b)
    ref = x.astype(np.float64) @ bf16(w).astype(np.float64).T + b
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    np.testing.assert_array_equal(y, run(lib, "lls_linear_f32", x, bf16(w), b))
    # and the rounding is really there: the unrounded weights give another result
    if k >= 64:
        assert np.abs(x.astype(np.float64) @ w.T.astype(np.float64) + b - ref).max() > 1e-3


def _tiles_run(lib, kernel, x, w, bias):
    """Our bf16-activation kernel ``kernel`` ("amx" or "dot") on W packed in AMX tiles."""
    from llm_serving.model_executor.layers.gemm import pack_weight_amx
    m, k = x.shape
    n = w.shape[0]
    out = np.full((m, n), np.nan, np.float32)
    wp = pack_weight_amx(w)
    fn = {"amx": lib.lls_linear_bf16_amx, "dot": lib.lls_linear_bf16_dot}[kernel]
    rc = fn(x.ctypes.data, k, wp.ctypes.data, bias.ctypes.data, m, n, k, 1,
            (ctypes.c_int64 * 2)(0, n), (ctypes.c_void_p * 1)(out.ctypes.data),
            (ctypes.c_int64 * 1)(n))
    return rc, out


@pytest.fixture
def fresh_plan(monkeypatch, tmp_path):
    """A GEMM plan made afresh from the environment, its cache in a temporary home."""
    from llm_serving.model_executor.layers import gemm
    monkeypatch.setenv("LLM_SERVING_HOME", str(tmp_path))
    monkeypatch.delenv("LLM_SERVING_GEMM_BF16", raising=False)
    monkeypatch.setattr(gemm, "_plan", None)
    return monkeypatch


def test_bf16_kernels_are_offered_exactly_where_the_cpu_has_them(fresh_plan):
    """amx where the CPU has amx_bf16 (and avx512_bf16, for rounding the inputs), dot where it
    has avx512_bf16, widen everywhere; a kernel the CPU lacks refuses (-2), writing nothing, so
    no other CPU can reach it; LLM_SERVING_GEMM_BF16 forces one this CPU runs, and naming any
    other is a config error naming the variable."""
    from llm_serving.cpu_info import cpu_flags
    from llm_serving.model_executor.layers import gemm
    from llm_serving.model_executor.layers.custom_op import cpu_layer_ops
    flags = cpu_flags()
    has = {"amx": {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags,
           "dot": {"avx512_bf16", "avx512f"} <= flags, "widen": True}
    assert gemm.bf16_kernels() == tuple(c for c in gemm.BF16_KERNELS if has[c])
    x = np.ones((2, 64), np.float32)
    for kernel in ("amx", "dot"):
        rc, y = _tiles_run(cpu_layer_ops(), kernel, x, bf16_bits(np.ones((32, 64), np.float32)),
                           np.zeros(32, np.float32))
        assert rc == (0 if has[kernel] else -2)
        assert (y == 64).all() if has[kernel] else np.isnan(y).all()
    for kernel in gemm.bf16_kernels():
        fresh_plan.setenv("LLM_SERVING_GEMM_BF16", kernel)
        layer, _ = _bf16_layer(64, 96)
        assert layer.bf16_kernel == kernel
        assert layer.weight.ndim == (3 if kernel == "widen" else 4)  # panels, or AMX tiles
    for bad in ("fp8", *(c for c in gemm.BF16_KERNELS if not has[c])):
        fresh_plan.setenv("LLM_SERVING_GEMM_BF16", bad)
        with pytest.raises(ConfigError, match="LLM_SERVING_GEMM_BF16"):
            _bf16_layer(64, 96)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx",)], ids=["avx2", "sse"])
def test_builds_without_avx512_have_only_the_widening_kernel(flags):
    """What a CPU without AVX-512 (AMD Zen 3) builds: no dot or AMX kernel, and calling them
    anyway is refused (-2) with nothing written."""
    from llm_serving.model_executor.layers.custom_op import load_layer_ops
    narrow = load_layer_ops(flags)
    assert narrow.lls_bf16_dot_built() == 0 and narrow.lls_amx_init() == 0
    x = np.ones((2, 64), np.float32)
    for kernel in ("amx", "dot"):
        rc, y = _tiles_run(narrow, kernel, x, bf16_bits(np.ones((32, 64), np.float32)),
                           np.zeros(32, np.float32))
        assert rc == -2 and np.isnan(y).all()


def test_bf16_kernel_is_chosen_by_measurement_and_cached(fresh_plan):
    """Without forcing, a bf16 layer's kernel is the one the probe timed fastest for its shape,
    every kernel this CPU runs timed; the choice is saved, and a later process (a new plan)
    takes it from the cache without probing."""
    from llm_serving.model_executor.layers import gemm
    layer, _ = _bf16_layer(256, 512)
    times = gemm.gemm_plan().timings["bf16:256,512"]
    assert set(times) == set(gemm.bf16_kernels())
    if len(times) > 1:
        assert all(t > 0 for t in times.values())
    assert layer.bf16_kernel == min(times, key=times.get)
    again = gemm.GemmPlan(gemm.cache_path())
    again.probe_bf16 = None                         # a probe now would fail
    assert again.choose_bf16(layer) == layer.bf16_kernel


def test_plans_probed_among_fewer_kernels_are_not_reused(fresh_plan):
    """A plan cached by a process that could run fewer kernels (a build without AVX-512, or
    without OpenBLAS) is another file: a process that runs more probes its shapes anew instead
    of taking choices that never timed its other kernels. With the same kernels, the same
    file."""
    from llm_serving.model_executor.layers import gemm
    layer, _ = _bf16_layer(256, 512)
    full = gemm.cache_path()
    assert full.exists() and "bf16:256,512" in full.read_text()
    real_bf16, real_gemm = gemm.bf16_kernels(), gemm.available()
    fresh_plan.setattr(gemm, "bf16_kernels", lambda: ("widen",))
    assert (gemm.cache_path() == full) == (real_bf16 == ("widen",))
    fresh_plan.setattr(gemm, "bf16_kernels", lambda: real_bf16)
    fresh_plan.setattr(gemm, "available", lambda: ("kernel",))
    assert (gemm.cache_path() == full) == (real_gemm == ("kernel",))


@pytest.mark.parametrize("m", [1, 2, 11, 12, 13, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 17), (67, 64), (130, 768), (300, 2048)])
def test_bf16_activation_kernels_match_float64_on_rounded_inputs_and_weights(m, n, k):
    """amx and dot, where this CPU runs them: y = bf16(x) @ bf16(W).T + b with float32 sums,
    within fp32 tolerance of float64 on the rounded values (N and K tails padded with zeros,
    any M), and batch-invariant: a row alone or at any place in the batch gives the same
    bits."""
    from llm_serving.model_executor.layers import gemm
    from llm_serving.model_executor.layers.custom_op import cpu_layer_ops
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    ref = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64).T + b
    for kernel in (c for c in gemm.bf16_kernels() if c != "widen"):
        rc, y = _tiles_run(cpu_layer_ops(), kernel, x, bf16_bits(w), b)
        assert rc == 0
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=kernel)
        for off, rows in ((0, 1), (m // 2, 1), (m - 1, 1), (1, m - 1)):
            if rows > 0 and off + rows <= m:
                part = _tiles_run(cpu_layer_ops(), kernel, np.ascontiguousarray(
                    x[off:off + rows]), bf16_bits(w), b)[1]
                np.testing.assert_array_equal(part, y[off:off + rows], err_msg=kernel)


@pytest.mark.parametrize("m", [16, 32, 33, 64, 100])
@pytest.mark.parametrize("parts", [[160], [64, 96], [40, 120]])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_activation_kernels_write_each_output_part(m, parts, with_bias):
    """amx and dot into split outputs (a fused qkv writes q, k and v apart), each part with a
    row stride wider than it, with and without a bias: every part gets its columns, within
    fp32 tolerance of float64 on the rounded values, and nothing past a part's width or past
    the last row is written (whole 32-column blocks go straight from the AMX tiles to the
    output when no bias is added)."""
    from llm_serving.model_executor.layers import gemm
    from llm_serving.model_executor.layers.custom_op import cpu_layer_ops
    k, n, pad = 96, sum(parts), 8
    rng = np.random.default_rng(m + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if with_bias else None
    ref = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64).T + (0 if b is None else b)
    wp = gemm.pack_weight_amx(bf16_bits(w))
    split = np.concatenate([[0], np.cumsum(parts)])
    for kernel in (c for c in gemm.bf16_kernels() if c != "widen"):
        fn = {"amx": cpu_layer_ops().lls_linear_bf16_amx,
              "dot": cpu_layer_ops().lls_linear_bf16_dot}[kernel]
        outs = [np.full((m + 1, p + pad), np.nan, np.float32) for p in parts]
        rc = fn(x.ctypes.data, k, wp.ctypes.data, None if b is None else b.ctypes.data, m, n, k,
                len(parts), (ctypes.c_int64 * len(split))(*split.tolist()),
                (ctypes.c_void_p * len(parts))(*[o.ctypes.data for o in outs]),
                (ctypes.c_int64 * len(parts))(*[o.shape[1] for o in outs]))
        assert rc == 0
        for o, lo, hi in zip(outs, split[:-1], split[1:]):
            np.testing.assert_allclose(o[:m, :hi - lo], ref[:, lo:hi], rtol=1e-4,
                                       atol=1e-4 * np.sqrt(k), err_msg=kernel)
            assert np.isnan(o[:, hi - lo:]).all() and np.isnan(o[m]).all(), kernel


def _bf16_layer(n, k, parts=None, seed=7):
    from llm_serving.model_executor.device import init_device
    from llm_serving.model_executor.layers import linear as L
    init_device("cpu")
    rng = np.random.default_rng(seed)
    parts = parts or [n]
    layer = L.Linear(k, parts, bias=True, split_output=len(parts) > 1)
    w = rng.standard_normal((n, k)).astype(np.float32)
    layer.use_bf16_weight()
    layer.set_weight(w)
    layer.bias.set_data(__import__("mindspore").Tensor(rng.standard_normal(n).astype(np.float32)))
    return layer, w


@pytest.mark.parametrize("n,k", [(384, 768), (77, 100), (768, 2048)])
def test_bf16_layer_row_alone_equals_row_in_any_batch(fresh_plan, n, k):
    """Batch invariance with bf16 weights, through each bf16 kernel this CPU runs: a row's
    output has the same bits alone and inside batches of any size (decode- and prefill-sized
    tilings) at any position."""
    from mindspore import Tensor
    from llm_serving.model_executor.layers import gemm
    for kernel in gemm.bf16_kernels():
        fresh_plan.setenv("LLM_SERVING_GEMM_BF16", kernel)
        layer, w = _bf16_layer(n, k, [n - 2 * (n // 4), n // 4, n // 4])
        assert layer.weight.dtype == __import__("mindspore").uint16
        if layer.tiled:                         # tiles of 32 output columns x 32 k
            assert layer.weight.asnumpy().nbytes == -(-n // 32) * 32 * -(-k // 32) * 32 * 2
        else:
            width = gemm.panel_width()
            assert layer.weight.asnumpy().nbytes == -(-n // width) * width * k * 2  # fp32 / 2
        rng = np.random.default_rng(1)
        row = rng.standard_normal(k).astype(np.float32)

        def out(x):
            return np.concatenate([t.asnumpy() for t in layer(Tensor(x))], 1)
        alone = out(row[None])[0]
        ref = ((bf16(row) if layer.tiled else row).astype(np.float64)
               @ bf16(w).astype(np.float64).T + layer.bias.asnumpy())
        np.testing.assert_allclose(alone, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k),
                                   err_msg=kernel)
        for m in (2, 3, 5, 8, 13, 64, 257):
            for pos in {0, m // 2, m - 1}:
                x = rng.standard_normal((m, k)).astype(np.float32)
                x[pos] = row
                np.testing.assert_array_equal(out(x)[pos], alone,
                                              err_msg=f"{kernel}: {m} rows, at {pos}")


def test_bf16_layers_ignore_a_forced_fp32_implementation(monkeypatch):
    """LLM_SERVING_GEMM forces an fp32 implementation for fp32 layers only: bf16 layers have
    just our kernel (OpenBLAS and MatMul cannot read bf16)."""
    from mindspore import Tensor
    from llm_serving.model_executor.layers import gemm
    layer, w = _bf16_layer(64, 96)
    monkeypatch.setattr(gemm, "_plan", None)
    for impl in gemm.FORCEABLE:
        monkeypatch.setenv("LLM_SERVING_GEMM", impl)
        x = np.random.default_rng(2).standard_normal((5, 96)).astype(np.float32)
        ref = ((bf16(x) if layer.tiled else x).astype(np.float64)
               @ bf16(w).astype(np.float64).T + layer.bias.asnumpy())
        np.testing.assert_allclose(layer.gemm(impl, Tensor(x)).asnumpy(), ref, rtol=1e-4,
                                   atol=1e-3)


# ---- the engine against HF transformers ------------------------------------------------------

PROMPT_LENS = [1, 17, 64, 129]
NEW_TOKENS = 16


# a KV cache dtype -> (torch's dtype, the largest finite value the cache saturates to)
TORCH_KV = {"bfloat16": (torch.bfloat16, None), "float16": (torch.float16, 65504.0),
            "fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def _rounding_kv_attention(dtype, largest=None):
    """HF's sdpa attention over keys and values rounded to ``dtype`` (torch's rounding; beyond
    ``largest``, saturated to it): what a KV cache of that dtype holds."""
    def attention(module, query, key, value, attention_mask, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        if largest is not None:
            key, value = key.clamp(-largest, largest), value.clamp(-largest, largest)
        key = key.to(dtype).to(torch.float32)
        value = value.to(dtype).to(torch.float32)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    return attention



def _round_input(module, args):
    return (args[0].to(torch.bfloat16).to(torch.float32),) + tuple(args[1:])


@pytest.fixture(scope="module")
def hf_bf16(model_dirs):
    """Per variant, KV dtype and activations (fp32, or rounded to bf16 where this CPU has a
    bf16-activation kernel): HF with bf16-rounded linear weights (embedding, LM head and norms
    fp32, as ours), and for bf16 activations its linear layers' inputs rounded too; its logits
    over each prompt and its greedy tokens."""
    from llm_serving.model_executor.layers.gemm import bf16_kernels
    transformers.AttentionInterface.register("bf16_kv", _rounding_kv_attention(torch.bfloat16))
    acts = [False] + ([True] if set(bf16_kernels()) - {"widen"} else [])
    out = {}
    for name, path in model_dirs.items():
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, MODEL_VARIANTS[name]["vocab_size"], n).tolist()
                   for n in PROMPT_LENS]
        for kv in ("float32", "bfloat16"):
            for rounded in acts:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32,
                    attn_implementation="bf16_kv" if kv == "bfloat16" else "sdpa").eval()
                with torch.no_grad():
                    for pname, p in model.named_parameters():
                        if pname.endswith(".weight") and pname.split(".")[-2] in LINEAR_NAMES:
                            p.copy_(p.to(torch.bfloat16).to(torch.float32))
                if rounded:
                    for mname, mod in model.named_modules():
                        if mname.split(".")[-1] in LINEAR_NAMES:
                            mod.register_forward_pre_hook(_round_input)
                out[name, kv, rounded] = (prompts,
                                          *hf_logits_and_greedy(model, prompts, NEW_TOKENS))
    return out


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
def test_engine_matches_hf_with_the_same_rounding(model_dirs, hf_bf16, fresh_plan, name, kv):
    """--dtype bfloat16 (with an fp32 or bf16 KV cache), through each bf16 kernel this CPU
    runs: prefill logits within 5e-3 of HF running the same rounded values, and the same
    greedy tokens, for a ragged batch.

    With bf16 activations (amx, dot), ours and HF's inputs to a layer differ by fp32 noise, and
    now and then one element sits on a bf16 rounding boundary and rounds the other way: that
    position, and through attention every later one, then differs by up to a few 1e-2 (measured
    on AMX: identical to 1e-5 up to the first such flip, at positions 15-27 here; 0.02-0.14
    against HF rounding weights only). So there, a prompt's first positions must agree within
    5e-3, the rest within 0.1, and greedy tokens (whose margins on these random models are
    smaller than a flip) are not compared."""
    from llm_serving.engine.input_builder import build_step_input
    from llm_serving.model_executor.layers import gemm
    for kernel in gemm.bf16_kernels():
        fresh_plan.setenv("LLM_SERVING_GEMM_BF16", kernel)
        rounded = kernel != "widen"
        prompts, ref_logits, ref_tokens = hf_bf16[name, kv, rounded]
        llm = LLM(model_dirs[name], dtype="bfloat16", kv_cache_dtype=kv, num_blocks=128)
        eng = llm.engine
        assert eng.runner.model.model.layers[0].self_attn.qkv_proj.bf16_kernel == kernel
        rids = [eng.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=1))
                for p in prompts]
        batch = eng.scheduler.schedule()
        step = build_step_input(batch, eng.config.cache.block_size, set()).step
        logits = eng.runner.forward(step, np.arange(len(step.input_ids)))
        for rid in rids:
            eng.abort_request(rid)
        for ours, ref in zip(np.split(logits, np.cumsum(PROMPT_LENS)[:-1]), ref_logits):
            if rounded:
                np.testing.assert_allclose(ours[:8], ref[:8], atol=5e-3, rtol=0, err_msg=kernel)
                np.testing.assert_allclose(ours, ref, atol=0.1, rtol=0, err_msg=kernel)
            else:
                np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0, err_msg=kernel)
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        if not rounded:
            assert [o.outputs[0].token_ids for o in outs] == ref_tokens
        eng.shutdown()


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_narrow_kv_cache_without_bf16_weights_matches_hf(model_dirs, kv):
    """--kv-cache-dtype bfloat16, float16 or an FP8 alone: HF with fp32 weights and K/V
    rounded to it by torch."""
    transformers.AttentionInterface.register(f"{kv}_kv", _rounding_kv_attention(*TORCH_KV[kv]))
    name = "llama3-gqa"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dirs[name], dtype=torch.float32, attn_implementation=f"{kv}_kv").eval()
    prompt = np.random.default_rng(9).integers(3, 1024, 40).tolist()
    with torch.no_grad():
        g = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    llm = LLM(model_dirs[name], kv_cache_dtype=kv, num_blocks=64)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                      min_tokens=NEW_TOKENS))[0]
    assert out.outputs[0].token_ids == g[0, len(prompt):].tolist()
    llm.engine.shutdown()


@pytest.mark.parametrize("kv,storage,skip", [("bfloat16", np.uint16, None),
                                             ("float16", np.float16, None),
                                             ("fp8", ml_dtypes.float8_e4m3fn, None),
                                             ("fp8_e5m2", ml_dtypes.float8_e5m2, None),
                                             ("fp8", ml_dtypes.float8_e4m3fn, ["1"])])
def test_narrow_kv_swap_and_prefix_caching_keep_outputs(tiny_model_dir, kv, storage, skip):
    """With a bf16, fp16 or FP8 KV cache (or FP8 with layer 1 at fp32:
    kv_cache_dtype_skip_layers), sequences swapped out to the host pool (of the same dtypes)
    and back, and prompts served from cached prefix blocks, give the tokens of an unpressured
    run."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 1024, 48).tolist()
    prompts = [{"prompt_token_ids": prefix + rng.integers(3, 1024, 8).tolist()}
               for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_model_dir, kv_cache_dtype=kv, kv_cache_dtype_skip_layers=skip,
                num_blocks=256)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, greedy)]
    roomy.engine.shutdown()
    tight = LLM(tiny_model_dir, kv_cache_dtype=kv, kv_cache_dtype_skip_layers=skip,
                num_blocks=24, preemption_mode="swap", swap_space=0.01,
                enable_prefix_caching=True)
    assert [h[0].dtype for h in tight.engine.runner.host_caches] == \
        [storage, np.float32 if skip else storage]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy)]
    stats = tight.engine.get_stats()
    again = tight.generate(prompts[0], greedy)[0]
    tight.engine.shutdown()
    assert got == want
    assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens >= 48
    assert stats.num_swap_preemptions > 0          # the pool was really used


def test_tensor_parallel_with_bf16_weights_and_kv(tiny_model_dir):
    """Two WorkAgents, each rounding its own shard of the weights and holding its KV heads in
    bf16, give the greedy tokens of one process with the same precisions."""
    prompts = ["Give three tips for staying healthy.", "What is the capital of France?"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        llm = LLM(tiny_model_dir, tensor_parallel_size=tp, dtype="bfloat16",
                  kv_cache_dtype="bfloat16", num_blocks=64)
        got[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.engine.shutdown()
    assert got[2] == got[1]


# ---- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv,times,storage", [("bfloat16", 2, "bfloat16"),
                                              ("float16", 2, "float16"),
                                              ("fp8", 4, "fp8_e4m3"), ("fp8_e5m2", 4, "fp8_e5m2")])
def test_narrow_kv_multiplies_the_blocks_of_the_same_space(tiny_model_dir, kv, times, storage):
    f32 = EngineArgs(tiny_model_dir, kv_cache_space=0.01).create_engine_config()
    narrow = EngineArgs(tiny_model_dir, kv_cache_space=0.01,
                        kv_cache_dtype=kv).create_engine_config()
    assert narrow.cache.num_blocks // times == f32.cache.num_blocks  # the same bytes (floored)
    assert (f32.model.kv_cache_dtype, narrow.model.kv_cache_dtype) == ("auto", kv)
    assert narrow.model.kv_storage_dtype == storage


@pytest.mark.parametrize("kwargs,key", [
    (dict(dtype="float16"), "dtype"),
    (dict(dtype="int8"), "dtype"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8", device="ascend"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="bfloat16", device="ascend"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="float32", device="ascend"), "kv_cache_dtype"),
])
def test_unsupported_precisions_name_the_key(tiny_model_dir, kwargs, key):
    with pytest.raises(ConfigError) as e:
        EngineArgs(tiny_model_dir, **kwargs).create_engine_config()
    assert e.value.key == key


def test_ascend_takes_float16_kv_by_name(tiny_model_dir):
    """Ascend's KV cache is float16 whatever is asked: auto and float16 both give it, sized
    at 2 bytes a value (float32 and bfloat16 are refused above)."""
    auto, f16 = (EngineArgs(tiny_model_dir, kv_cache_dtype=kv, device="ascend",
                            kv_cache_space=0.01).create_engine_config()
                 for kv in ("auto", "float16"))
    assert auto.model.kv_storage_dtype == f16.model.kv_storage_dtype == "float16"
    assert auto.cache.num_blocks == f16.cache.num_blocks


def test_bf16_weights_need_our_kernels(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
    with pytest.raises(ConfigError, match="dtype"):
        EngineArgs(tiny_model_dir, dtype="bfloat16").create_engine_config()


# ---- the real server -------------------------------------------------------------------------

def test_server_with_bf16_weights_and_kv(tmp_path, tiny_model_dir):
    """start.py --dtype bfloat16 --kv-cache-dtype bfloat16, driven by the openai client: the
    completion is the offline engine's greedy output with the same precisions."""
    import openai
    from test_http_server import start_server, stop_server
    proc, url, _ = start_server(tmp_path, tiny_model_dir, "--dtype", "bfloat16",
                                "--kv-cache-dtype", "bfloat16")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        r = client.completions.create(model="tiny", prompt="Give three tips for staying healthy.",
                                      max_tokens=12, temperature=0.0)
        text = r.choices[0].text
    finally:
        assert stop_server(proc) == 0
    llm = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="bfloat16", num_blocks=64)
    want = llm.generate("Give three tips for staying healthy.",
                        SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    llm.engine.shutdown()
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    assert text == want
