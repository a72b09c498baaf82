"""``@support_multi_stream``: run a decoder layer micro-batch by micro-batch (seed 000, step 4).

The decorated class splits its forward into ``forward_attn`` (its inputs are the forward's;
it ends at the attention block's output projection) and ``forward_ffn`` (its inputs are
``forward_attn``'s outputs; it ends at the MLP's). When the layer is called with
``MicroBatches`` (cut by ``MultiStreamPreTransformerLayer``), it runs

    attn(A), attn(B), ffn(A), ffn(B)

each under its micro-batch's forward context and inside ``overlap.phase()``, waiting for a
micro-batch's earlier communication just before its next phase reads it. With the
overlapped implementation, A's all-reduce after attention runs while B's attention
computes, and so on. Called with plain tensors, the layer runs its own forward unchanged.

- ``dynamic_arg_ms``: the argument names of ``forward`` (MindSpore's ``construct``),
  ``forward_attn`` and ``forward_ffn``, in order;
- ``unpacked_arg``: arguments passed whole to every micro-batch instead of being cut (a KV
  cache, flags).
"""
from __future__ import annotations

import functools
from typing import Iterable, Mapping, Sequence

from llm_serving.model_executor.forward_context import set_forward_context
from llm_serving.model_executor.multistream.layers import MicroBatches
from llm_serving.model_executor.multistream.overlap import get_overlap


def support_multi_stream(dynamic_arg_ms: Mapping[str, Sequence[str]],
                         unpacked_arg: Iterable[str] = ()):
    names = dict(dynamic_arg_ms)
    forward_names = names.get("forward", names.get("construct"))
    if forward_names is None or "forward_attn" not in names or "forward_ffn" not in names:
        raise ValueError("support_multi_stream: dynamic_arg_ms must name the arguments of "
                         "forward, forward_attn and forward_ffn")
    attn_names = list(names["forward_attn"])
    unpacked = frozenset(unpacked_arg)

    def wrap(cls):
        for method in ("forward_attn", "forward_ffn"):
            if not callable(getattr(cls, method, None)):
                raise TypeError(f"{cls.__name__} needs a {method} method for multi-stream")
        attr = "construct" if "construct" in vars(cls) else "forward"
        original = getattr(cls, attr)

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            bound = dict(zip(forward_names, args), **kwargs)
            first = next((v for v in bound.values() if isinstance(v, MicroBatches)), None)
            if first is None:
                return original(self, *args, **kwargs)
            return _run_micro_batches(self, bound, first, attn_names, unpacked)

        setattr(cls, attr, forward)
        cls.multi_stream_args = {k: tuple(v) for k, v in names.items()}
        return cls
    return wrap


def _part(value, i: int, name: str, unpacked: frozenset):
    if isinstance(value, MicroBatches) and name not in unpacked:
        return value.parts[i]
    return value


def _run_micro_batches(layer, bound: dict, first: MicroBatches, attn_names, unpacked):
    overlap = get_overlap()
    contexts, n = first.contexts, len(first.parts)
    attn_out, attn_comm = [], []
    cut = [v for v in bound.values() if isinstance(v, MicroBatches)]
    for i in range(n):
        for v in cut:                           # the previous layer's FFN all-reduce
            overlap.wait(v.pending[i])
        with set_forward_context(contexts[i]), overlap.phase() as handles:
            attn_out.append(layer.forward_attn(
                *[_part(bound.get(k), i, k, unpacked) for k in attn_names]))
        attn_comm.append(handles)
    ffn_out, ffn_comm = [], []
    for i in range(n):
        overlap.wait(attn_comm[i])
        with set_forward_context(contexts[i]), overlap.phase() as handles:
            ffn_out.append(layer.forward_ffn(*attn_out[i]))
        ffn_comm.append(handles)
    return tuple(MicroBatches([out[j] for out in ffn_out], contexts, ffn_comm)
                 for j in range(len(ffn_out[0])))
