"""Linear layers, weights kept as [out, in] (HF layout; fastest at M=1 with transpose_b).

Fused projections (q/k/v -> qkv, gate/up -> gate_up) and tensor-parallel shards are loaded
through ``weight_loader``: each layer knows which slice of its parameter a checkpoint tensor
fills, so a new model adds a name mapping, not a new loader.

On CPU each projection's GEMM runs through the implementation measured fastest on this CPU for
its shape (``gemm.py``: our kernel or OpenBLAS's sgemm), on the weight packed in panels
(``gemm.pack_weight``; the Parameter then holds the packed [panels, in, width] array, filled by
``set_weight`` from the [out, in] checkpoint layout); other devices use MindSpore's
``MatMul(transpose_b=True)`` on the [out, in] weight.

bfloat16 weights (``--dtype bfloat16`` on CPU, ``use_bf16_weights``): each ``Linear`` keeps
its weight as bf16 bits only (a packed uint16 Parameter, half the bytes; no float32 copy),
rounded to nearest even from the checkpoint, and runs the bf16 kernel measured fastest for its
shape on this CPU (``gemm.GemmPlan.choose_bf16``): weights widened to fp32 in registers with
fp32 activations (``widen``, the fp32 kernel's FMA chains), or, where the CPU has bf16
arithmetic, the layer's input rounded to bf16 and multiplied on AMX tiles (``amx``) or with
AVX512-BF16 dot products (``dot``), the weight then packed in AMX tiles; float32 sums and
batch invariance in all three. The token embedding / LM head (``VocabEmbedding``) and the
norms stay fp32: the embedding is a MindSpore gather, which has no bf16 on CPU, and keeping the
LM head fp32 keeps the logits' own GEMM exact (docs/benchmarks.md, "bf16 weights and KV
cache"). The LM head keeps a packed copy of its [vocab, hidden] weight for the logits GEMM (the
embedding gathers rows of the unpacked one).

int8 weights (W8A8, ``use_int8_weight`` then ``set_int8_weight``): the weight held as int8 in
the int8 kernel's layout with float32 per-output-channel scales, the activations quantized to
int8 per token (or with a static scale) on each call, exact int32 sums, a float32 epilogue
(``gemm.cpu_linear_int8``). A row-parallel rank's per-token scale is over its own input slice
(as vLLM's). LoRA adds on top, in float32, as for the other weights.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, ops

from llm_serving.model_executor import cpu_graph
from llm_serving.model_executor.forward_context import current_input_embeds, current_lora
from llm_serving.model_executor.host_memory import WEIGHTS
from llm_serving.model_executor.layers.custom_op import CustomOp, empty
from llm_serving.model_executor.layers.gemm import (INT8_MAX_K, TILED_BF16_KERNELS, Int8Scales,
                                                    LinearCall, aligned_empty, amx_packed_shape,
                                                    cpu_linear, cpu_linear_int8, gemm_plan,
                                                    pack_weight, pack_weight_amx,
                                                    pack_weight_int8, packed_shape)
from llm_serving.model_executor.loader import float32_to_bfloat16_bits
from llm_serving.model_executor.parallel_state import get_tp_group


def _take_rows(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    np.take(table, ids, axis=0, out=out)


def _reuse(held, shape, dtype) -> np.ndarray:
    """``held`` if it has this shape and dtype, else new memory for packed weights."""
    if held is not None and held.shape == tuple(shape) and held.dtype == np.dtype(dtype):
        return held
    return WEIGHTS.empty(shape, dtype)


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
      are summed over the ranks (all-reduce); the bias is added once, after the sum. With
      ``reduce_results=False`` the layer returns its partial sum and the caller reduces (a
      mixture of experts sums its experts' partial outputs first, then all-reduces once).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, parallel: str = "none",
                 split_output: bool = False, replicas: list[int] | None = None,
                 reduce_results: bool = True):
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
        self.gemm_shape = (out, self.input_size)
        # With bfloat16 weights (use_bf16_weight): the bf16 kernel that reads them.
        self.bf16_kernel = None
        # With int8 weights (use_int8_weight): their scales (gemm.Int8Scales).
        self.int8_scales = None
        # On CPU the weight is held packed for our kernels, unless MatMul is forced.
        self.packed = False
        if self._use_cpu:
            self._plan = gemm_plan()
            self._plan.register(self)
            self.packed = self._plan.forced != "matmul"
        self.weight = self._zero_weight(np.float32)
        self.bias = _param((out,)) if bias else None
        self.split_output = split_output
        self.matmul = ops.MatMul(transpose_b=True)
        self.gemm_call = LinearCall(self.output_sizes if split_output else [out])
        # Row-parallel outputs are partial sums: all-reduce them, then add the bias once.
        self.reduce = parallel == "row" and tp_size > 1 and reduce_results
        # LoRA: the layer's name among the model's, set by lora.LoRAModels (None: no LoRA).
        self.lora_name = None

    def __call__(self, x):
        y = super().__call__(x)
        if self.lora_name is None:
            return y
        lora = current_lora()       # the step's adapters add their products to their rows
        return y if lora is None else lora.apply(self, x, y)

    def _zero_weight(self, dtype) -> Parameter:
        """A zero weight Parameter in the layout the layer computes with."""
        if not self.packed:
            return Parameter(Tensor(np.zeros(self.gemm_shape, dtype)), requires_grad=False)
        shape = amx_packed_shape if self.tiled else packed_shape
        arr = aligned_empty(shape(*self.gemm_shape), dtype)
        arr[...] = 0
        return Parameter(Tensor.from_numpy(arr), requires_grad=False)

    @property
    def bf16(self) -> bool:
        """Whether the weight is held as bfloat16 bits."""
        return self.bf16_kernel is not None

    @property
    def tiled(self) -> bool:
        """Whether the weight is held in AMX tiles (the bf16-activation kernels' layout)."""
        return self.bf16_kernel in TILED_BF16_KERNELS

    def use_bf16_weight(self) -> None:
        """Hold the weight as bfloat16 bits from now on (before loading): a uint16 Parameter
        replaces the float32 one, in the layout of the bf16 kernel chosen for the shape (AMX
        tiles, or the fp32 panels for ``widen``), and the fp32 GEMM plan forgets the layer."""
        if not self._use_cpu:
            raise ValueError("bfloat16 weights in our buffers are a CPU-kernel feature")
        if self.bf16:
            return
        if self.int8:
            raise ValueError("this layer holds int8 weights: it cannot also hold bfloat16")
        kernel = self._plan.choose_bf16(self)
        name = self.weight.name
        self.packed = True
        self.bf16_kernel = kernel
        self.weight = self._zero_weight(np.uint16)
        self.weight.name = name
        self._plan.layers.get(tuple(self.gemm_shape), set()).discard(self)

    @property
    def int8(self) -> bool:
        """Whether the weight is held as int8 with per-output-channel scales (W8A8)."""
        return self.int8_scales is not None

    def use_int8_weight(self, static_input_scale: bool = False) -> None:
        """Hold the weight as int8 from now on (before loading; W8A8, vLLM's compressed-tensors
        "int-quantized"): an int8 Parameter in the int8 kernel's layout (``pack_weight_int8``)
        replaces the float32 one, with float32 per-output-channel scales; the activations are
        quantized to int8 per token (dynamic, sx = max |x| / 127) or with one static scale
        (``static_input_scale``, given to ``set_int8_weight``). See ``gemm.cpu_linear_int8``."""
        if not self._use_cpu:
            raise ValueError("int8 weights (W8A8) are a CPU-kernel feature: this layer runs on "
                             "MindSpore's MatMul")
        if self.bf16:
            raise ValueError("this layer holds bfloat16 weights: it cannot also hold int8")
        n, k = self.gemm_shape
        if k > INT8_MAX_K:
            raise ValueError(f"int8 weights take at most {INT8_MAX_K} inputs (the kernel's int32 "
                             f"sums could overflow), this layer has {k}")
        name = self.weight.name
        self.packed = True
        self.int8_scales = Int8Scales(n, k, static_input_scale)
        packed = aligned_empty(self.int8_scales.packed_shape, np.int8)
        packed[...] = 0
        self.weight = Parameter(Tensor.from_numpy(packed), requires_grad=False)
        self.weight.name = name
        self._plan.layers.get(tuple(self.gemm_shape), set()).discard(self)

    def set_int8_weight(self, q: np.ndarray, scale: np.ndarray,
                        input_scale: float | None = None, in_place: bool = False) -> None:
        """Store an int8 weight: ``q`` int8 [out, in] (this rank's slice, fused parts in order,
        as ``set_weight``'s value), ``scale`` float32 [out] (or [out, 1]), ``input_scale`` the
        static activation scale (given iff the layer was made with static_input_scale=True).
        ``in_place``: written over the arrays held (a reload: same addresses, so a captured
        CPU graph replays on the new values). ValueError on a shape, dtype or value mismatch."""
        if not self.int8:
            raise ValueError("set_int8_weight on a layer without int8 weights: call "
                             "use_int8_weight first")
        n, k = self.gemm_shape
        if not isinstance(q, np.ndarray) or q.dtype != np.int8 or q.shape != (n, k):
            raise ValueError(f"int8 weight must be an int8 array of shape {(n, k)}, got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {getattr(q, 'shape', '')}")
        scale = np.asarray(scale)
        if scale.dtype != np.float32 or scale.shape not in ((n,), (n, 1)):
            raise ValueError(f"int8 weight scale must be float32 of shape ({n},), got "
                             f"{scale.dtype} {scale.shape}")
        if not np.isfinite(scale).all():
            raise ValueError("int8 weight scale holds a non-finite value")
        static = self.int8_scales.input_scale is not None
        if (input_scale is not None) != static:
            raise ValueError("input_scale is required for a layer with a static activation scale "
                             "and refused for one with dynamic (per-token) scales" if static else
                             "input_scale given to a layer with dynamic (per-token) activation "
                             "scales: make it with use_int8_weight(static_input_scale=True)")
        if static and not (np.isfinite(input_scale) and input_scale > 0):
            raise ValueError(f"input_scale must be a positive finite number, got {input_scale}")
        held = self.weight.asnumpy() if in_place else None
        packed = pack_weight_int8(q, alloc=lambda shape, dtype: _reuse(held, shape, dtype))
        if packed is not held:
            self.weight.set_data(Tensor.from_numpy(packed))
        self.int8_scales.set(q, scale, input_scale)

    def set_weight(self, value: np.ndarray, in_place: bool = False) -> None:
        """Store a float32 [out, in] weight (packed if the layer computes on packed weights),
        rounded to bf16 (nearest even) if the layer holds bf16. ``in_place``: a packed weight
        is written over the one held (a reload: no new memory, the same address)."""
        if self.int8:
            raise ValueError("this layer holds int8 weights: store them with set_int8_weight")
        value = float32_to_bfloat16_bits(value) if self.bf16 else np.asarray(value, np.float32)
        if value.shape != tuple(self.gemm_shape):
            raise ValueError(f"weight of shape {value.shape} for a layer of {self.gemm_shape}")
        if self.packed:
            pack = pack_weight_amx if self.tiled else pack_weight
            held = self.weight.asnumpy() if in_place else None
            packed = pack(value, alloc=lambda shape, dtype: _reuse(held, shape, dtype))
            if packed is not held:
                self.weight.set_data(Tensor.from_numpy(packed))
        else:
            self.weight.set_data(Tensor(value))

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
        impl = "kernel" if self.bf16 or self.int8 else self._plan.choose(self, x.shape[0])
        if self.reduce:
            cpu_graph.unsupported("a tensor-parallel all-reduce")
            tp = get_tp_group()
            if self.bias is not None and tp.deferring:
                # The sum lands later (multi-stream): rank 0 adds the bias before it.
                return tp.all_reduce(self.gemm(impl, x, with_bias=self.tp_rank == 0))
            y = tp.all_reduce(self.gemm(impl, x, with_bias=False))
            return y + self.bias if self.bias is not None else y
        return self.gemm(impl, x)

    def gemm(self, impl: str, x, with_bias: bool = True):
        """x @ W.T (+ bias), split into parts if the layer splits, with implementation
        ``impl`` (one of ``gemm.FORCEABLE``); no all-reduce."""
        bias = self.bias if with_bias else None
        if self.int8:
            return cpu_linear_int8(x, self.weight, self.int8_scales, self.gemm_call, bias,
                                   self.split_output)
        if self.bf16:
            impl = "kernel"
        if impl == "matmul":
            cpu_graph.unsupported("a GEMM runs on MindSpore's MatMul")
            if self.packed:
                raise ValueError("MatMul reads the unpacked weight: set LLM_SERVING_GEMM=matmul "
                                 "before the model is built")
            y = self.matmul(x, self.weight)
            if bias is not None:
                y = y + bias
            return ops.split(y, self.output_sizes, -1) if self.split_output else y
        return cpu_linear(x, self.weight, self.gemm_call, bias, self.split_output, impl,
                          self.bf16_kernel)

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


def use_bf16_weights(model) -> int:
    """Make every ``Linear`` of ``model`` hold bfloat16 weights (call before loading them);
    returns how many. The embedding / LM head and the norms stay float32, and so do the int8
    layers of a W8A8 checkpoint (``use_int8_weight``): only the layers it keeps in float turn
    bf16."""
    layers = [c for _, c in model.cells_and_names() if isinstance(c, Linear) and not c.int8]
    for layer in layers:
        layer.use_bf16_weight()
    return len(layers)


class VocabEmbedding(CustomOp):
    """The token embedding, also the LM head (tied or not). Vocab-parallel with tp_size > 1:
    rank r holds rows [r * n, (r + 1) * n) of the vocabulary, n = ceil(vocab / tp_size) (the
    last rank's tail is zero padding).
    - embedding: ids outside the rank's rows give zeros, and the ranks' rows are summed
      (all-reduce); the rows the step gives as input embeddings (vLLM's prompt_embeds, in
      the forward context) take those instead of a gather;
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
        self.gemm_shape = (self.rows, hidden_size)
        self.gemm_call = LinearCall([self.rows])
        self._head = None       # (weight's address, its packed copy) for the logits GEMM
        if self._use_cpu:
            self._plan = gemm_plan()
            self._plan.register(self)

    def forward_native(self, input_ids):
        if self.tp_size == 1:
            out = ops.gather(self.weight, input_ids, 0)
        else:
            local = input_ids - self.start
            mine = ops.logical_and(local >= 0, local < self.rows)
            rows = ops.gather(self.weight, ops.where(mine, local, ops.zeros_like(local)), 0)
            rows = rows * ops.expand_dims(mine.astype(rows.dtype), -1)
            out = get_tp_group().all_reduce(rows)
        given = current_input_embeds()
        if given is None:
            return out
        rows, embeds = given        # the same on every rank: set after the all-reduce
        return ops.tensor_scatter_update(out, Tensor(rows.reshape(-1, 1)),
                                         Tensor(embeds, out.dtype))

    def forward_cpu(self, input_ids):
        if self.tp_size > 1:
            return self.forward_native(input_ids)
        # A NumPy gather on the weight's own memory: MindSpore's gather op costs ~0.4 ms a call
        # on CPU, the copy of a few rows microseconds. Ids are checked at admission.
        ids = input_ids.asnumpy()
        out, tensor = empty((len(ids), self.weight.shape[1]))
        given = current_input_embeds()
        if given is None:
            cpu_graph.launch(_take_rows, self.weight.asnumpy(), ids, out)
            return tensor
        rows, embeds = given        # a step with them runs eagerly (no CPU graph)
        gathered = np.ones(len(ids), bool)
        gathered[rows] = False
        out[gathered] = self.weight.asnumpy()[ids[gathered]]
        out[rows] = embeds
        return tensor

    def compute_logits(self, hidden_states):
        """float32 logits [M, vocab] (on rank 0; None on the other ranks)."""
        if self._use_cpu:
            logits = self.gemm(self._plan.choose(self, hidden_states.shape[0]), hidden_states)
        else:
            logits = self.logits_matmul(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits.asnumpy()
        full = get_tp_group().gather_last_dim(logits)
        if full is None or full.shape[1] == self.vocab_size:
            return full
        return np.ascontiguousarray(full[:, :self.vocab_size])       # drop the padding

    def set_weight(self, value: np.ndarray) -> None:
        """Store this rank's [rows, hidden] float32 weight."""
        self.weight.set_data(Tensor(np.asarray(value, np.float32)))
        self._head = None

    def forget_packed_head(self) -> None:
        """The weight may have changed in place: pack it again at the next logits GEMM (over
        the copy held, which keeps its memory)."""
        if self._head is not None:
            self._head = (None, self._head[1])

    def packed_head(self) -> Tensor:
        """The weight packed for our kernels (made on first use after each new weight)."""
        src = self.weight.data_ptr()
        if self._head is None or self._head[0] != src:
            held = self._head[1].asnumpy() if self._head is not None else None
            packed = pack_weight(self.weight.asnumpy(),
                                 alloc=lambda shape, dtype: _reuse(held, shape, dtype))
            self._head = (src, self._head[1] if packed is held else Tensor.from_numpy(packed))
        return self._head[1]

    def gemm(self, impl: str, hidden_states):
        """hidden_states @ weight.T (this rank's logits) with implementation ``impl``."""
        if impl == "matmul":
            cpu_graph.unsupported("the logits GEMM runs on MindSpore's MatMul")
            return self.logits_matmul(hidden_states, self.weight)
        return cpu_linear(hidden_states, self.packed_head(), self.gemm_call, impl=impl)

    def weight_loader(self, host: np.ndarray, loaded: np.ndarray, shard: int = 0,
                      is_bias: bool = False) -> None:
        """Copy this rank's rows of the checkpoint's [vocab, hidden] tensor into ``host``."""
        if loaded.shape[1:] != host.shape[1:] or len(loaded) != self.vocab_size:
            raise ValueError(f"checkpoint tensor of shape {loaded.shape} does not fit "
                             f"[{self.vocab_size}, {host.shape[1]}]")
        part = loaded[self.start:self.start + self.rows]
        host[:len(part)] = part
        host[len(part):] = 0
