"""Layers with two implementations, chosen once when the layer is built.

``forward_native`` uses MindSpore ops and runs anywhere (it is what Ascend uses, with fused
kernels where MindSpore has them). ``forward_cpu`` calls the CPU backend's fused C++ kernels
on the tensors' own memory: on CPU, MindSpore's element-wise ops cost about 60 us each, more
than the matmuls around them at decode time, while these kernels cost a few microseconds.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from mindspore import Tensor, nn

from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.cpp_build import load_cpp_library

_SRC = Path(__file__).parent / "kernels" / "cpu_layer_ops.cpp"
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


# -ffp-contract=fast: a*b+c compiles to FMA (ISO C++ mode turns contraction off);
# -fopenmp-simd: the simd pragmas only, no OpenMP runtime (threads come from the shared pool).
LAYER_OPS_FLAGS = ("-ffp-contract=fast", "-fopenmp-simd")
LAYER_OPS_ABI = 15


def load_layer_ops(extra_flags=()) -> ctypes.CDLL:
    """Build (if needed) and load the layer kernels; ``extra_flags`` e.g. ``("-mno-avx512f",)``
    builds the narrower-vector variant (what a CPU without AVX-512 gets)."""
    lib = load_cpp_library(_SRC, LAYER_OPS_FLAGS + tuple(extra_flags))
    if getattr(lib, "_lls_declared", False):
        return lib
    lib.lls_layer_ops_abi_version.restype = ctypes.c_int
    lib.lls_layer_ops_abi_version.argtypes = []
    if lib.lls_layer_ops_abi_version() != LAYER_OPS_ABI:
        raise RuntimeError(f"layer kernel library {lib._name} has an unexpected ABI version")
    lib.lls_layer_ops_vector_width.restype = ctypes.c_int
    lib.lls_layer_ops_vector_width.argtypes = []
    lib.lls_layer_ops_panel_width.restype = ctypes.c_int
    lib.lls_layer_ops_panel_width.argtypes = []
    lib.lls_layer_ops_set_parallel_for.restype = None
    lib.lls_layer_ops_set_parallel_for.argtypes = [_P]
    lib.lls_layer_ops_set_linger_us.restype = None
    lib.lls_layer_ops_set_linger_us.argtypes = [_I]
    lib.lls_linear_f32.restype = ctypes.c_int
    lib.lls_linear_f32.argtypes = [_P, _I, _P, _P, _I, _I, _I, ctypes.c_int, _P, _P, _P]
    lib.lls_linear_bf16.restype = ctypes.c_int
    lib.lls_linear_bf16.argtypes = lib.lls_linear_f32.argtypes
    lib.lls_linear_bf16_amx.restype = ctypes.c_int
    lib.lls_linear_bf16_amx.argtypes = lib.lls_linear_f32.argtypes
    lib.lls_linear_bf16_dot.restype = ctypes.c_int
    lib.lls_linear_bf16_dot.argtypes = lib.lls_linear_f32.argtypes
    lib.lls_linear_int8.restype = ctypes.c_int
    lib.lls_linear_int8.argtypes = [_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, _P,
                                    _P, _P]
    lib.lls_int8_dot_kind.restype = ctypes.c_char_p
    lib.lls_int8_dot_kind.argtypes = []
    lib.lls_amx_init.restype = ctypes.c_int
    lib.lls_bf16_dot_built.restype = ctypes.c_int
    lib.lls_bf16_dot_built.argtypes = []
    lib.lls_amx_init.argtypes = []
    lib.lls_vector_exp_available.restype = ctypes.c_int
    lib.lls_vector_exp_available.argtypes = []
    lib.lls_linear_blas_f32.restype = ctypes.c_int
    lib.lls_linear_blas_f32.argtypes = [_P, _I, _P, _I, _P, _P, _I, _I, _I, ctypes.c_int, _P,
                                        _P, _P]
    lib.rms_norm_f32.argtypes = [_P, _P, _P, _I, _I, _F]
    lib.add_rms_norm_f32.argtypes = [_P, _P, _P, _P, _I, _I, _F]
    lib.head_rms_norm_f32.argtypes = [_P, _P, _I, _I, _I, _I, _F]
    lib.rotary_embedding_f32.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I]
    lib.silu_and_mul_f32.argtypes = [_P, _P, _I, _I]
    lib.layer_norm_f32.argtypes = [_P, _P, _P, _P, _I, _I, _F]
    lib.add_layer_norm_f32.argtypes = [_P, _P, _P, _P, _P, _I, _I, _F]
    lib.add_rows_f32.argtypes = [_P, _P, _P, _I, _I]
    lib.gelu_f32.argtypes = [_P, _P, _I, _I, ctypes.c_int]
    for fn in (lib.rms_norm_f32, lib.add_rms_norm_f32, lib.head_rms_norm_f32,
               lib.rotary_embedding_f32, lib.silu_and_mul_f32, lib.layer_norm_f32,
               lib.add_layer_norm_f32, lib.add_rows_f32, lib.gelu_f32):
        fn.restype = None
    # One thread pool for all our kernels: the attention library's.
    from llm_serving.model_executor.attention import kernels as attention_kernels
    lib.lls_layer_ops_set_parallel_for(attention_kernels.parallel_for_address())
    lib._lls_declared = True
    return lib


@lru_cache(maxsize=None)
def cpu_layer_ops() -> ctypes.CDLL:
    return load_layer_ops()


def use_cpu_kernels() -> bool:
    """True when the model runs on CPU in fp32 and the fused kernels are not disabled."""
    from llm_serving.model_executor.device import current_device
    return current_device() == "CPU" and os.environ.get("LLM_SERVING_NATIVE_OPS") != "1"


def empty(shape, dtype=np.float32) -> tuple[np.ndarray, Tensor]:
    """A kernel's output: a fresh host buffer (the CPU graph arena's during a capture) and
    the MindSpore tensor that shares its memory."""
    arr = cpu_graph.empty(shape, dtype)
    return arr, Tensor.from_numpy(arr)


def ptr(t: Tensor) -> int:
    return t.data_ptr()


def row_stride(t: Tensor) -> int:
    """Elements between rows of a 2-D tensor whose rows are contiguous (possibly a column
    slice of a wider buffer, as ``split`` returns)."""
    if t.is_contiguous():
        return t.shape[1]
    stride = t.stride()
    if stride[1] != 1:
        raise ValueError(f"tensor rows must be contiguous, got strides {stride}")
    return stride[0]


class CustomOp(nn.Cell):
    def __init__(self):
        super().__init__()
        self._use_cpu = use_cpu_kernels()

    def construct(self, *args):
        if self._use_cpu:
            return self.forward_cpu(*args)
        return self.forward_native(*args)

    def __call__(self, *args):
        # The CPU kernels run eagerly through ctypes (never inside a graph), so skip
        # Cell.__call__'s mode and hook checks: ~2 us a call, ~100 calls per decode step.
        if self._use_cpu:
            return self.forward_cpu(*args)
        return super().__call__(*args)

    def forward_native(self, *args):
        raise NotImplementedError

    def forward_cpu(self, *args):
        return self.forward_native(*args)
