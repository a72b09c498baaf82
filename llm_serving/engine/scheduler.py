"""Plans each step under a token budget and a sequence cap.

Running sequences go first (decodes, and the next chunks of long prefills); waiting
sequences' prefills fill the rest of the budget, several per step, chunked when they do not
fit (Dynamic SplitFuse). When the KV pool runs out, the most recently admitted running
sequence is preempted and will recompute its tokens later.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # tokens computed per sequence

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.info("preempted request %s (recompute), KV cache full", seq.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted to make room for another
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill and out.seqs:
                    break
                n = budget
            if not bm.allocate(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
        return out

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
