"""CPU paged-attention kernels: build, load and call.

The C++ source ``cpu_paged_attention.cpp`` beside this file is compiled with g++ on first use into
a cache directory (``$LLM_SERVING_HOME/kernels`` or ``~/.cache/llm_serving/kernels``). The library
name carries a hash of the source, the compiler, the flags and the CPU, so an edit, a new compiler
or another machine gets its own build. Builds go to a temporary name and are renamed into place,
so processes building at the same time never see a half-written library.

KV cache layout (per layer): ``k_cache``, ``v_cache`` ``[num_blocks, block_size, num_kv_heads,
head_dim]``, C-contiguous, float32, bfloat16, float16 or FP8 (E4M3 or E5M2). NumPy has no
bfloat16, so a bf16 cache is a ``uint16`` array of bf16 bits; a float16 cache is a ``float16``
array, an FP8 one an ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` array (``CACHE_DTYPES``).
Narrower rows are written rounded to nearest even and widened to float32 on read; all
arithmetic stays float32. A float16 or FP8 cache stores values beyond its range (infinities
included) as its largest finite value (+-65504, +-448, +-57344); FP8 is unscaled (vLLM's
k_scale = v_scale = 1). A token's slot is ``block_id * block_size + offset``.

NumPy API (no copies; inputs are checked and errors raised as :class:`KernelArgumentError`,
or ``MemoryError`` when the kernel cannot allocate its work buffers):

* :func:`reshape_and_cache` (key, value, k_cache, v_cache, slot_mapping)
* :func:`paged_attention` (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
  scale, out=None, alibi_slopes=None) -> out
* :func:`attention_fused` (query, key, value, k_cache, v_cache, slot_mapping, block_tables,
  query_start_loc, seq_lens, scale, out=None, alibi_slopes=None) -> out: both in one call.

``alibi_slopes``: None, or float32 ``[H]``, one slope per query head: each score then gets
``slope * (key position - query position)`` added after the scale (ALiBi: Baichuan2-13B,
BLOOM), in every kind of row (new prefills, continuing chunks, decodes).

MindSpore bridge (measured with bench/bench_attention_kernel.py, 12-layer decode step, per call):

* :func:`attention_forward` (q, k, v, k_cache, v_cache, slot_mapping, block_tables,
  query_start_loc, seq_lens, scale) -> Tensor ``[T, H*D]``: **the default for PyNative**.
  q/k/v are MindSpore Tensors (column-slice views with a row stride, such as ``ops.split`` of a
  fused QKV output, are read in place); the caches are NumPy arrays owned by the caller; the
  metadata are NumPy int32 arrays. The kernel runs through ctypes on ``Tensor.data_ptr()`` (which
  waits for pending work on the tensor) and the result wraps a fresh NumPy array with
  ``Tensor.from_numpy`` (zero-copy, the Tensor keeps the array alive). About 15-20 us of
  overhead per call over the bare kernel.
* :func:`aot_attention_op` returns an ``ops.Custom(..., func_type="aot")`` running the same fused
  kernel on MindSpore tensors; the cache tensors (e.g. Parameters) are updated in place. About
  130 us of overhead per call in PyNative, but it also works inside ``mindspore.jit`` (in-place
  cache updates included), where a 12-layer graph costs about 20-35 us per call: use it when the
  model step is a jit graph.

Both paths can share one cache: allocate it as MindSpore Parameters (for the aot path) and pass
their ``asnumpy()`` views (zero-copy on CPU) to :func:`attention_forward`.

Threads: the kernels use their own small pool (all cores by default, :func:`set_num_threads`),
not OpenMP's runtime, whose spinning idle threads slow down MindSpore's next ops on two cores.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path
from typing import Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from llm_serving.errors import LLMServingError
from llm_serving.model_executor import cpp_build as _cpp
from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.cpp_build import KernelBuildError, kernel_cache_dir

__all__ = [
    "KernelBuildError",
    "KernelArgumentError",
    "SOURCE_PATH",
    "kernel_cache_dir",
    "build_library",
    "load_library",
    "has_avx512",
    "set_num_threads",
    "parallel_for_address",
    "reshape_and_cache",
    "paged_attention",
    "attention_fused",
    "attention_forward",
    "aot_attention_op",
    "aot_paged_attention_op",
    "attention_forward_aot",
]

SOURCE_PATH = Path(__file__).with_name("cpu_paged_attention.cpp")
# Added to cpp_build.BASE_FLAGS. The kernels run their own small thread pool, not OpenMP:
# libgomp's idle threads spin on the core MindSpore's next op needs. -fno-trapping-math: no
# floating-point traps are ever enabled, and without it GCC keeps float comparisons as
# branches, so the portable path's softmax exps (exp_nonpos) would not vectorize; it changes
# no computed value.
ATTENTION_FLAGS: Tuple[str, ...] = ("-mprefer-vector-width=512", "-pthread", "-fno-trapping-math")
ABI_VERSION = 3
# Cache storage per KV cache dtype name (engine argument kv_cache_dtype).
# vLLM's names for FP8; "fp8" is E4M3, as in vLLM.
CACHE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16),
                "float16": np.dtype(np.float16),
                "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
                "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
CACHE_DTYPES["fp8"] = CACHE_DTYPES["fp8_e4m3"]


class KernelArgumentError(LLMServingError, ValueError):
    """An argument passed to a kernel has the wrong dtype, layout, shape or content."""


# ---------------------------------------------------------------------------------------------
# Build and load (cpp_build does the compiling and caching)


def build_library(extra_flags: Sequence[str] = (), force: bool = False) -> Path:
    """Compile the kernel source if needed and return the path of the shared library."""
    return _cpp.build_library(SOURCE_PATH, ATTENTION_FLAGS + tuple(extra_flags), force)


_declared: set = set()
_lib_lock = threading.Lock()


def _declare(lib: ctypes.CDLL) -> None:
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.lls_abi_version.restype = ctypes.c_int
    lib.lls_abi_version.argtypes = []
    lib.lls_has_avx512.restype = ctypes.c_int
    lib.lls_has_avx512.argtypes = []
    lib.lls_last_error.restype = ctypes.c_char_p
    lib.lls_last_error.argtypes = []
    lib.lls_set_num_threads.restype = None
    lib.lls_set_num_threads.argtypes = [ctypes.c_int]
    lib.lls_get_num_threads.restype = ctypes.c_int
    lib.lls_get_num_threads.argtypes = []
    lib.lls_parallel_for.restype = None
    lib.lls_parallel_for.argtypes = [P, P, I, ctypes.c_int, I]
    lib.lls_set_parallel_threshold.restype = None
    lib.lls_set_parallel_threshold.argtypes = [I]
    for sfx in _CACHE_SUFFIX.values():
        fn = getattr(lib, "lls_reshape_and_cache" + sfx)
        fn.restype, fn.argtypes = ctypes.c_int, [P, I, P, I, P, P, P, I, I, I, I]
        fn = getattr(lib, "lls_paged_attention" + sfx)
        fn.restype = ctypes.c_int
        fn.argtypes = [P, I, P, P, P, I, P, P, I, I, I, I, I, I, I, F, P, I, P]
        fn = getattr(lib, "lls_attention_fused" + sfx)
        fn.restype = ctypes.c_int
        fn.argtypes = [P, I, P, I, P, I, P, P, P, I, P, I, P, P, I, I, I, I, I, I, I, F, P, I,
                       P]


def load_library(extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Build (if needed) and load the kernel library; one per set of extra flags."""
    flags = ATTENTION_FLAGS + tuple(extra_flags)
    lib = _cpp.load_cpp_library(SOURCE_PATH, flags)
    with _lib_lock:
        if id(lib) not in _declared:
            _declare(lib)
            if lib.lls_abi_version() != ABI_VERSION:
                raise KernelBuildError(f"Kernel library {lib._name} has an unexpected ABI version")
            _declared.add(id(lib))
    return lib


