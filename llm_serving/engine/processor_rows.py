"""The master's half of custom logits processors (sample/custom_logits_processors.py): each
sampled row's request key in the step's SamplingBatch, and, for the requests that joined the
batch since the last step that sampled, their parameters, prompt and output tokens, pickled
(the WorkAgent's PersistentBatch turns them into the processors' BatchUpdate). Only an engine
with processors configured has one."""
from __future__ import annotations

import pickle

import numpy as np


class ProcessorRows:
    def __init__(self):
        self._last: set[int] = set()        # the keys of the last step that sampled

    def apply(self, batch, sampled: list) -> None:
        """Fill ``batch``'s row_keys and added_requests for the ``sampled`` sequences."""
        keys = [s.key for s in sampled]
        added = {s.key: (s.params, list(s.prompt_token_ids), list(s.output_token_ids))
                 for s in sampled if s.key not in self._last}
        self._last = set(keys)
        batch.row_keys = np.asarray(keys, np.int64)
        if added:
            batch.added_requests = np.frombuffer(pickle.dumps(added, protocol=5), np.uint8)


def channel_bytes(max_rows: int, max_model_len: int, params_bytes: int) -> int:
    """What the two fields take in a step at most: a key per row, and every row joining with
    its tokens (at most 5 pickled bytes each) and parameters."""
    return max_rows * (8 + 5 * max_model_len + params_bytes + 256)
