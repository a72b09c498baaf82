"""GEMM for the CPU linear layers, chosen by measurement on the CPU it runs on.

``y = x @ W.T``, with W [out, in] packed once at load time into panels of ``panel_width()``
output columns (``pack_weight``: panel p is a row-major [in, width] block, zero-padded at the
end), can run through:
- ``kernel``: our kernel (``lls_linear_f32``): every output is one scalar FMA chain over k in
  order, computed by register tiles of R rows x one or two panels (an outer product per k
  step), the weight read as one contiguous stream per panel. At a few rows (decode at small
  batch) it reads the weights at close to memory bandwidth; at many rows it is bound by its
  FMAs (60-75% of an Intel Xeon core's AVX-512 FMA peak at 128-256 rows);
- ``openblas``: OpenBLAS's sgemm (the ``scipy-openblas32`` wheel, micro-kernels dispatched at
  run time for the CPU), single-threaded, called per panel from our shared thread pool
  (``lls_linear_blas_f32``), so it shares the cores with the attention and element-wise
  kernels instead of fighting them with threads of its own.

Layers with bfloat16 weights (``--dtype bfloat16``, ``Linear.use_bf16_weight``) run one of our
bf16 kernels (neither OpenBLAS nor MindSpore's MatMul reads bf16 on CPU):
- ``widen``: ``lls_linear_bf16``, weights widened to fp32 in registers, the fp32 kernel's FMA
  chains (fp32 activations); every CPU;
- ``amx``: ``lls_linear_bf16_amx``, inputs rounded to bf16, products on AMX tiles, float32
  sums; CPUs with amx_bf16;
- ``dot``: ``lls_linear_bf16_dot``, inputs rounded to bf16, AVX512-BF16 dot products
  (VDPBF16PS), float32 sums; CPUs with avx512_bf16 (AMD Zen 4, Intel Xeon since Cooper Lake).
``amx`` and ``dot`` read the weight in AMX tiles (``pack_weight_amx``), ``widen`` in the fp32
panels. The layout is set before the weights load, so these are probed when the layer turns
bf16 (``GemmPlan.choose_bf16``), on random weights of the layer's shape (as many copies as the
model has layers of that shape, up to ``_PROBE_BF16_BYTES``), and cached like the fp32 choices
(keys "bf16:N,K"). Each is batch-invariant, so the choice is per shape, for every row count.
``LLM_SERVING_GEMM_BF16=widen|amx|dot`` forces one (``widen``: fp32 activations, the
numerics of every CPU without bf16 arithmetic).

W8A8 int8 layers (``Linear.use_int8_weight``: vLLM's compressed-tensors "int-quantized"
checkpoints, int8 weights with float32 per-output-channel scales) run ``lls_linear_int8``
(``cpu_linear_int8``): the float32 activations quantized to int8 per token (sx = max |x| / 127,
xq = clamp(rint(x * (1 / sx)), -128, 127), half to even, a zero row all zeros) or with one
static scale, exact int32 sums (AVX512-VNNI / AVX-VNNI VPDPBUSD on xq + 128 with a
128 * colsum compensation; without VNNI the bytes widened to int16 and VPMADDWD, exact where
VPMADDUBSW saturates), then in float32 ``fma(float(sum) * scale[n], sx, bias[n])`` (dynamic;
``(float(sum) * scale[n]) * sx`` without a bias) or ``(float(sum) * sx) * scale[n] + bias[n]``
(static): vLLM-CPU's quantization and oneDNN int8 matmul, bit for bit in all four modes
(``bench/bench_int8_vllm_bits.py``, AMD Zen 5). The sums are exact, so rows are
batch-invariant and every build gives the same bits; nothing to probe. oneDNN's
``dnnl_gemm_u8s8s32`` (MindSpore's ``libdnnl``) is exact too but packs the weight on every
call: 1.9x our time at one row, 1.4-2.7x at 16 to 128 rows, for its integer product alone
(AMD Zen 5, docs/benchmarks.md).

MindSpore's ``MatMul`` (the layers' native path, what Ascend runs) is no candidate on CPU: in
whole model steps on AMD Zen 3 it lost to OpenBLAS at every size (decode B=16 149 vs 88 ms,
B=64 302 vs 232 ms, prefill 526 vs 578 tok/s; bench/bench_model.py with LLM_SERVING_GEMM, see
docs/benchmarks.md), and once its own threads have run they slow the candidates around it,
which a probe of one GEMM at a time does not see. ``LLM_SERVING_GEMM=matmul`` still forces it,
for benchmarks: the weights then stay unpacked. Nor is oneDNN's ``dnnl_sgemm`` (the libdnnl
MindSpore ships, or PyPI's ``onednn-cpu-gomp``): on AMD Zen 3 its rows are not bitwise alike
across row counts (``rows_alike``) on any of the 97 M model's shapes, and its time was within
the machine's noise of our kernel's (``bench/bench_linear.py`` times it and prints the check).

No single one wins every shape, and the winner changes with the CPU. So the first time a layer
shape (N, K) is used, a short probe times every candidate on the model's own weights of that
shape (streamed, as a step reads them) at a sweep of row counts (``PROBE_ROWS``) and keeps the
one with the least total time. Choices are cached in ``$LLM_SERVING_HOME/gemm``
(``~/.cache/llm_serving/gemm``), one file per CPU model + flags + usable cores + library
versions, so later starts probe nothing; each tensor-parallel rank probes its own shapes.

Batch invariance: a request's output must not depend on its batch companions, so a row's
result must not depend on how many rows the GEMM has or where the row sits. Hence one
implementation per shape for every row count (switching at some M changes the sums' rounding),
and only implementations whose rows the probe finds bitwise alike across row counts and
positions (``batch_invariant``). Our kernel is, by construction (each output is one FMA chain
in a fixed order, whatever the tile). OpenBLAS's sgemm is not on AMD Zen 3 nor on an Intel
Xeon with AVX-512 (its micro-kernels for the rows past the last full tile, and some positions
within a tile, sum in another order), so there the kernel serves every shape.
``LLM_SERVING_GEMM_PER_BUCKET=1`` instead picks per (N, K, row bucket): outputs then depend
on the batch (at the last bits, which can flip a sampled token).

``LLM_SERVING_GEMM=openblas|kernel|matmul`` forces one implementation (benchmarks, debugging).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import tempfile
import time
import weakref
from functools import lru_cache
from pathlib import Path

import numpy as np
from mindspore import Tensor
from mindspore import dtype as mstype

from llm_serving.home import home_dir
from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.layers.custom_op import cpu_layer_ops, row_stride

CANDIDATES = ("openblas", "kernel")
FORCEABLE = CANDIDATES + ("matmul",)
MAX_BUCKET = 4096
# Row counts the per-shape probe sweeps: batch-1 decode, small and large decode batches.
PROBE_ROWS = (1, 16, 64, 256)
# Work per timed pass of the probe: enough to stream a decode step's weights of one shape at
# small M, one matrix at large M; the whole probe of a bucket stays in the tens of ms.
_PROBE_FLOPS = 2e8
_PROBE_REPS = 2
# Bytes of random weights per layout the bf16 probe streams at most (a decode step's reads of
# one shape, without holding a large model's worth twice).
_PROBE_BF16_BYTES = 256 << 20


def m_bucket(m: int) -> int:
    """The probe's row bucket for ``m`` rows: the next power of two (capped at MAX_BUCKET)."""
    return min(MAX_BUCKET, 1 << max(0, int(m) - 1).bit_length())