_default_lib: Optional[ctypes.CDLL] = None


def _lib() -> ctypes.CDLL:
    global _default_lib
    if _default_lib is None:
        _default_lib = load_library()
    return _default_lib


def has_avx512() -> bool:
    return bool(_lib().lls_has_avx512())


def parallel_for_address() -> int:
    """Address of ``lls_parallel_for``: the kernels' thread pool, which the other C++ kernel
    libraries (the layer ops) register so that all our kernels share one pool."""
    return ctypes.cast(_lib().lls_parallel_for, ctypes.c_void_p).value


def set_num_threads(n: int) -> None:
    """Threads used by the kernels (0: default, the number of CPUs this process may run on)."""
    _lib().lls_set_num_threads(int(n))


_OUT_OF_MEMORY = -5    # the kernel's return code when it cannot allocate its work buffers


def _raise(rc: int, what: str) -> None:
    msg = _lib().lls_last_error().decode(errors="replace")
    if rc == _OUT_OF_MEMORY:
        raise MemoryError(f"{what}: {msg}")
    raise KernelArgumentError(f"{what}: {msg} (code {rc})")


# ---------------------------------------------------------------------------------------------
# NumPy wrappers

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


def _check_cache(k_cache: np.ndarray, v_cache: np.ndarray) -> Tuple[int, int, int, int]:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, np.ndarray):
            raise KernelArgumentError(f"{name} must be a numpy.ndarray, got {type(c).__name__}")
        if c.dtype not in _CACHE_SUFFIX or c.ndim != 4 or not c.flags.c_contiguous:
            raise KernelArgumentError(
                f"{name} must be a C-contiguous float32, float16, FP8 (or uint16 bfloat16 bits) "
                f"array "
                f"[num_blocks, block_size, num_kv_heads, head_dim]; got dtype={c.dtype}, "
                f"shape={c.shape}, contiguous={c.flags.c_contiguous}"
            )
        if not c.flags.writeable:
            raise KernelArgumentError(f"{name} must be writeable")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise KernelArgumentError(
            f"k_cache and v_cache differ: {k_cache.dtype}{k_cache.shape} vs "
            f"{v_cache.dtype}{v_cache.shape}")
    return k_cache.shape  # type: ignore[return-value]


