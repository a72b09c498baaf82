"""``--dump-logits DIR``: save the raw logits of every request at every N-th output position,
for the accuracy harness (``clients/compare_logits.py``). Off by default; when off, nothing of
it runs in the step loop.

File names come from the request's content and the output position, so dumps from runs at any
batch size (or on another build) pair up file by file.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from llm_serving.config import DumpConfig
from llm_serving.engine.sequence import Sequence

WARM_UP_ID = "__warm_up__"      # the engine's warm-up request: never dumped


def dump_key(prompt_token_ids, seed, index: int = 0) -> str:
    """The file name stem of a request's dumps (``{key}_pos{N}.npy``): its prompt tokens, seed
    and sample index, so runs of the same requests pair up whatever the batch."""
    return hashlib.sha1(np.asarray(prompt_token_ids, np.int64).tobytes()
                        + repr((seed, index)).encode()).hexdigest()[:20]


class LogitsDumper:
    def __init__(self, config: DumpConfig):
        self.dir = Path(config.directory)
        self.every = config.every

    def plan(self, sampled: list[Sequence]) -> list[tuple[int, str]]:
        """(sampled row, file name) of the rows whose logits this step saves."""
        plan = []
        for row, seq in enumerate(sampled):
            pos = seq.num_output_tokens + seq.tokens_in_flight
            if pos % self.every == 0 and seq.request_id != WARM_UP_ID:
                key = dump_key(seq.prompt_token_ids, seq.params.seed, seq.index)
                plan.append((row, f"{key}_pos{pos}.npy"))
        return plan

    @staticmethod
    def rows(plan: list[tuple[int, str]]) -> np.ndarray:
        return np.asarray([r for r, _ in plan], np.int32)

    def save(self, plan: list[tuple[int, str]], logits: np.ndarray) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for k, (_, name) in enumerate(plan):
            np.save(self.dir / name, logits[k])