@lru_cache(maxsize=None)
def openblas_sgemm() -> int | None:
    """Address of scipy-openblas32's cblas_sgemm with its own threading off, or None when the
    wheel is not installed."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(),
                                   f"lib{scipy_openblas32.get_library()}.so"))
    lib.scipy_openblas_set_num_threads.argtypes = [ctypes.c_int]
    lib.scipy_openblas_set_num_threads(1)          # our pool runs the blocks
    return ctypes.cast(lib.scipy_cblas_sgemm, ctypes.c_void_p).value


def available() -> tuple[str, ...]:
    return tuple(c for c in CANDIDATES if c != "openblas" or openblas_sgemm() is not None)


def panel_width() -> int:
    """Output columns per panel of the packed weight layout, for this CPU's kernel build."""
    return cpu_layer_ops().lls_layer_ops_panel_width()


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``align``-byte boundary (a panel's k
    step then never straddles cache lines)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def packed_shape(n: int, k: int, width: int | None = None) -> tuple[int, int, int]:
    """The shape of W [n, k] packed in panels of ``width`` (default: this CPU's) columns."""
    width = width or panel_width()
    return -(-n // width), k, width


def pack_weight(w: np.ndarray, width: int | None = None, alloc=aligned_empty) -> np.ndarray:
    """W [N, K] (float32, or uint16 bf16 bits) in the kernels' layout: [ceil(N / width), K,
    width], panel p holding columns [p * width, (p + 1) * width) of y, zero-padded past N.
    ``alloc(shape, dtype)``: where the packed array goes (a model's weights:
    ``host_memory.WEIGHTS.empty``)."""
    n, k = w.shape
    shape = packed_shape(n, k, width)
    width = shape[2]
    full, rest = divmod(n, width)
    out = alloc(shape, w.dtype)
    if full:
        out[:full] = w[:full * width].reshape(full, width, k).transpose(0, 2, 1)
    if rest:
        out[full] = 0
        out[full, :, :rest] = w[full * width:].T
    return out


BF16_KERNELS = ("amx", "dot", "widen")
TILED_BF16_KERNELS = ("amx", "dot")     # read the weight as packed by pack_weight_amx
# Each bf16 kernel's entry point in the layer-ops library.
_BF16_ENTRY = {"amx": "lls_linear_bf16_amx", "dot": "lls_linear_bf16_dot",
               "widen": "lls_linear_bf16"}


def bf16_kernels() -> tuple[str, ...]:
    """The bf16-weight kernels this build and process can run (``BF16_KERNELS`` order)."""
    lib = cpu_layer_ops()
    have = {"amx": _amx_usable(), "dot": lib.lls_bf16_dot_built() == 1, "widen": True}
    return tuple(c for c in BF16_KERNELS if have[c])


@lru_cache(maxsize=None)
def _amx_usable() -> bool:
    return cpu_layer_ops().lls_amx_init() == 1


AMX_TILE_ROWS, AMX_TILE_K = 16, 32


def amx_packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The shape of W [n, k] packed for the AMX kernel: [N/32, K/32, 2 tiles x 16 rows, 32],
    N padded to 32, K to 32."""
    return -(-n // 32), -(-k // AMX_TILE_K), 2 * AMX_TILE_ROWS, AMX_TILE_K


def pack_weight_amx(bits: np.ndarray, alloc=aligned_empty) -> np.ndarray:
    """W [N, K] as bf16 bits (uint16) in the AMX kernel's tiles (``lls_linear_bf16_amx``):
    out[j, kb, 16 t + r] is row r of the tile of columns [32 j + 16 t, 32 j + 16 t + 16) of y
    over k in [32 kb, 32 kb + 32): the pairs (W[n, 32 kb + 2r], W[n, 32 kb + 2r + 1]) for its
    16 n, interleaved. ``alloc`` as for ``pack_weight``."""
    n, k = bits.shape
    nj, kt, _, _ = amx_packed_shape(n, k)
    padded = np.zeros((nj * 32, kt * 32), np.uint16)
    padded[:n, :k] = bits
    # [j, t, n16, kb, r, 2] -> [j, kb, t, r, n16, 2]
    tiles = padded.reshape(nj, 2, 16, kt, 16, 2).transpose(0, 3, 1, 4, 2, 5)
    out = alloc(amx_packed_shape(n, k), np.uint16)
    out[...] = tiles.reshape(out.shape)
    return out


class LinearCall:
    """Constant ctypes arguments for one weight's kernel calls, with outputs in parts: either
    one [M, N] buffer (part p at column offsets[p] of each row), or with ``split`` each part
    as its own contiguous [M, size] block of one buffer."""

    def __init__(self, sizes):
        n = len(sizes)
        self.nparts = n
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self.offsets = offsets
        self.n = offsets[-1]
        self.c_split = (ctypes.c_int64 * (n + 1))(*offsets)
        self.ld_split = (ctypes.c_int64 * n)(*sizes)
        self.ld_fused = (ctypes.c_int64 * n)(*([self.n] * n))
        self.out_type = ctypes.c_void_p * n


def cpu_linear(x: Tensor, packed: Tensor, call: LinearCall, bias=None, split: bool = False,
               impl: str = "kernel", bf16: str | None = None):
    """x [M, K] @ W.T (+ bias) on the CPU, W [call.n, K] packed (``pack_weight``), with our
    kernel (``impl="kernel"``) or OpenBLAS's sgemm run from our pool (``impl="openblas"``);
    with ``bf16`` (one of ``BF16_KERNELS``) the weight holds bfloat16 bits (uint16), packed by
    ``pack_weight_amx`` for "amx" and "dot", and that bf16 kernel runs (``impl`` must be
    "kernel"). Returns a new Tensor [M, N], or, with ``split``, one contiguous Tensor per part
    of ``call`` (q, k, v of a fused qkv)."""
    m, k = x.shape
    if bf16 is not None and bf16 not in BF16_KERNELS:
        raise ValueError(f"bf16 kernel {bf16!r} is not one of {', '.join(BF16_KERNELS)}")
    tiles = packed.ndim == 4        # bf16 in AMX tiles (pack_weight_amx)
    if tiles != (bf16 in TILED_BF16_KERNELS):
        raise ValueError(f"weight {packed.shape} is not in the layout the {bf16 or 'fp32'} "
                         "kernel reads")
    if tiles:
        if tuple(packed.shape) != amx_packed_shape(call.n, k):
            raise ValueError(f"AMX-packed weight {packed.shape} does not hold bf16 "
                             f"[{call.n}, {k}]")
    else:
        panels, pk, width = packed.shape
        if pk != k or panels * width < call.n or (panels - 1) * width >= call.n:
            raise ValueError(f"packed weight {packed.shape} does not hold [{call.n}, {k}]")
    flat, out, ld = _outputs(m, call, split)
    args = (x.data_ptr(), row_stride(x) if m > 1 else k, packed.data_ptr(),
            bias.data_ptr() if bias is not None else None, m, call.n, k, call.nparts,
            call.c_split, out, ld)
    lib = cpu_layer_ops()
    if bf16:
        if impl != "kernel":
            raise ValueError(f"bfloat16 weights run on our kernel only, not {impl}")
        rc = cpu_graph.launch(getattr(lib, _BF16_ENTRY[bf16]), *args)
    elif impl == "kernel":
        rc = cpu_graph.launch(lib.lls_linear_f32, *args)
    else:
        rc = cpu_graph.launch(lib.lls_linear_blas_f32, openblas_sgemm(), _BLAS_ITEMS, *args)
    if rc == -2:
        raise RuntimeError(f"the bf16 {bf16} linear kernel cannot run here: this build or "
                           "process lacks its instructions (set LLM_SERVING_GEMM_BF16=widen)")
    if rc:
        raise ValueError(f"{impl} linear failed on x {x.shape}, weight {packed.shape}: "
                         "inconsistent arguments, or a work buffer could not be allocated")
    return _results(flat, m, call, split)


def _outputs(m: int, call: LinearCall, split: bool):
    """A linear kernel's output buffer for ``m`` rows (the CPU graph arena's during a capture)
    and its ctypes part pointers and row strides."""
    flat = cpu_graph.empty(m * call.n, np.float32)
    base = flat.ctypes.data
    offs = call.offsets
    if split:
        return flat, call.out_type(*[base + 4 * m * o for o in offs[:-1]]), call.ld_split
    return flat, call.out_type(*[base + 4 * o for o in offs[:-1]]), call.ld_fused


def _results(flat: np.ndarray, m: int, call: LinearCall, split: bool):
    """The Tensor [m, N] on ``flat``, or with ``split`` one contiguous Tensor per part."""
    if not split:
        return Tensor.from_numpy(flat.reshape(m, call.n))
    offs = call.offsets
    return tuple(Tensor.from_numpy(flat[m * a:m * b].reshape(m, b - a))
                 for a, b in zip(offs[:-1], offs[1:]))


# W8A8 int8 (``Linear.use_int8_weight``): panels of 16 output columns, K in groups of 4, one
# 64-byte line per (panel, group); N padded to a multiple of 64, K to 4 (lls_linear_int8).
INT8_PAD_N, INT8_PANEL = 64, 16
# The most inputs the int8 kernel takes: K * 255 * 128 stays within int32.
INT8_MAX_K = 65536


def int8_packed_shape(n: int, k: int) -> tuple[int, int, int]:
    """The shape of int8 W [n, k] packed for ``lls_linear_int8``: [panels, ceil(k / 4), 64]."""
    return -(-n // INT8_PAD_N) * (INT8_PAD_N // INT8_PANEL), -(-k // 4), 4 * INT8_PANEL


def pack_weight_int8(q: np.ndarray, alloc=aligned_empty) -> np.ndarray:
    """int8 W [N, K] in the int8 kernel's layout: out[p, g, 4 c + j] = W[16 p + c, 4 g + j],
    zero past N and K. ``alloc`` as for ``pack_weight``."""
    n, k = q.shape
    shape = int8_packed_shape(n, k)
    panels, groups, _ = shape
    padded = np.zeros((panels * INT8_PANEL, groups * 4), np.int8)
    padded[:n, :k] = q
    out = alloc(shape, np.int8)
    out[...] = padded.reshape(panels, INT8_PANEL, groups, 4).transpose(0, 2, 1, 3).reshape(shape)
    return out


def int8_compensation(q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """128 * sum_k W[n, k] (int32, zero past N to the packed width): what the kernel takes off
    its u8 x s8 sums, whose activations it holds as xq + 128. Into ``out`` if given."""
    n, k = q.shape
    if out is None:
        out = aligned_empty((int8_packed_shape(n, k)[0] * INT8_PANEL,), np.int32)
    out[:n] = 128 * q.sum(1, dtype=np.int64)
    out[n:] = 0
    return out


class Int8Scales:
    """What an int8 layer's kernel reads beside the packed weight, at fixed addresses (a
    reload writes over them, so a captured CPU graph replays on the new values): the float32
    scale per output channel, the kernel's compensation (``int8_compensation``) and the static
    activation scale (a [1] array; None: dynamic, per token)."""

    def __init__(self, n: int, k: int, static: bool):
        self.n, self.k = n, k
        self.packed_shape = int8_packed_shape(n, k)
        self.scale = np.zeros(n, np.float32)
        self.comp = aligned_empty((self.packed_shape[0] * INT8_PANEL,), np.int32)
        self.comp[...] = 0
        self.input_scale = np.zeros(1, np.float32) if static else None
        self.args = (self.comp.ctypes.data, self.scale.ctypes.data,
                     None if self.input_scale is None else self.input_scale.ctypes.data)

    def set(self, q: np.ndarray, scale: np.ndarray, input_scale: float | None) -> None:
        """The scales and compensation of int8 W ``q`` [n, k] (checked by the caller)."""
        self.scale[...] = scale.reshape(self.n)
        int8_compensation(q, out=self.comp)
        if self.input_scale is not None:
            self.input_scale[0] = input_scale


def cpu_linear_int8(x: Tensor, packed: Tensor, scales: Int8Scales, call: LinearCall, bias=None,
                    split: bool = False):
    """The W8A8 int8 linear (``lls_linear_int8``): x [M, K] float32 quantized to int8 per row
    (sx = max |x| / 127) or with the static scale, times the int8 W [call.n, K] packed by
    ``pack_weight_int8`` (exact int32 sums), then the float32 epilogue in
    vLLM-CPU's order (module docstring). Returns as ``cpu_linear``."""
    m, k = x.shape
    if x.dtype != mstype.float32:
        raise ValueError(f"the int8 linear quantizes float32 activations, not {x.dtype}")
    if k != scales.k or call.n != scales.n or packed.shape != scales.packed_shape:
        raise ValueError(f"int8-packed weight {packed.shape} does not hold [{call.n}, {k}]")
    flat, out, ld = _outputs(m, call, split)
    rc = cpu_graph.launch(cpu_layer_ops().lls_linear_int8, x.data_ptr(),
                          row_stride(x) if m > 1 else k, packed.data_ptr(), *scales.args,
                          bias.data_ptr() if bias is not None else None, m, call.n, k,
                          call.nparts, call.c_split, out, ld)
    if rc:
        raise ValueError(f"int8 linear failed on x {x.shape}, weight {packed.shape}: "
                         "inconsistent arguments (K over 65536), or a work buffer could not "
                         "be allocated")
    return _results(flat, m, call, split)