# Entry point suffix per cache storage dtype.
_CACHE_SUFFIX = {_F32: "", np.dtype(np.uint16): "_bf16", np.dtype(np.float16): "_f16",
                 CACHE_DTYPES["fp8_e4m3"]: "_f8e4m3", CACHE_DTYPES["fp8_e5m2"]: "_f8e5m2"}


def _fn(name: str, k_cache: np.ndarray):
    """The kernel entry point ``name`` for the caches' storage dtype."""
    return getattr(_lib(), name + _CACHE_SUFFIX[k_cache.dtype])


def _rows(x: np.ndarray, name: str, heads: Optional[int], head_dim: int) -> Tuple[int, int, int]:
    """Validate a [T, heads, D] or [T, heads*D] float32 array whose rows may be strided.

    Returns (T, heads, token stride in floats)."""
    if not isinstance(x, np.ndarray):
        raise KernelArgumentError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != _F32:
        raise KernelArgumentError(f"{name} must be float32, got {x.dtype}")
    if x.ndim == 3:
        if x.shape[2] != head_dim or x.strides[2] != 4 or x.strides[1] != 4 * head_dim:
            raise KernelArgumentError(
                f"{name} must be [T, heads, {head_dim}] with contiguous heads; got shape "
                f"{x.shape}, strides {x.strides}")
        h = x.shape[1]
    elif x.ndim == 2:
        if x.shape[1] % head_dim or (x.shape[1] > 1 and x.strides[1] != 4):
            raise KernelArgumentError(
                f"{name} must be [T, heads*{head_dim}] with contiguous rows; got shape {x.shape}, "
                f"strides {x.strides}")
        h = x.shape[1] // head_dim
    else:
        raise KernelArgumentError(f"{name} must be 2-D or 3-D, got shape {x.shape}")
    if heads is not None and h != heads:
        raise KernelArgumentError(f"{name} has {h} heads, expected {heads}")
    t = x.shape[0]
    stride = x.strides[0] // 4 if t > 1 else h * head_dim
    if t > 1 and (x.strides[0] % 4 or stride < h * head_dim):
        raise KernelArgumentError(f"{name} has an unsupported row stride {x.strides[0]}")
    return t, h, stride


def _check_i32(x: np.ndarray, name: str, ndim: int) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != _I32 or x.ndim != ndim or not x.flags.c_contiguous:
        raise KernelArgumentError(
            f"{name} must be a C-contiguous int32 numpy array with {ndim} dims; got "
            f"{getattr(x, 'dtype', type(x).__name__)}, shape {getattr(x, 'shape', None)}")


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


# Validated layout of the caches, memoised by identity through weak references (a dead entry never
# matches, so a recycled id is harmless). Contents may change between calls: the kernel checks
# block ids and slots on every call.
_MEMO_MAX = 256
_cache_memo: dict = {}
# The last per-step metadata set (all layers of a step pass the same arrays); strong references.
_meta_memo: list = [None]


