"""A pooling request's parameters (vLLM's ``PoolingParams`` for the embed and classify tasks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# vLLM's word for the tasks it removed
_REMOVED_TASKS = {"score": "the score task was removed (vLLM); use classify instead",
                  "encode": "the encode task was removed (vLLM); use token_embed or "
                            "token_classify instead"}


@dataclass
class PoolingParams:
    """``dimensions``: keep the first ``dimensions`` values (Matryoshka models only);
    ``use_activation``: L2-normalize an embedding, or apply a classifier's softmax / sigmoid
    (None: the server's pooler default); ``task``: embed or classify (None: the model's)."""
    dimensions: Optional[int] = None
    use_activation: Optional[bool] = None
    task: Optional[str] = None

    def __post_init__(self):
        if self.task in _REMOVED_TASKS:
            raise ValueError(f"task: {_REMOVED_TASKS[self.task]}")
        if self.task not in (None, "embed", "classify"):
            raise ValueError(f"task: {self.task!r} is not served here (embed or classify)")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation: expected true or false, got "
                             f"{self.use_activation!r}")
