"""Plans each step under a token budget and a sequence cap (max_num_batched_tokens and
max_num_seqs, or vLLM's lower max_num_scheduled_tokens and max_num_active_seqs).

One step, in order:
1. Requests that waited longer than ``queue_timeout`` without starting are failed.
2. Under the priority policy, a waiting request that cannot get in preempts running ones
   with a worse (higher) priority value.
3. Running sequences go first: decodes, and the next chunks of long prefills. When the KV
   pool cannot hold one, the lowest-ranked running sequence is preempted (the newest under
   FCFS, the worst priority under the priority policy): its KV is swapped to the host pool
   or dropped to be recomputed, as ``preemption_mode`` says.
4. If nothing ran out of memory, swapped-out sequences come back and waiting sequences'
   prefills fill the rest of the budget, in rank order, several per step, chunked when they
   do not fit (Dynamic SplitFuse), reusing prefix-cached blocks. Admission keeps a watermark
   of free blocks so that it does not immediately force a preemption.

With ``long_prefill_cap`` (vLLM's long_prefill_token_threshold), a prefill chunk is at most
that many tokens while other requests are in the queues, so one long prompt does not take
the whole budget from the prompts behind it; ``long_prefill_adaptive`` raises it to the
budget's fair share among them. With ``reserve_full_prompt`` (vLLM 0.32's
scheduler_reserve_full_isl, on by default), a waiting sequence is admitted only when its
whole prompt fits in the free blocks, though only its first chunk takes blocks now.

With LoRA (``max_loras``), the running sequences use at most that many adapters: a waiting
sequence of another adapter is passed over (the next one that may run is admitted, as vLLM
skips it) until one of them is no longer running; a swapped one waits at the head of its
queue.

Queues are kept sorted by rank: (priority, arrival) under "priority", arrival under "fcfs".
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from llm_serving.config import SchedulerConfig
from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.errors import QueueFullError
from llm_serving.spec_decode.ngram_proposer import takes_drafts

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)     # tokens computed per sequence
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device, host) blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host, device) blocks
    copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write (src, dst)
    preempted: list[Sequence] = field(default_factory=list)
    timed_out: list[Sequence] = field(default_factory=list)
    drafted: bool = False       # some sequence was given drafts (speculative decoding)
    # Filled by the engine's step builder: (sequence, first prompt token, count) whose prompt
    # logprobs this step computes, in the order of StepInput.prompt_lp_rows.
    prompt_logprobs: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.time, proposer=None):
        """``proposer`` (spec_decode/ngram_proposer.py): speculative decoding is on; each
        decode is scheduled with its drafts after its last token."""
        self.block_manager = block_manager
        self.proposer = proposer
        self.stats = block_manager.stats        # the one set of counters (engine/metrics.py)
        # what a step may issue and how many sequences may run: vLLM's
        # max_num_scheduled_tokens and max_num_active_seqs where set, else the buffers' sizes
        self.max_num_batched_tokens = config.step_tokens
        self.max_num_active_seqs = config.running_seqs
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.policy = config.policy
        self.preemption_mode = config.preemption_mode
        self.max_waiting = config.max_waiting
        self.queue_timeout = config.queue_timeout
        self.long_prefill_cap = config.long_prefill_cap
        self.long_prefill_adaptive = config.long_prefill_adaptive
        self.reserve_full_prompt = config.reserve_full_prompt
        self.max_loras = config.max_loras
        self.clock = clock
        self._rank = ((lambda s: s.order_key) if self.policy == "priority"
                      else (lambda s: s.order_key[1:]))
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_reserved = 0          # pending n > 1 children of running sequences
        # KV transfer (engine/remote_kv.py), set by the engine when configured.
        self.remote = None
        self._next_timeout_check = 0.0

    # ---- queues ---------------------------------------------------------------------------
    def check_room(self, on_the_way: int = 0) -> None:
        """Raise QueueFullError if the waiting queue (plus ``on_the_way`` requests accepted
        but not queued yet) is at its bound."""
        if len(self.waiting) + on_the_way >= self.max_waiting:
            raise QueueFullError(self.max_waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; refused at once when the waiting queue is full."""
        self.check_room()
        bisect.insort(self.waiting, seq, key=self._rank)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    @property
    def num_swap_preemptions(self) -> int:
        return self.stats.num_swap_preemptions

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _has_slots_for(self, seq: Sequence) -> bool:
        """Room in the batch for ``seq`` and its pending n > 1 children (running sequences
        and the children reserved for them take slots)."""
        taken = len(self.running) + self.num_reserved
        return taken + 1 + len(seq.pending_children) <= self.max_num_active_seqs

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run beside the running sequences: no adapter, or one of
        theirs, or room for one more adapter (``max_loras``)."""
        if not seq.lora_id:
            return True
        running = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in running or len(running) < self.max_loras

    def _next_waiting(self) -> int:
        """The index of the waiting sequence to admit next: the head, or with LoRA the first
        one whose adapter may run now; -1 when none may."""
        head = self.waiting[0]
        if not head.lora_id or self._lora_fits(head):
            return 0
        running = {s.lora_id for s in self.running if s.lora_id}
        room = len(running) < self.max_loras
        return next((i for i, s in enumerate(self.waiting)
                     if not s.lora_id or s.lora_id in running or room), -1)

    def _enter_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.num_reserved += len(seq.pending_children)
        bisect.insort(self.running, seq, key=self._rank)

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.num_reserved -= len(seq.pending_children)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._leave_running(seq)
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            self.block_manager.swap_out(seq, out.swap_out)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=self._rank)
            self.stats.num_swap_preemptions += 1
            mode = "swap"
        else:   # recompute (also when the host pool is full)
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=self._rank)
            mode = "recompute"
        out.preempted.append(seq)
        logger.info("preempted request %s (%s): KV cache full", seq.request_id, mode)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        if self.queue_timeout is not None and now >= self._next_timeout_check:
            self._expire(now, out)
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        if self.policy == "priority":
            self._preempt_for_priority(out, budget)
        out_of_memory = False
        # No cap for the only request: there is nobody to starve (as vLLM).
        queued = len(self.running) + len(self.waiting) + len(self.swapped)
        cap = self.long_prefill_cap if self.long_prefill_cap and queued > 1 else budget
        if cap < budget and self.long_prefill_adaptive:
            cap = max(cap, budget // queued)

        # speculative decoding: the most drafts a sequence gets at this batch size
        drafts = self.proposer.drafts_for_batch(len(self.running)) if self.proposer else 0
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted to make room for another
                continue
            if seq.finishing:      # its token from the running step is its last: nothing to do
                continue
            n = min(seq.num_uncomputed_tokens, budget, cap)
            if drafts and n == 1:
                d = self._draft(seq, min(budget - 1, drafts))
                n += d
                out.drafted |= d > 0
            while not bm.can_append(seq, n):
                if seq.draft_token_ids:     # drafts give way before anyone is preempted
                    seq.draft_token_ids, n = [], 1
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                out_of_memory = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.append(seq, n, out.copies)
            out.add(seq, n)
            budget -= n
        if out_of_memory:
            return out

        # Swapped-out and waiting sequences come back in rank order (under FCFS a preempted
        # sequence is older than the requests that arrived after it, so it goes first).
        while budget > 0 and (self.swapped or self.waiting):
            if self.swapped and (not self.waiting
                                 or self._rank(self.swapped[0]) < self._rank(self.waiting[0])):
                if not self._swap_in_head(out, min(budget, cap)):
                    break
            elif not self._admit_head(out, min(budget, cap), now):
                break
            budget = self.max_num_batched_tokens - out.total_tokens
        return out

    def _draft(self, seq: Sequence, room: int) -> int:
        """Speculative decoding: propose drafts to follow a decoding sequence's last token
        (at most ``room``, and none past its max_tokens); how many."""
        if (seq.tokens_in_flight or not seq.output_token_ids or seq.num_uncomputed_tokens != 1
                or not takes_drafts(seq)):
            return 0
        limit = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        seq.draft_token_ids = self.proposer.propose(seq, limit)
        return len(seq.draft_token_ids)

    def settle_drafts(self, seq: Sequence, accepted: int) -> None:
        """The step's drafts of ``seq`` were verified and the first ``accepted`` taken as
        its tokens (they are on the sequence now): their KV is computed; the slots of the
        rejected ones are left to be overwritten, and blocks beyond the sequence's tokens are
        freed. Blocks enter the prefix cache only up to the computed, accepted tokens."""
        st = self.stats
        st.spec_decode_num_drafts += 1
        st.spec_decode_num_draft_tokens += len(seq.draft_token_ids)
        st.spec_decode_num_accepted_tokens += accepted
        per_pos = st.spec_decode_accepted_per_pos
        if len(per_pos) < accepted:
            per_pos.extend([0] * (accepted - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1
        if seq.spec_metrics is not None:
            seq.spec_metrics.observe(len(seq.draft_token_ids), accepted)
        seq.draft_token_ids = []
        if seq.status is not SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens += accepted
        self.block_manager.trim(seq)
        self.block_manager.register_computed(seq)

    def _swap_in_head(self, out: SchedulerOutput, budget: int) -> bool:
        seq = self.swapped[0]
        if seq.tokens_in_flight:        # its last token is in flight: next step
            return False
        if not self._has_slots_for(seq) or not self._lora_fits(seq):
            return False
        n = min(seq.num_uncomputed_tokens, budget)
        if not self.block_manager.can_swap_in(seq, n, keep_watermark=bool(self.running)):
            return False
        self.swapped.pop(0)
        self.block_manager.swap_in(seq, n, out.swap_in, out.copies)
        self._enter_running(seq)
        out.add(seq, n)
        return True

    def _admit_head(self, out: SchedulerOutput, budget: int, now: float) -> bool:
        bm = self.block_manager
        i = self._next_waiting()
        if i < 0:
            return False
        seq = self.waiting[i]
        if seq.tokens_in_flight:        # preempted while its step ran: wait for its token
            return False
        if seq.block_table:             # its remote KV arrived: compute the rest
            return self._admit_loaded(out, budget, now, i)
        matched = bm.match_prefix(seq)
        if self.remote is not None and self.remote.wants_load(seq):
            ext = self.remote.num_external_tokens(seq, len(matched) * bm.block_size)
            if ext is None:     # the connector is still looking it up (off this thread)
                return False
            if ext > 0:     # blocks for the remote tokens; no batch slot, no token budget
                if not self._fits(seq, matched, ext):
                    return False
                self.waiting.pop(i)
                bm.admit(seq, matched, ext, out.copies)
                self._count_external_lookup(seq, len(matched) * bm.block_size, ext)
                self.remote.start_load(seq, ext)
                return True
        if not self._has_slots_for(seq):
            return False
        n = seq.num_tokens - len(matched) * bm.block_size
        if n > budget:
            if not self.enable_chunked_prefill:
                return False
            n = budget
        if not self._fits(seq, matched, n):
            return False
        self.waiting.pop(i)
        bm.admit(seq, matched, n, out.copies)
        if self.remote is not None:
            self._count_external_lookup(seq, len(matched) * bm.block_size, 0)
        self._start(seq, n, now, out)
        return True

    def _fits(self, seq: Sequence, matched: list[int], n: int) -> bool:
        """Whether the pool can take waiting ``seq`` with ``n`` new tokens after its cached
        ``matched`` blocks (keeping the watermark while others run); with
        ``reserve_full_prompt``, the whole of what it has left to compute must fit."""
        bm = self.block_manager
        if self.reserve_full_prompt:
            n = max(n, seq.num_tokens - len(matched) * bm.block_size)
        return bm.can_admit(seq, matched, n, keep_watermark=bool(self.running))

    def _count_external_lookup(self, seq: Sequence, local: int, loaded: int) -> None:
        """vLLM's external prefix cache counters, as its scheduler records a KV connector's
        lookup at admission: the prompt tokens not found locally, and those loaded."""
        if seq.num_preemptions == 0:
            self.stats.external_prefix_cache_queries += seq.num_tokens - local
            self.stats.external_prefix_cache_hits += loaded

    def _start(self, seq: Sequence, n: int, now: float, out: SchedulerOutput) -> None:
        """An admitted waiting sequence runs ``n`` tokens this step."""
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
            seq.num_cached_tokens = seq.num_computed_tokens
        self._enter_running(seq)
        out.add(seq, n)

    def _admit_loaded(self, out: SchedulerOutput, budget: int, now: float,
                      i: int = 0) -> bool:
        """A request whose prompt KV was loaded from another instance (waiting ``i``): it
        holds the blocks of the loaded tokens and computes the rest (at least the last
        prompt token)."""
        seq = self.waiting[i]
        if not self._has_slots_for(seq):
            return False
        n = seq.num_uncomputed_tokens
        if n > budget:
            if not self.enable_chunked_prefill:
                return False
            n = budget
        if not self.block_manager.can_append(seq, n):
            return False
        self.waiting.pop(i)
        self.block_manager.append(seq, n, out.copies)
        self._start(seq, n, now, out)
        return True

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        self._next_timeout_check = now + min(0.1, self.queue_timeout / 4)
        deadline = now - self.queue_timeout
        expired = [s for s in self.waiting
                   if s.first_scheduled_time is None and s.arrival_time < deadline]
        for seq in expired:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED_TIMEOUT
            out.timed_out.append(seq)
            logger.info("request %s timed out after %.1f s in the queue",
                        seq.request_id, now - seq.arrival_time)

    def _preempt_for_priority(self, out: SchedulerOutput, budget: int) -> None:
        """Make room for a waiting request that outranks running ones."""
        bm = self.block_manager
        while self.waiting and self.running:
            head, worst = self.waiting[0], self.running[-1]
            if worst.priority <= head.priority or head.tokens_in_flight:
                return
            matched = bm.match_prefix(head)
            n = min(head.num_tokens - len(matched) * bm.block_size, budget)
            if self._has_slots_for(head) and self._fits(head, matched, n):
                return
            self._preempt(worst, out)

    # ---- after a step ---------------------------------------------------------------------
    def after_step(self, out: SchedulerOutput) -> None:
        """The step's tokens are computed (or, with async scheduling, will be before the next
        step runs): advance the sequences and cache their full blocks. Sequences that ended
        meanwhile are skipped. The tokens must be known by now (no placeholders)."""
        bm = self.block_manager
        for seq, n in zip(out.seqs, out.num_tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # drafts count once verified (settle_drafts): their tokens are not known yet
            seq.num_computed_tokens += n - len(seq.draft_token_ids)
            bm.register_computed(seq)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start the parent's pending n > 1 children on its blocks (its prompt is computed)."""
        children, parent.pending_children = parent.pending_children, []
        self.num_reserved -= len(children)
        for child in children:
            self.block_manager.fork(parent, child)
            child.first_scheduled_time = parent.first_scheduled_time
            self._enter_running(child)
        return children

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence in any state, freeing its device and host blocks at once."""
        seq.draft_token_ids = []
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.remote is not None and self.remote.finish(seq, status):
            seq.status = status         # the blocks stay until the transfer ends
            return
        seq.status = status
        self.block_manager.free(seq)
