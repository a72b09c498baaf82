"""The per-step forward context: what attention needs that model code should not see.

The model runner sets it around each forward pass; attention layers read their KV cache and
the batch's attention metadata from it by layer index, and linear layers the step's LoRA
adapters and their rows (``model_executor/lora.py``), and the token embedding the rows given
as embeddings. Model code never sees block tables,
slot mappings or caches: its layers take tensors and return tensors.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional


@dataclass
class ForwardContext:
    # Backend-specific metadata for the whole ragged batch (see attention/backend.py).
    attn_metadata: Any
    # One entry per attention layer, indexed by Attention.layer_idx.
    kv_caches: list = field(default_factory=list)
    num_tokens: int = 0
    # Multi-stream: the first sequence of the second micro-batch (0 = unsplit), and the
    # backend that prepares each micro-batch's metadata (multistream/layers.py).
    ms_split: int = 0
    backend: Any = None
    # LoRA: the step's adapters and their token rows (lora.StepLoRA); None: no row has one.
    lora: Any = None
    # vLLM's prompt_embeds: (token rows int32 [E], their input embeddings float32 [E, H]),
    # which the token embedding (layers/linear.py's VocabEmbedding) puts in place of its
    # rows' gathers; None: every row is a token id's.
    input_embeds: Any = None


_forward_context: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context is set: run the model through the model runner")
    return _forward_context


def current_lora():
    """The running step's LoRA rows (``lora.StepLoRA``), or None (none, or no step)."""
    return _forward_context.lora if _forward_context is not None else None


def current_input_embeds():
    """The running step's (rows, embeddings) given as input embeddings, or None."""
    return _forward_context.input_embeds if _forward_context is not None else None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = context
    try:
        yield context
    finally:
        _forward_context = previous
