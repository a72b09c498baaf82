"""The layers around a model's decoder loop (seed 000, step 3).

``MultiStreamPreTransformerLayer`` cuts the step's tensors into micro-batches, and the
forward context with them (``metadata.split_attention_metadata``), when the master decided
to split this step (``ForwardContext.ms_split``). ``MultiStreamPostTransformerLayer`` waits
for the last communication and joins them again. When the step is not split, both hand the
tensors through untouched.

Seed 000 passes ``attn_metadata`` through these layers; here attention metadata lives in the
forward context (seed 004), so they take and return only the tensors.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from mindspore import ops

from llm_serving.model_executor.forward_context import get_forward_context
from llm_serving.model_executor.multistream.metadata import (MultiStreamMetadata,
                                                             split_attention_metadata)
from llm_serving.model_executor.multistream.overlap import get_overlap


class MicroBatches:
    """One tensor argument cut into micro-batches: ``parts[i]`` belongs to micro-batch i,
    which runs under forward context ``contexts[i]``; ``pending[i]`` are the communication
    handles to wait for before ``parts[i]`` is read."""
    __slots__ = ("parts", "contexts", "pending")

    def __init__(self, parts: list, contexts: list, pending: Optional[list] = None):
        self.parts, self.contexts = parts, contexts
        self.pending = pending if pending is not None else [()] * len(parts)


class MultiStreamPreTransformerLayer:
    def __init__(self, metadata: MultiStreamMetadata):
        self.metadata = metadata

    def __call__(self, tensors: Sequence) -> list:
        if not self.metadata.enabled:
            return list(tensors)
        ctx = get_forward_context()
        if not ctx.ms_split:
            return list(tensors)
        md_a, md_b, t = split_attention_metadata(ctx.attn_metadata, ctx.ms_split)
        prepare = ctx.backend.prepare if ctx.backend is not None else (lambda md: md)
        contexts = [replace(ctx, attn_metadata=prepare(md_a), num_tokens=t, ms_split=0),
                    replace(ctx, attn_metadata=prepare(md_b), num_tokens=ctx.num_tokens - t,
                            ms_split=0)]
        return [None if x is None else MicroBatches([x[:t], x[t:]], contexts)
                for x in tensors]


class MultiStreamPostTransformerLayer:
    def __init__(self, metadata: MultiStreamMetadata):
        self.metadata = metadata

    def __call__(self, tensors: Sequence) -> list:
        out = []
        for x in tensors:
            if isinstance(x, MicroBatches):
                overlap = get_overlap()
                for handles in x.pending:
                    overlap.wait(handles)
                x = ops.cat(x.parts, 0)
            out.append(x)
        return out
