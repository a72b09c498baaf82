"""A pooling request's parameters (vLLM's ``PoolingParams`` for the embed task)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PoolingParams:
    """``dimensions``: keep the first ``dimensions`` values (Matryoshka models only);
    ``use_activation``: L2-normalize (None: the server's pooler default)."""
    dimensions: Optional[int] = None
    use_activation: Optional[bool] = None
    task: str = "embed"

    def __post_init__(self):
        if self.task != "embed":
            raise ValueError(f"task: {self.task!r} is not served here (only embed)")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation: expected true or false, got "
                             f"{self.use_activation!r}")
