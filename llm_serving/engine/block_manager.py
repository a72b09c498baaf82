"""The KV block pool: allocation, freeing and reference counts.

A sequence's block table maps its token positions to physical blocks:
slot(position) = block_table[position // block_size] * block_size + position % block_size.
"""
from __future__ import annotations

from collections import deque

from llm_serving.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend the sequence's blocks to hold ``num_new_tokens`` more tokens."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, "negative block reference count"
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
