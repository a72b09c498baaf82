"""Runs one step of the model: builds the forward context, runs the forward pass, samples.

Its input is a plain description of the step (``StepInput``: arrays and small ints), so the
same runner serves an in-process engine and a WorkAgent fed through shared memory.

Under tensor parallelism each WorkAgent runs one of these on its shard of the model (the
process's group, ``parallel_state.get_tp_group()``): every rank runs every step and block move,
and only rank 0 samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from mindspore import Tensor, ops

from llm_serving.model_executor.attention.backend import AttentionMetadata, get_attention_backend
from llm_serving.model_executor.device import init_device
from llm_serving.model_executor.forward_context import ForwardContext, set_forward_context
from llm_serving.model_executor.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from llm_serving.model_executor.loader import ModelConfig, iter_weights
from llm_serving.model_executor.parallel_state import (check_tensor_parallel, get_tp_group,
                                                       kv_heads_per_rank)


@dataclass
class StepInput:
    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]
    block_tables: np.ndarray     # int32 [S, max_blocks]
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray         # int32 [S]
    sample_seqs: np.ndarray      # int32 [S']: sequences whose last row is sampled this step
    sampling: Optional[SamplingBatch] = None   # (a sequence may appear more than once: n > 1)
    # KV block moves done before the forward pass, in this order.
    swap_out: np.ndarray = field(default_factory=lambda: _NO_PAIRS)   # [K, 2] device, host
    swap_in: np.ndarray = field(default_factory=lambda: _NO_PAIRS)    # [K, 2] host, device
    copies: np.ndarray = field(default_factory=lambda: _NO_PAIRS)     # [K, 2] src, dst
    # Sampled rows whose raw logits are returned too (the accuracy harness, --dump-logits).
    dump_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)


_NO_PAIRS = np.zeros((0, 2), np.int32)
_NO_ROWS = np.zeros(0, np.int32)


def build_model(config: ModelConfig, backend, tp_rank: int = 0, tp_size: int = 1):
    # ModelConfig has already rejected architectures outside loader.SUPPORTED_ARCHITECTURES;
    # all of them are Llama-shaped.
    from llm_serving.model_executor.models.llama import LlamaForCausalLM
    return LlamaForCausalLM(config, backend, tp_rank, tp_size)


def kv_bytes_per_block(config: ModelConfig, block_size: int, tp_size: int = 1) -> int:
    """Bytes of one KV block on one rank (each holds its share of the KV heads)."""
    kv_heads = kv_heads_per_rank(config.num_kv_heads, tp_size)
    return 2 * config.num_layers * block_size * kv_heads * config.head_dim * 4


class ModelRunner:
    def __init__(self, model_dir: str, num_blocks: int, block_size: int,
                 checkpoint: Optional[str] = None, device: str = "auto", seed: int = 0,
                 config: Optional[ModelConfig] = None, num_cpu_blocks: int = 0,
                 device_id: int = 0):
        self.device = init_device(device, device_id)
        self.config = config or ModelConfig.from_pretrained(model_dir)
        c = self.config
        self.tp = tp = get_tp_group()
        check_tensor_parallel(c, tp.size)
        self.backend = get_attention_backend(self.device, c.num_heads // tp.size,
                                             kv_heads_per_rank(c.num_kv_heads, tp.size),
                                             c.head_dim)
        self.model = build_model(c, self.backend, tp.rank, tp.size)
        self.model.load_weights(iter_weights(model_dir, checkpoint=checkpoint))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = [self.backend.allocate_kv_cache(num_blocks, block_size)
                          for _ in range(c.num_layers)]
        # Host block pool for swapped-out sequences (only with preemption_mode="swap").
        self.host_caches = [self.backend.allocate_host_cache(num_cpu_blocks, block_size)
                            for _ in range(c.num_layers)] if num_cpu_blocks else []
        self.sampler = Sampler(seed=seed, always_chosen_logprob=False)

    def move_blocks(self, swap_out: np.ndarray, swap_in: np.ndarray,
                    copies: np.ndarray) -> None:
        """Swap out, then swap in, then copy-on-write: a block freed by a swap-out may be
        reused by a swap-in or a copy of the same step."""
        b = self.backend
        if len(swap_out):
            for dev, host in zip(self.kv_caches, self.host_caches):
                b.swap_out(dev, host, swap_out)
        if len(swap_in):
            for dev, host in zip(self.kv_caches, self.host_caches):
                b.swap_in(host, dev, swap_in)
        if len(copies):
            for dev in self.kv_caches:
                b.copy_blocks(dev, copies)

    def forward(self, step: StepInput, rows: np.ndarray) -> Optional[np.ndarray]:
        """Run the model on the step and return float32 logits for the given token rows
        (None on tensor-parallel ranks other than 0)."""
        md = self.backend.prepare(AttentionMetadata(
            step.slot_mapping, step.block_tables, step.query_start_loc, step.seq_lens,
            self.block_size))
        with set_forward_context(ForwardContext(md, self.kv_caches, len(step.input_ids))):
            hidden = self.model(Tensor(step.input_ids), Tensor(step.positions))
        if len(rows) == 0:
            return np.empty((0, self.config.vocab_size), np.float32)
        if len(rows) != hidden.shape[0] or np.any(rows != np.arange(len(rows))):
            hidden = ops.gather(hidden, Tensor(rows.astype(np.int32)), 0)
        return self.model.compute_logits(hidden)

    def execute(self, step: StepInput) -> Optional[SamplerOutput]:
        self.move_blocks(step.swap_out, step.swap_in, step.copies)
        rows = step.query_start_loc[1:][step.sample_seqs] - 1
        logits = self.forward(step, rows)
        if len(rows) == 0 or not self.tp.is_driver:
            return None
        dump = logits[step.dump_rows] if len(step.dump_rows) else None  # before the sampler
        out = self.sampler(logits, step.sampling)
        out.dump_logits = dump
        return out
