"""The KV block pools: allocation, reference counts, prefix caching, copy-on-write and swap.

A sequence's block table maps its token positions to physical blocks:
slot(position) = block_table[position // block_size] * block_size + position % block_size.

Prefix caching. Once a block is full and its KV computed, it is entered in a cache keyed by
a hash chain: block i's hash covers its tokens and block i-1's hash. A later sequence whose
prompt starts with the same tokens takes those blocks instead of computing them. A hit must
also match the block's tokens exactly and the cache entry its parent came from, so a hash
collision can never hand out wrong KV. A cached block nobody uses stays in the cache, on an
LRU list, until a fresh block is needed and it is the least recently freed.

The KV of a sequence run with a LoRA adapter is that adapter's, and a request's
``cache_salt`` (vLLM's) sets its own apart: as vLLM, each block's hash covers the adapter's
("lora", name, path) and block 0's the salt too, and the parent checked on a hit of block 0 is
the (adapter id, salt) pair, so blocks are shared only between sequences of the same adapter
and the same salt (or both none). A prompt given as embeddings (vLLM's prompt_embeds) has
placeholder token ids: as vLLM, each of its blocks' hashes covers ("prompt_embeds", the sha256
of the block's rows), and a hit checks that digest as it checks the tokens.

KV cache events (``events``, engine/kv_events.py): the blocks entered in the cache and evicted
from it, and a reset, are recorded for the engine to publish; the hash chain is then vLLM's
sha256 one (a router sees vLLM's hashes), else Python's ``hash``, which is faster.

Copy-on-write. The ``n`` sequences of one request share the prompt's blocks after the fork
(reference counts > 1). Before a sequence writes into a block others still hold, it gets its
own copy; the copy is returned as a (src, dst) pair for the model runner to perform.

Swap. A host-side pool of ``num_cpu_blocks`` blocks takes a preempted sequence's KV (pairs
device -> host) and gives it back later (host -> device).

The block manager only does the bookkeeping; the model runner moves the data.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional

from llm_serving.config import CacheConfig
from llm_serving.engine.kv_cache_residency import KVResidency
from llm_serving.engine.metrics import EngineStats
from llm_serving.engine.sequence import Sequence

_ROOT_HASH = 0x6C6C6D5F73657276   # parent hash of block 0 (Python's hash chain)


def _root_uid(seq: Sequence) -> Optional[tuple]:
    """The parent entry of a sequence's block 0: None, or its (adapter id, salt) (uids of
    entries are ints, so this never names one)."""
    if not seq.lora_id and seq.cache_salt is None:
        return None
    return seq.lora_id, seq.cache_salt


def _extra_keys(seq: Sequence) -> tuple[Optional[tuple], Optional[tuple]]:
    """The extra keys of the sequence's block 0 and of its other blocks, as vLLM's: the
    adapter's ("lora", name, path) on every block, the salt on block 0."""
    lora = (("lora", seq.lora_name, seq.lora_path),) if seq.lora_id else ()
    first = lora + ((("cache_salt", seq.cache_salt),) if seq.cache_salt is not None else ())
    return first or None, lora or None


def _block_extra(seq: Sequence, i: int, bs: int, first, rest) -> Optional[tuple]:
    """Block i's extra keys: ``_extra_keys``' and, for a block of a prompt given as
    embeddings, vLLM's ("prompt_embeds", sha256 of its rows)."""
    keys = rest if i else first
    digest = seq.embeds_digest(i, bs) if seq.prompt_embeds is not None else None
    return keys if digest is None else (keys or ()) + (("prompt_embeds", digest),)


def _block_key(seq: Sequence, i: int, bs: int) -> tuple:
    """What a cache hit on block i must match exactly: its tokens, and the digest of its
    prompt embeddings (an embedded prompt's token ids are placeholders)."""
    tokens = tuple(seq.token_ids(i * bs, (i + 1) * bs))
    if seq.prompt_embeds is None:
        return tokens
    digest = seq.embeds_digest(i, bs)
    return tokens if digest is None else tokens + (digest,)


