"""Linear layers, weights kept as [out, in] (HF layout; fastest at M=1 with transpose_b).

Fused projections (q/k/v -> qkv, gate/up -> gate_up) and tensor-parallel shards are loaded
through ``weight_loader``: each layer knows which slice of its parameter a checkpoint tensor
fills, so a new model adds a name mapping, not a new loader.

On CPU, decode-sized inputs (at most ``CPU_LINEAR_MAX_M`` rows) run through the layer
kernels' GEMV/small-M kernel (``lls_linear_f32``), which streams the weight once at close to
memory bandwidth on both cores; larger inputs (prefill) and other devices use MindSpore's
``MatMul(transpose_b=True)``.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
from mindspore import Parameter, Tensor, ops

from llm_serving.model_executor.layers.custom_op import CustomOp, cpu_layer_ops, row_stride
from llm_serving.model_executor.parallel_state import get_tp_group

# Rows up to which the C++ kernel runs instead of MindSpore's MatMul. Measured on this
# project's CPU inside whole model steps (bench/bench_model.py, 97M model; 2026-11-21):
# decode B=64 160-170 ms/step with the kernel vs 141-256 ms (erratic) with MatMul, B=128 297 vs
# 477-569 ms: MindSpore's matmul threads and the attention kernel's pool contend when they
# alternate, which an isolated matmul benchmark (bench/bench_linear.py: MatMul ahead from M~32)
# does not show. Prefill: 256-token prefill even (354 vs 373 ms), 512 tokens MatMul ahead
# (672 vs 896 ms), 2048 tokens MatMul far ahead (1954 vs 4094 ms). Override with
# LLM_SERVING_CPU_LINEAR_MAX_M.
CPU_LINEAR_MAX_M = int(os.environ.get("LLM_SERVING_CPU_LINEAR_MAX_M", "256"))


class _LinearCall:
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


def cpu_linear(x: Tensor, weight: Tensor, bias=None, call: _LinearCall | None = None,
               split: bool = False):
    """x [M, K] @ weight[N, K].T (+ bias) with the C++ kernel. Returns a new Tensor [M, N], or,
    with ``split``, one contiguous Tensor per part of ``call`` (q, k, v of a fused qkv)."""
    m, k = x.shape
    if call is None:
        call = _LinearCall([weight.shape[0]])
    flat = np.empty(m * call.n, np.float32)
    base = flat.ctypes.data
    offs = call.offsets
    if split:
        out = call.out_type(*[base + 4 * m * o for o in offs[:-1]])
        ld = call.ld_split
    else:
        out = call.out_type(*[base + 4 * o for o in offs[:-1]])
        ld = call.ld_fused
    rc = cpu_layer_ops().lls_linear_f32(
        x.data_ptr(), row_stride(x) if m > 1 else k, weight.data_ptr(),
        bias.data_ptr() if bias is not None else None, m, call.n, k, call.nparts, call.c_split,
        out, ld)
    if rc:
        raise ValueError(f"lls_linear_f32 rejected shapes x {x.shape}, weight {weight.shape}")
    if not split:
        return Tensor.from_numpy(flat.reshape(m, call.n))
    return tuple(Tensor.from_numpy(flat[m * a:m * b].reshape(m, b - a))
                 for a, b in zip(offs[:-1], offs[1:]))


def _param(shape) -> Parameter:
    return Parameter(Tensor(np.zeros(shape, np.float32)), requires_grad=False)


class Linear(CustomOp):
    """y = x @ W.T (+ b). ``output_sizes`` lists the fused parts' sizes, in order. With
    ``split_output`` the layer returns one tensor per part (q, k, v of a fused qkv).

    Tensor parallel (``tp_size`` > 1):
    - ``parallel="column"``: each rank holds a slice of the output rows (its heads, its part
      of the FFN); no communication. A part with ``replicas[p]`` = R > 1 (KV heads fewer than
      ranks) is held whole-head by groups of R ranks: rank r takes slice r // R of size
      size * R / tp_size;
    - ``parallel="row"``: each rank holds a slice of the input columns and the partial outputs
      are summed over the ranks (all-reduce); the bias is added once, after the sum.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, parallel: str = "none",
                 split_output: bool = False, replicas: list[int] | None = None):
        super().__init__()
        self.shard_index = [0] * len(output_sizes)
        if parallel == "column":
            replicas = replicas or [1] * len(output_sizes)
            sizes = []
            for s, r in zip(output_sizes, replicas):
                if (s * r) % tp_size:
                    raise ValueError(f"output size {s} is not divisible by tp_size {tp_size}")
                sizes.append(s * r // tp_size)
            self.shard_index = [tp_rank // r for r in replicas]
            output_sizes = sizes
        elif parallel == "row" and input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        self.parallel, self.tp_rank, self.tp_size = parallel, tp_rank, tp_size
        self.input_size = input_size // tp_size if parallel == "row" else input_size
        self.output_sizes = list(output_sizes)
        self.offsets = np.concatenate([[0], np.cumsum(output_sizes)]).tolist()
        out = self.offsets[-1]
        self.weight = _param((out, self.input_size))
        self.bias = _param((out,)) if bias else None
        self.split_output = split_output
        self.matmul = ops.MatMul(transpose_b=True)
        self._call = _LinearCall(self.output_sizes if split_output else [out])
        # Row-parallel outputs are partial sums: all-reduce them, then add the bias once.
        self.reduce = parallel == "row" and tp_size > 1

    def forward_native(self, x):
        y = self.matmul(x, self.weight)
        if self.reduce:
            tp = get_tp_group()
            if self.bias is not None and tp.deferring:     # as in forward_cpu
                return tp.all_reduce(y + self.bias if self.tp_rank == 0 else y)
            y = tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        if self.split_output:
            return ops.split(y, self.output_sizes, -1)
        return y

    def forward_cpu(self, x):
        if x.shape[0] > CPU_LINEAR_MAX_M:
            return self.forward_native(x)
        if self.reduce:
            tp = get_tp_group()
            if self.bias is not None and tp.deferring:
                # The sum lands later (multi-stream): rank 0 adds the bias before it.
                bias = self.bias if self.tp_rank == 0 else None
                return tp.all_reduce(cpu_linear(x, self.weight, bias, self._call))
            y = tp.all_reduce(cpu_linear(x, self.weight, None, self._call))
            return y + self.bias if self.bias is not None else y
        return cpu_linear(x, self.weight, self.bias, self._call, self.split_output)

    def weight_loader(self, host: np.ndarray, loaded: np.ndarray, shard: int = 0,
                      is_bias: bool = False) -> None:
        """Copy checkpoint tensor ``loaded`` (fused part ``shard``) into host buffer ``host``."""
        size = self.output_sizes[shard]
        if self.parallel == "column":
            i = self.shard_index[shard]
            loaded = loaded[i * size:(i + 1) * size]
        elif self.parallel == "row" and not is_bias:
            n = self.input_size
            loaded = loaded[:, self.tp_rank * n:(self.tp_rank + 1) * n]
        dst = host[self.offsets[shard]:self.offsets[shard] + size]
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {loaded.shape} does not fit "
                             f"a parameter slice of shape {dst.shape}")
        dst[...] = loaded


class VocabEmbedding(CustomOp):
    """The token embedding, also the LM head (tied or not). Vocab-parallel with tp_size > 1:
    rank r holds rows [r * n, (r + 1) * n) of the vocabulary, n = ceil(vocab / tp_size) (the
    last rank's tail is zero padding).
    - embedding: ids outside the rank's rows give zeros, and the ranks' rows are summed
      (all-reduce);
    - LM head (``compute_logits``): each rank computes its vocabulary slice of the logits and
      rank 0 gathers them; the other ranks get None (only rank 0 samples).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.rows = -(-vocab_size // tp_size)
        self.start = tp_rank * self.rows
        self.weight = _param((self.rows, hidden_size))
        self.logits_matmul = ops.MatMul(transpose_b=True)

    def forward_native(self, input_ids):
        if self.tp_size == 1:
            return ops.gather(self.weight, input_ids, 0)
        local = input_ids - self.start
        mine = ops.logical_and(local >= 0, local < self.rows)
        rows = ops.gather(self.weight, ops.where(mine, local, ops.zeros_like(local)), 0)
        rows = rows * ops.expand_dims(mine.astype(rows.dtype), -1)
        return get_tp_group().all_reduce(rows)

    def compute_logits(self, hidden_states):
        """float32 logits [M, vocab] (on rank 0; None on the other ranks)."""
        if self._use_cpu and hidden_states.shape[0] <= CPU_LINEAR_MAX_M:
            logits = cpu_linear(hidden_states, self.weight)
        else:
            logits = self.logits_matmul(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits.asnumpy()
        full = get_tp_group().gather_last_dim(logits)
        if full is None or full.shape[1] == self.vocab_size:
            return full
        return np.ascontiguousarray(full[:, :self.vocab_size])       # drop the padding

    def weight_loader(self, host: np.ndarray, loaded: np.ndarray, shard: int = 0,
                      is_bias: bool = False) -> None:
        """Copy this rank's rows of the checkpoint's [vocab, hidden] tensor into ``host``."""
        if loaded.shape[1:] != host.shape[1:] or len(loaded) != self.vocab_size:
            raise ValueError(f"checkpoint tensor of shape {loaded.shape} does not fit "
                             f"[{self.vocab_size}, {host.shape[1]}]")
        part = loaded[self.start:self.start + self.rows]
        host[:len(part)] = part
        host[len(part):] = 0