def _cache_info(k_cache: np.ndarray, v_cache: np.ndarray):
    """(k_ptr, v_ptr, num_blocks, block_size, num_kv_heads, head_dim)"""
    e = _cache_memo.get(id(k_cache))
    if e is not None and e[0]() is k_cache and e[1]() is v_cache and k_cache.shape == e[3]:
        return e[2]
    nb, bs, kvh, d = _check_cache(k_cache, v_cache)
    info = (k_cache.ctypes.data, v_cache.ctypes.data, nb, bs, kvh, d)
    if len(_cache_memo) >= _MEMO_MAX:
        for key in [k for k, v in _cache_memo.items() if v[0]() is None]:
            del _cache_memo[key]
        if len(_cache_memo) >= _MEMO_MAX:
            _cache_memo.pop(next(iter(_cache_memo)))
    _cache_memo[id(k_cache)] = (weakref.ref(k_cache), weakref.ref(v_cache), info, k_cache.shape)
    return info


def _meta_info(slot_mapping, block_tables, query_start_loc, seq_lens):
    """(slot_ptr or 0, num_slots_tokens, bt_ptr, max_blocks, qsl_ptr, sl_ptr, num_seqs) for the
    per-step metadata; the last set is memoised (all layers of a step pass the same arrays)."""
    e = _meta_memo[0]
    if (e is not None and e[0] is slot_mapping and e[1] is block_tables
            and e[2] is query_start_loc and e[3] is seq_lens and e[5] == block_tables.shape
            and e[6] == seq_lens.shape):
        return e[4]
    s = _check_meta(block_tables, query_start_loc, seq_lens)
    if slot_mapping is not None:
        _check_i32(slot_mapping, "slot_mapping", 1)
        sm_ptr, n_sm = slot_mapping.ctypes.data, slot_mapping.shape[0]
    else:
        sm_ptr, n_sm = 0, 0
    info = (sm_ptr, n_sm, block_tables.ctypes.data, block_tables.shape[1],
            query_start_loc.ctypes.data, seq_lens.ctypes.data, s)
    _meta_memo[0] = (slot_mapping, block_tables, query_start_loc, seq_lens, info,
                     block_tables.shape, seq_lens.shape)
    return info


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray,
                      v_cache: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Write key/value rows [T, KVH, D] (or [T, KVH*D]) into their cache slots in place.

    A negative slot skips the row (padding)."""
    kc, vc, nb, bs, kvh, d = _cache_info(k_cache, v_cache)
    t, _, ks = _rows(key, "key", kvh, d)
    tv, _, vs = _rows(value, "value", kvh, d)
    _check_i32(slot_mapping, "slot_mapping", 1)
    if tv != t or slot_mapping.shape[0] != t:
        raise KernelArgumentError(
            f"key, value and slot_mapping disagree on the number of tokens: {t}, {tv}, "
            f"{slot_mapping.shape[0]}")
    rc = _fn("lls_reshape_and_cache", k_cache)(_ptr(key), ks, _ptr(value), vs, kc, vc,
                                      _ptr(slot_mapping), t, kvh, d, nb * bs)
    if rc:
        _raise(rc, "reshape_and_cache")


def _check_meta(block_tables, query_start_loc, seq_lens) -> int:
    _check_i32(block_tables, "block_tables", 2)
    _check_i32(query_start_loc, "query_start_loc", 1)
    _check_i32(seq_lens, "seq_lens", 1)
    s = seq_lens.shape[0]
    if query_start_loc.shape[0] != s + 1 or block_tables.shape[0] != s:
        raise KernelArgumentError(
            f"batch size mismatch: seq_lens has {s} entries, query_start_loc "
            f"{query_start_loc.shape[0]} (expected {s + 1}), block_tables {block_tables.shape[0]}")
    return s


def _alibi_ptr(alibi_slopes: Optional[np.ndarray], h: int) -> int:
    """The slopes' address for the kernel (0: no ALiBi), checked: float32 [h], contiguous."""
    if alibi_slopes is None:
        return 0
    if (not isinstance(alibi_slopes, np.ndarray) or alibi_slopes.dtype != _F32
            or alibi_slopes.shape != (h,) or not alibi_slopes.flags.c_contiguous):
        raise KernelArgumentError(
            f"alibi_slopes must be a contiguous float32 array [{h}] (one per query head); got "
            f"{getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}, shape "
            f"{getattr(alibi_slopes, 'shape', None)}")
    return alibi_slopes.ctypes.data