def _python_hash(parent, tokens: tuple, extra: Optional[tuple]) -> int:
    return hash((_ROOT_HASH if parent is None else parent, tokens, extra))


class BlockManager:
    def __init__(self, config: CacheConfig, stats: Optional[EngineStats] = None,
                 residency: Optional[KVResidency] = None, events=None):
        """``residency``: --kv-cache-metrics' sampling of the blocks (None: off); ``events``:
        a kv_events.KVEventLog to record the prefix cache's changes in (None: events off)."""
        self.stats = stats if stats is not None else EngineStats()
        self.residency = residency
        self.num_blocks = num_blocks = config.num_blocks
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.events = events
        if events is not None:
            from llm_serving.engine.kv_events import BlockHasher
            self._hash = BlockHasher()
        else:
            self._hash = _python_hash
        self.watermark_blocks = int(config.watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()   # LRU order, oldest first
        # Prefix cache entries, one per cached block.
        self.cache: dict[int, int] = {}                   # hash -> block
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.block_tokens: list[Optional[tuple]] = [None] * num_blocks
        self.block_uid: list[Optional[int]] = [None] * num_blocks
        self.block_parent_uid: list[Optional[int]] = [None] * num_blocks
        self._next_uid = 1
        # Host pool for swapped-out sequences.
        self.num_cpu_blocks = config.num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(config.num_cpu_blocks))

    @property
    def prefix_hits(self) -> int:
        """Prompt tokens found in the prefix cache (the counter lives in ``stats``)."""
        return self.stats.prefix_cache_hits

    # ---- pool state -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by sequences (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def cpu_usage(self) -> float:
        return 1.0 - len(self.cpu_free) / self.num_cpu_blocks if self.num_cpu_blocks else 0.0

    def _take(self) -> int:
        if self.free_uncached:
            block = self.free_uncached.popleft()
        else:
            block, _ = self.free_cached.popitem(last=False)
            self._evict(block)
        self.ref_counts[block] = 1
        if self.residency is not None:
            self.residency.taken(block)
        return block

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if self.cache.get(h) == block:
            del self.cache[h]
            if self.events is not None:
                self.events.removed(h)
        self.block_hash[block] = self.block_tokens[block] = None
        self.block_uid[block] = self.block_parent_uid[block] = None

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] < 0:
            raise AssertionError(f"negative reference count on block {block}")
        if self.ref_counts[block] == 0:
            if self.block_uid[block] is not None:
                self.free_cached[block] = None
            else:
                self.free_uncached.append(block)

    def _touch(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_cached[block]
        self.ref_counts[block] += 1
        if self.residency is not None:
            self.residency.hit(block)

    # ---- sizes ----------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cow_needed(self, seq: Sequence) -> bool:
        """True when the sequence's next write lands in a block that others also hold."""
        i, within = divmod(seq.num_computed_tokens, self.block_size)
        return within != 0 and i < len(seq.block_table) and \
            self.ref_counts[seq.block_table[i]] > 1

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        grow = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(0, grow) + self._cow_needed(seq)

    # ---- growing a running sequence -------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int, copies: list) -> None:
        """Make room for ``num_new_tokens`` more tokens; copy-on-write pairs go to ``copies``."""
        if self._cow_needed(seq):
            i = seq.num_computed_tokens // self.block_size
            src = seq.block_table[i]
            dst = self._take()
            self._release(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        for _ in range(self._blocks_for(seq.num_computed_tokens + num_new_tokens)
                       - len(seq.block_table)):
            seq.block_table.append(self._take())

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's tokens (held for drafts it rejected)."""
        keep = self._blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    # ---- admitting a waiting sequence -----------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs, hashes = self.block_size, seq.block_hashes
        if len(hashes) >= num_full_blocks:
            return
        first, rest = _extra_keys(seq)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = self._hash(parent, tuple(seq.token_ids(i * bs, (i + 1) * bs)),
                                _block_extra(seq, i, bs, first, rest))
            hashes.append(parent)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the start of the sequence's tokens (not yet taken); none
        for a request with skip_reading_prefix_cache (vLLM's).

        At least one token is always left to compute, since its logits are needed. So are
        the rows whose prompt logprobs are still to be computed: a request that asks for them
        reuses only the blocks before its first unscored prompt token.
        """
        if not self.enable_prefix_caching or getattr(seq.params, "skip_reading_prefix_cache",
                                                     None):
            return []
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        scored = seq.prompt_logprobs
        if scored is not None and len(scored) < len(seq.prompt_token_ids):
            limit = min(limit, (len(scored) - 1) // bs)
        self._ensure_hashes(seq, limit)
        matched: list[int] = []
        parent_uid = _root_uid(seq)
        for i in range(limit):
            block = self.cache.get(seq.block_hashes[i])
            if (block is None or self.block_parent_uid[block] != parent_uid
                    or self.block_tokens[block] != _block_key(seq, i, bs)):
                break
            matched.append(block)
            parent_uid = self.block_uid[block]
        return matched

    def can_admit(self, seq: Sequence, matched: list[int], num_new_tokens: int,
                  keep_watermark: bool = True) -> bool:
        computed = len(matched) * self.block_size
        need = self._blocks_for(computed + num_new_tokens) - len(matched)
        need += sum(1 for b in matched if self.ref_counts[b] == 0)   # leave the free pool
        reserve = self.watermark_blocks if keep_watermark else 0
        return need + reserve <= self.num_free_blocks

    def admit(self, seq: Sequence, matched: list[int], num_new_tokens: int,
              copies: list) -> None:
        assert not seq.block_table, "admitting a sequence that still holds blocks"
        for block in matched:
            self._touch(block)
        seq.block_table = list(matched)
        seq.cached_uids = [self.block_uid[b] for b in matched]
        seq.num_computed_tokens = len(matched) * self.block_size
        if self.enable_prefix_caching:
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += seq.num_computed_tokens
        self.append(seq, num_new_tokens, copies)

    # ---- after a step ---------------------------------------------------------------------
    def register_computed(self, seq: Sequence) -> None:
        """Enter the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        uids = seq.cached_uids
        if len(uids) >= full:
            return
        self._ensure_hashes(seq, full)
        stored = []                             # the indices of blocks entered now
        for i in range(len(uids), full):
            parent_uid = uids[i - 1] if i else _root_uid(seq)
            if i and parent_uid is None:        # the chain above is not cached
                uids.append(None)
                continue
            h = seq.block_hashes[i]
            tokens = _block_key(seq, i, bs)
            existing = self.cache.get(h)
            if existing is not None:
                same = (self.block_parent_uid[existing] == parent_uid
                        and self.block_tokens[existing] == tokens)
                uids.append(self.block_uid[existing] if same else None)
                continue
            block = seq.block_table[i]
            if self.block_uid[block] is not None:      # already an entry under another chain
                uids.append(None)
                continue
            uid = self._next_uid
            self._next_uid += 1
            self.cache[h] = block
            self.block_hash[block], self.block_tokens[block] = h, tokens
            self.block_uid[block], self.block_parent_uid[block] = uid, parent_uid
            uids.append(uid)
            stored.append(i)
        if stored and self.events is not None:
            self._record_stored(seq, stored)

    def _record_stored(self, seq: Sequence, stored: list[int]) -> None:
        """One BlockStored event per run of consecutive blocks entered in the cache."""
        bs, hashes = self.block_size, seq.block_hashes
        first, rest = _extra_keys(seq)
        start = 0
        for j in range(1, len(stored) + 1):
            if j < len(stored) and stored[j] == stored[j - 1] + 1:
                continue
            a, b = stored[start], stored[j - 1] + 1
            extra = []
            for i in range(a, b):
                keys = _block_extra(seq, i, bs, first, rest)
                extra.append(tuple(k[1] for k in keys) if keys else None)
            self.events.stored(hashes[a:b], hashes[a - 1] if a else None,
                               seq.token_ids(a * bs, b * bs), seq.lora_id, seq.lora_name,
                               extra)
            start = j

    # ---- n > 1 ----------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's computed blocks (copy-on-write on its first write).
        A block the parent holds for a step still running (async scheduling) is not shared:
        the child would write its own token into the same slot. A parent swapped out (its
        step's sample collected after it was preempted) holds its KV on the host: the child
        then computes its own from the start, as after a recompute preemption."""
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_tokens = parent.num_cached_tokens
        if parent.cpu_block_table:
            child.block_table, child.cached_uids, child.num_computed_tokens = [], [], 0
            return
        shared = parent.block_table[:self._blocks_for(parent.num_computed_tokens)]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        child.num_computed_tokens = parent.num_computed_tokens
        child.cached_uids = list(parent.cached_uids)

    # ---- freeing --------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Give back the sequence's device and host blocks; it must recompute from scratch."""
        # Tail blocks first, so they leave the LRU cache before the shared head blocks.
        for block in reversed(seq.block_table):
            self._release(block)
        self.cpu_free.extend(seq.cpu_block_table)
        seq.block_table = []
        seq.cpu_block_table = []
        seq.cached_uids = []
        seq.num_computed_tokens = 0

    def detach(self, seq: Sequence) -> list[int]:
        """Take the sequence's device blocks away from it without freeing them (a KV
        transfer still reads or writes them); ``release_blocks`` frees them later."""
        blocks = seq.block_table
        self.cpu_free.extend(seq.cpu_block_table)
        seq.block_table, seq.cpu_block_table, seq.cached_uids = [], [], []
        seq.num_computed_tokens = 0
        return blocks

    def release_blocks(self, blocks: list[int]) -> None:
        """Free blocks taken by ``detach``."""
        for block in reversed(blocks):
            self._release(block)

    # ---- swap -----------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence, pairs: list) -> None:
        """Move the sequence's KV to the host pool: (device block, host block) to ``pairs``."""
        for block in seq.block_table:
            cpu = self.cpu_free.popleft()
            pairs.append((block, cpu))
            seq.cpu_block_table.append(cpu)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def can_swap_in(self, seq: Sequence, num_new_tokens: int,
                    keep_watermark: bool = True) -> bool:
        total = self._blocks_for(seq.num_computed_tokens + num_new_tokens)
        reserve = self.watermark_blocks if keep_watermark else 0
        return max(total, len(seq.cpu_block_table)) + reserve <= self.num_free_blocks

    def swap_in(self, seq: Sequence, num_new_tokens: int, pairs: list, copies: list) -> None:
        """Bring the sequence's KV back: (host block, device block) to ``pairs``."""
        for cpu in seq.cpu_block_table:
            block = self._take()
            pairs.append((cpu, block))
            seq.block_table.append(block)
        self.cpu_free.extend(seq.cpu_block_table)
        seq.cpu_block_table = []
        self.append(seq, num_new_tokens, copies)

    def reset(self) -> None:
        """Forget all KV (the model runner lost it): every block free, the prefix cache empty.
        Only valid once no sequence holds blocks."""
        assert not any(self.ref_counts), "reset while sequences hold blocks"
        if self.events is not None:
            self.events.cleared()
        self.free_uncached = deque(range(self.num_blocks))
        self.free_cached.clear()
        self.cache.clear()
        n = self.num_blocks
        self.block_hash, self.block_tokens = [None] * n, [None] * n
        self.block_uid, self.block_parent_uid = [None] * n, [None] * n
        self.cpu_free = deque(range(self.num_cpu_blocks))
        if self.residency is not None:
            self.residency.reset()

    # ---- checks (used by tests) -----------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        expect = [0] * self.num_blocks
        cpu_held = []
        for seq in live:
            for block in seq.block_table:
                expect[block] += 1
            cpu_held.extend(seq.cpu_block_table)
        assert expect == self.ref_counts, "reference counts do not match the block tables"
        free = set(self.free_uncached) | set(self.free_cached)
        assert len(free) == len(self.free_uncached) + len(self.free_cached)
        assert free == {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        assert all(self.block_uid[b] is not None for b in self.free_cached)
        for h, block in self.cache.items():
            assert self.block_hash[block] == h
        assert sorted(cpu_held + list(self.cpu_free)) == list(range(self.num_cpu_blocks))
