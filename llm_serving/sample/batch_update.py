"""The persistent batch as custom logits processors see it: each sampled row's request, and
the ``BatchUpdate`` that takes last step's rows to this step's.

A step's rows are its sampled sequences in the order the scheduler gave them; a request that
does not sample in a step (a prompt chunk before its last, a preempted one) leaves the batch
and is added again when it samples next. The update keeps vLLM's contract: removed rows, then
added ones (each put where it belongs when that row is free, else on a free row and moved),
then moves (one-way onto a free row, or swaps for rows that trade places), so that after it
row i holds the request of this step's row i, and no row is both removed and added.
"""
from __future__ import annotations

from typing import Optional, Sequence

from llm_serving.sample.logits_processor import BatchUpdate, MoveDirectionality


class PersistentBatch:
    """Request keys by row, and each request's live output token list."""

    def __init__(self):
        self.keys: list[int] = []
        self.outputs: dict[int, list] = {}      # key -> its output tokens (grows)

    def update(self, keys: Sequence[int], added: dict) -> Optional[BatchUpdate]:
        """Make ``keys`` (this step's rows) the batch; ``added`` maps every key not in the
        previous step to (params, prompt token ids, output token ids). None: no change."""
        keys = list(keys)
        prev = self.keys
        if keys == prev:
            return None
        where = {k: i for i, k in enumerate(prev)}
        now = set(keys)
        missing = [k for k in keys if k not in where and k not in added]
        if missing:
            raise RuntimeError(f"custom logits processors: no parameters were sent for the "
                               f"{len(missing)} request(s) joining the batch")
        removed = {i for i, k in enumerate(prev) if k not in now}
        at = {i: k for i, k in enumerate(prev) if k in now}     # survivors, by row
        pos = {k: i for i, k in at.items()}
        size = max(len(prev), len(keys))
        spare = (i for i in range(size) if i not in at)
        taken: set[int] = set()
        adds = []
        for row, k in enumerate(keys):
            if k in where:
                continue
            if row in at or row in taken:
                row = next(i for i in spare if i not in taken and i not in at)
            taken.add(row)
            at[row] = k
            pos[k] = row
            params, prompt, output = added[k]
            self.outputs[k] = output
            adds.append((row, params, prompt, output))
        for k in prev:
            if k not in now:
                self.outputs.pop(k, None)
        moves = _moves(at, pos, keys)
        self.keys = keys
        return BatchUpdate(batch_size=len(keys), removed=sorted(removed - taken, reverse=True),
                           added=adds, moved=moves)

    def append(self, token_ids) -> None:
        """The tokens this step sampled, row by row, at the end of each row's output list."""
        outputs, keys = self.outputs, self.keys
        for row, token in enumerate(token_ids.tolist()):
            outputs[keys[row]].append(token)

    def clear(self) -> None:
        self.keys = []
        self.outputs = {}


def _moves(at: dict, pos: dict, keys: list) -> list:
    """The moves that bring every key to its row in ``keys`` (``at``: row -> key now,
    ``pos``: key -> row now; both updated): a one-way move onto a free row first, and where
    only cycles are left, a swap."""
    todo = [k for row, k in enumerate(keys) if pos[k] != row]
    if not todo:
        return []
    target = {k: row for row, k in enumerate(keys)}
    moves = []
    while todo:
        stuck = []
        for k in todo:
            b = target[k]
            if b in at:
                stuck.append(k)
                continue
            a = pos[k]
            moves.append((a, b, MoveDirectionality.UNIDIRECTIONAL))
            del at[a]
            at[b], pos[k] = k, b
        if len(stuck) == len(todo):      # cycles only: swap one key into place
            k = stuck[0]
            a, b = pos[k], target[k]
            other = at[b]
            moves.append((a, b, MoveDirectionality.SWAP))
            at[a], at[b], pos[other], pos[k] = other, k, a, b
            stuck = [s for s in stuck if pos[s] != target[s]]
        todo = stuck
    return moves