def _out_for(query: np.ndarray, t: int, h: int, d: int, out: Optional[np.ndarray]) -> Tuple[np.ndarray, int]:
    if out is None:
        out = np.empty(query.shape, dtype=np.float32)
        return out, h * d
    to, ho, os_ = _rows(out, "out", h, d)
    if to != t:
        raise KernelArgumentError(f"out has {to} rows, expected {t}")
    if not out.flags.writeable:
        raise KernelArgumentError("out must be writeable")
    return out, os_


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    scale: float, out: Optional[np.ndarray] = None,
                    alibi_slopes: Optional[np.ndarray] = None) -> np.ndarray:
    """Causal attention of a ragged batch of query rows over the paged cache.

    query: [T, H, D] or [T, H*D] float32 (rows may be strided). Sequence s owns rows
    query_start_loc[s]:query_start_loc[s+1]; its context after this step is seq_lens[s] tokens,
    already in the cache. Returns out (same shape as query)."""
    kc, vc, nb, bs, kvh, d = _cache_info(k_cache, v_cache)
    t, h, qs = _rows(query, "query", None, d)
    if h % kvh:
        raise KernelArgumentError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    _, _, btp, mb, qslp, slp, s = _meta_info(None, block_tables, query_start_loc, seq_lens)
    alibi = _alibi_ptr(alibi_slopes, h)
    out, os_ = _out_for(query, t, h, d, out)
    rc = _fn("lls_paged_attention", k_cache)(_ptr(query), qs, kc, vc, btp, mb, qslp, slp, s, t, h, kvh, d,
                                    bs, nb, float(scale), _ptr(out), os_, alibi)
    if rc:
        _raise(rc, "paged_attention")
    return out


def attention_fused(query: np.ndarray, key: np.ndarray, value: np.ndarray, k_cache: np.ndarray,
                    v_cache: np.ndarray, slot_mapping: np.ndarray, block_tables: np.ndarray,
                    query_start_loc: np.ndarray, seq_lens: np.ndarray, scale: float,
                    out: Optional[np.ndarray] = None,
                    alibi_slopes: Optional[np.ndarray] = None) -> np.ndarray:
    """reshape_and_cache(key, value, ...) followed by paged_attention(query, ...), one call."""
    kc, vc, nb, bs, kvh, d = _cache_info(k_cache, v_cache)
    t, h, qs = _rows(query, "query", None, d)
    if h % kvh:
        raise KernelArgumentError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    tk, _, ks = _rows(key, "key", kvh, d)
    tv, _, vs = _rows(value, "value", kvh, d)
    smp, nsm, btp, mb, qslp, slp, s = _meta_info(slot_mapping, block_tables, query_start_loc,
                                                  seq_lens)
    if tv != tk or nsm != tk:
        raise KernelArgumentError(
            f"key, value and slot_mapping disagree on the number of tokens: {tk}, {tv}, {nsm}")
    alibi = _alibi_ptr(alibi_slopes, h)
    out, os_ = _out_for(query, t, h, d, out)
    rc = _fn("lls_attention_fused", k_cache)(_ptr(query), qs, _ptr(key), ks, _ptr(value), vs, kc, vc, smp,
                                    tk, btp, mb, qslp, slp, s, t, h, kvh, d, bs, nb, float(scale),
                                    _ptr(out), os_, alibi)
    if rc:
        _raise(rc, "attention_fused")
    return out


# ---------------------------------------------------------------------------------------------
# MindSpore bridge, default path: ctypes on the tensors' memory (zero-copy both ways).


def _tensor_rows(x, name: str, width_unit: int) -> Tuple[int, int, int]:
    """(pointer, rows, row stride in floats) of a 2-D float32 MindSpore tensor with unit column
    stride (contiguous, or a column slice such as a split of a fused QKV output)."""
    shape = x.shape
    if len(shape) != 2 or shape[1] % width_unit:
        raise KernelArgumentError(f"{name} must be a 2-D Tensor [T, heads*{width_unit}], got {shape}")
    if x.dtype != _ms_float32():
        raise KernelArgumentError(f"{name} must be float32, got {x.dtype}")
    if x.is_contiguous():
        stride = shape[1]
    else:
        st = x.stride()
        if st[1] != 1:
            raise KernelArgumentError(f"{name} must have contiguous rows, got strides {st}")
        stride = st[0]
    return x.data_ptr(), shape[0], stride


_ms_f32 = None
_ms_tensor_cls = None