# Blocks of panels for OpenBLAS: a few per core, so the pool balances them.
_BLAS_ITEMS = 4 * max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1))


def _versions() -> str:
    import mindspore
    try:
        import scipy_openblas32
        ob = scipy_openblas32.__version__
    except ImportError:
        ob = "none"
    from llm_serving.model_executor.layers.custom_op import LAYER_OPS_ABI
    return f"ms={mindspore.__version__}|openblas={ob}|ops={LAYER_OPS_ABI}"


def cache_path() -> Path:
    from llm_serving.model_executor.cpp_build import _cpu_signature
    root = home_dir()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # The candidates too: a choice among fewer kernels (a build without AVX-512, e.g. with
    # LLM_SERVING_CXX, or no scipy-openblas32) must not stand for a process that runs more;
    # such a plan had widen serving bf16 B=64 decode at 1.4x dot's time (AMD Zen 4).
    cands = f"gemm={','.join(available())}|bf16={','.join(bf16_kernels())}"
    key = f"{_cpu_signature()}|cores={cores}|{_versions()}|{cands}"
    return root / "gemm" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


class GemmPlan:
    """The chosen candidate per (N, K, M bucket), probed on first use and cached on disk."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.choices: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self.layers: dict[tuple[int, int], "weakref.WeakSet"] = {}
        self.forced = os.environ.get("LLM_SERVING_GEMM") or None
        self.per_bucket = os.environ.get("LLM_SERVING_GEMM_PER_BUCKET") == "1"
        if self.forced is not None and self.forced not in FORCEABLE:
            from llm_serving.errors import ConfigError
            raise ConfigError("LLM_SERVING_GEMM", f"{self.forced!r} is not one of "
                              f"{', '.join(FORCEABLE)}")
        if self.forced == "openblas" and openblas_sgemm() is None:
            from llm_serving.errors import ConfigError
            raise ConfigError("LLM_SERVING_GEMM", "openblas needs the scipy-openblas32 "
                              "package (pip install scipy-openblas32)")
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                self.choices = {k: v for k, v in data.get("choices", {}).items()
                                if v in (bf16_kernels() if k.startswith("bf16:")
                                         else available())}
            except (OSError, ValueError):
                self.choices = {}

    def register(self, layer) -> None:
        """Remember a layer, so a probe of its shape can stream all weights of that shape."""
        self.layers.setdefault(tuple(layer.gemm_shape), weakref.WeakSet()).add(layer)

    def choose(self, layer, m: int) -> str:
        """The implementation for ``m`` rows through ``layer``."""
        if self.forced is not None:
            return self.forced
        n, k = layer.gemm_shape
        bucket = m_bucket(m)
        key = f"{n},{k},{bucket}" if self.per_bucket else f"{n},{k}"
        choice = self.choices.get(key)
        if choice is None:
            with cpu_graph.paused():            # the probe's GEMMs are not the step's
                choice = self.probe(layer, key, [bucket] if self.per_bucket else PROBE_ROWS)
        return choice

    def probe(self, layer, key: str, rows) -> str:
        """Time each eligible candidate (every available one, or without per-bucket choices
        every available one that is batch-invariant on this shape) on the weights of
        ``layer``'s shape at each of ``rows`` rows; keep the one with the least total time for
        ``key`` and save the plan."""
        n, k = layer.gemm_shape
        cands = [c for c in available()
                 if self.per_bucket or c == "kernel" or batch_invariant(layer, c)]
        layers = [layer] + [l for l in self.layers.get((n, k), ()) if l is not layer]

        def run(c, x, count):
            for layer_ in layers[:count]:
                y = layer_.gemm(c, x)
            return y
        return self._time_and_keep(key, cands, rows, (n, k), len(layers), run)

    def _time_and_keep(self, key: str, cands, rows, shape, copies: int, run) -> str:
        """Time ``run(c, x, count)`` (``count`` GEMMs of candidate ``c`` on x, up to
        ``copies`` distinct weights, returning the last output) for each candidate at each of
        ``rows`` rows, interleaved so all see the same machine load, best of ``_PROBE_REPS``;
        keep the one with the least total time for ``key`` and save the plan."""
        n, k = shape
        totals = dict.fromkeys(cands, 0.0)
        if len(cands) > 1:
            rng = np.random.default_rng(0)
            for m in rows:
                count = max(1, min(copies, int(_PROBE_FLOPS // (2.0 * m * n * k))))
                x = Tensor(rng.standard_normal((m, k), dtype=np.float32))
                best = {}
                for _ in range(_PROBE_REPS):
                    for c in cands:
                        t = time.perf_counter()
                        y = run(c, x, count)
                        (y[0] if isinstance(y, tuple) else y).asnumpy()
                        best[c] = min(best.get(c, float("inf")),
                                      (time.perf_counter() - t) / count)
                for c in cands:
                    totals[c] += best[c]
        choice = min(totals, key=totals.get)
        self.choices[key] = choice
        self.timings[key] = totals
        self.save()
        return choice

    def choose_bf16(self, layer) -> str:
        """The bf16 kernel for ``layer``'s shape (one of ``bf16_kernels()``): forced by
        ``LLM_SERVING_GEMM_BF16`` (read now: it is asked once per layer, at load), cached, or
        probed now."""
        forced = os.environ.get("LLM_SERVING_GEMM_BF16") or None
        if forced is not None:
            if forced not in bf16_kernels():
                from llm_serving.errors import ConfigError
                raise ConfigError("LLM_SERVING_GEMM_BF16", f"{forced!r} is not one of the bf16 "
                                  "kernels this CPU and build can run: "
                                  f"{', '.join(bf16_kernels())}")
            return forced
        n, k = layer.gemm_shape
        key = f"bf16:{n},{k}"
        choice = self.choices.get(key)
        if choice is None:
            with cpu_graph.paused():
                choice = self.probe_bf16(layer, key)
        return choice

    def probe_bf16(self, layer, key: str) -> str:
        """Time each bf16 kernel this CPU runs on random weights of ``layer``'s shape, as many
        copies as the model has layers of it (at most ``_PROBE_BF16_BYTES`` per layout), at
        each of ``PROBE_ROWS`` rows; keep the one with the least total time."""
        n, k = layer.gemm_shape
        cands = bf16_kernels()
        copies, weights = 1, {}
        if len(cands) > 1:
            # bf16 bits of magnitudes in [2^-7, 1) with random signs (no float32 copy of the
            # shape; the values do not change the time, and none is denormal)
            rng = np.random.default_rng(0)
            bits = rng.integers(0x3C00, 0x3F80, (n, k), dtype=np.uint16)
            bits |= rng.integers(0, 2, (n, k), dtype=np.uint16) << np.uint16(15)
            copies = max(1, min(len(self.layers.get((n, k), ())),
                                _PROBE_BF16_BYTES // (2 * n * k)))
            for c in cands:
                packed = (pack_weight_amx if c in TILED_BF16_KERNELS else pack_weight)(bits)
                weights[c] = [Tensor.from_numpy(packed)] + [
                    Tensor.from_numpy(_aligned_copy(packed)) for _ in range(copies - 1)]
        call, split = layer.gemm_call, getattr(layer, "split_output", False)

        def run(c, x, count):
            for w in weights[c][:count]:
                y = cpu_linear(x, w, call, None, split, bf16=c)
            return y
        return self._time_and_keep(key, cands, PROBE_ROWS, (n, k), copies, run)

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {}
            if self.path.exists():          # another process (rank) may have added shapes
                try:
                    merged = json.loads(self.path.read_text()).get("choices", {})
                except (OSError, ValueError):
                    merged = {}
            merged.update(self.choices)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": _versions(), "choices": merged}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass                            # a read-only home: probe again next start


def batch_invariant(layer, impl: str) -> bool:
    """Whether ``impl`` computes every row of ``layer``'s GEMM bitwise alike whatever the row
    count and the row's position (checked on a random weight of the layer's shape, split like
    the layer's outputs: zeros would agree anyway)."""
    n, k = layer.gemm_shape
    rng = np.random.default_rng(1)
    w = Tensor.from_numpy(pack_weight(rng.standard_normal((n, k), dtype=np.float32)))
    call, split = layer.gemm_call, getattr(layer, "split_output", False)

    def run(rows):
        return _rows(cpu_linear(Tensor(np.ascontiguousarray(rows)), w, call, None, split, impl))
    return rows_alike(run, k, rng)


def rows_alike(run, k: int, rng) -> bool:
    """Whether ``run`` (rows [m, k] -> outputs [m, n]) computes each row bitwise alike
    whatever the row count and the row's position: calls on slices of random rows against
    one call on all of them."""
    x = rng.standard_normal((INVARIANCE_ROWS, k), dtype=np.float32)
    ref = run(x)
    return all(np.array_equal(run(x[off:off + m]), ref[off:off + m])
               for m, off in ((1, 0), (1, 5), (3, 0), (7, 1), (13, 2), (24, 3), (33, 7),
                              (100, 9)))


# Rows of the reference call in ``rows_alike``: more than a decode-sized tile, so kernels
# with a separate path for many rows (prefill) are compared with their few-row path.
INVARIANCE_ROWS = 160


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def _rows(y) -> np.ndarray:
    if isinstance(y, tuple):
        return np.concatenate([t.asnumpy() for t in y], 1)
    return y.asnumpy()


_plan: GemmPlan | None = None


def gemm_plan() -> GemmPlan:
    """The process's plan (one per process: each WorkAgent / rank has its own)."""
    global _plan
    if _plan is None:
        _plan = GemmPlan(cache_path())
    return _plan
