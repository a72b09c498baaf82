"""What a model's multi-stream layers know (``make_multistream_metadata``), and how one
step's attention metadata is cut into the micro-batches' (``split_attention_metadata``).

Cut at request ``s`` (the first request of micro-batch B, token row ``t``):
- slot mapping by token: rows ``[:t]`` and ``[t:]``;
- block tables and sequence lengths by request: ``[:s]`` and ``[s:]``, each block table
  as wide as its own longest sequence needs (what the input builder would build for those
  requests alone);
- query start offsets by request, B's rebased to 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.model_executor.attention.backend import AttentionMetadata
from llm_serving.model_executor.multistream.config import MultiStreamConfig


@dataclass(frozen=True)
class MultiStreamMetadata:
    start_layer: int
    end_layer: int
    causal_lm: bool
    config: Optional[MultiStreamConfig]

    @property
    def enabled(self) -> bool:
        """Splitting by request is exact only when each request attends to itself alone,
        as causal LMs' do; otherwise the layers run unsplit."""
        return self.config is not None and self.causal_lm and self.end_layer > self.start_layer


def make_multistream_metadata(start_layer: int, end_layer: int, causal_lm: bool,
                              multistream_config: Optional[MultiStreamConfig]
                              ) -> MultiStreamMetadata:
    return MultiStreamMetadata(start_layer, end_layer, causal_lm, multistream_config)


def _part(md: AttentionMetadata, seqs: slice, tokens: slice, row0: int) -> AttentionMetadata:
    seq_lens = md.seq_lens[seqs]
    width = -(-int(seq_lens.max()) // md.block_size) if len(seq_lens) else 0
    width = min(width, md.block_tables.shape[1])
    qsl = md.query_start_loc[seqs.start:(None if seqs.stop is None else seqs.stop + 1)]
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[tokens],
        block_tables=np.ascontiguousarray(md.block_tables[seqs, :width]),
        query_start_loc=(qsl - row0).astype(np.int32),
        seq_lens=seq_lens, block_size=md.block_size)


def split_attention_metadata(md: AttentionMetadata, split: int
                             ) -> tuple[AttentionMetadata, AttentionMetadata, int]:
    """(micro-batch A's metadata, B's, the first token row of B) for a cut before request
    ``split`` (0 < split < number of requests)."""
    if not 0 < split < md.num_seqs:
        raise ValueError(f"split {split} is not inside a step of {md.num_seqs} requests")
    t = int(md.query_start_loc[split])
    return (_part(md, slice(0, split), slice(0, t), 0),
            _part(md, slice(split, None), slice(t, None), t), t)