def _ms_tensor():
    global _ms_tensor_cls
    if _ms_tensor_cls is None:
        from mindspore import Tensor

        _ms_tensor_cls = Tensor
    return _ms_tensor_cls


def _ms_float32():
    global _ms_f32
    if _ms_f32 is None:
        import mindspore

        _ms_f32 = mindspore.float32
    return _ms_f32


def attention_forward(q, k, v, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray, block_tables: np.ndarray,
                      query_start_loc: np.ndarray, seq_lens: np.ndarray, scale: float,
                      alibi_slopes: Optional[np.ndarray] = None):
    """One layer of attention for the MindSpore model: writes k/v into the cache, attends.

    q: Tensor [T, H*D]; k, v: Tensor [T, KVH*D] (float32, rows may be strided views).
    k_cache/v_cache: NumPy float32, float16 (or uint16 bfloat16 bits) [num_blocks, block_size,
    KVH, D]
    owned by the caller.
    slot_mapping int32 [T], block_tables int32 [S, max_blocks], query_start_loc int32 [S+1],
    seq_lens int32 [S] as NumPy arrays. Returns a new Tensor [T, H*D] that wraps the kernel's
    output buffer (zero-copy).

    The kernel reads the tensors' memory through ``Tensor.data_ptr()``, which waits for pending
    work on the tensor (checked on MindSpore 2.10 without launch_blocking), so it is safe in
    either dispatch mode. Not usable inside ``mindspore.jit``: use :func:`aot_attention_op`."""
    kc, vc, nb, bs, kvh, d = _cache_info(k_cache, v_cache)
    qp, t, qs = _tensor_rows(q, "q", d)
    kp, tk, ks = _tensor_rows(k, "k", d)
    vp, tv, vs = _tensor_rows(v, "v", d)
    h = q.shape[1] // d
    if k.shape[1] != kvh * d or v.shape[1] != kvh * d:
        raise KernelArgumentError(f"k and v must be [T, {kvh * d}], got {k.shape} and {v.shape}")
    if h % kvh:
        raise KernelArgumentError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    smp, nsm, btp, mb, qslp, slp, s = _meta_info(slot_mapping, block_tables, query_start_loc,
                                                  seq_lens)
    if tk != tv or nsm != tk:
        raise KernelArgumentError(
            f"k, v and slot_mapping disagree on the number of tokens: {tk}, {tv}, {nsm}")
    alibi = _alibi_ptr(alibi_slopes, h)
    out = cpu_graph.empty((t, h * d), np.float32)
    rc = cpu_graph.launch(_fn("lls_attention_fused", k_cache), qp, qs, kp, ks, vp, vs, kc, vc,
                          smp, tk, btp, mb, qslp, slp, s, t, h, kvh, d, bs, nb, float(scale),
                          out.ctypes.data, h * d, alibi)
    if rc:
        _raise(rc, "attention_forward")
    return _ms_tensor().from_numpy(out)


# ---------------------------------------------------------------------------------------------
# MindSpore bridge, alternative: ops.Custom "aot" (works in PyNative and inside mindspore.jit).


def aot_attention_op():
    """ops.Custom running the fused kernel (reshape_and_cache + paged_attention).

    Call as ``op(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
    seq_lens, scale)`` with MindSpore tensors (scale: float32 Tensor of shape [1]); the caches
    are updated in place and the result has q's shape."""
    from mindspore import ops

    path = _lib()._name
    return ops.Custom(f"{path}:lls_aot_attention", out_shape=lambda q, *rest: q,
                      out_dtype=lambda q, *rest: q, func_type="aot")


def aot_paged_attention_op():
    """ops.Custom for attention only: op(q, k_cache, v_cache, block_tables, query_start_loc,
    seq_lens, scale) -> Tensor shaped like q."""
    from mindspore import ops

    path = _lib()._name
    return ops.Custom(f"{path}:lls_aot_paged_attention", out_shape=lambda q, *rest: q,
                      out_dtype=lambda q, *rest: q, func_type="aot")


_aot_op = None


def attention_forward_aot(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
                          query_start_loc, seq_lens, scale):
    """Same contract as :func:`attention_forward` but through ops.Custom: every argument is a
    MindSpore Tensor (caches included; scale a float32 Tensor [1])."""
    global _aot_op
    if _aot_op is None:
        _aot_op = aot_attention_op()
    return _aot_op(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                   seq_lens, scale)
