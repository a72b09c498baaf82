"""``SupportsMultiStream``: the marker a causal LM class carries when its model builds the
multi-stream layers and takes a ``multistream_config`` (seed 000, step 2)."""
from __future__ import annotations

from typing import ClassVar


class SupportsMultiStream:
    supports_multi_stream: ClassVar[bool] = True


def is_multi_stream_model(model) -> bool:
    return bool(getattr(model, "supports_multi_stream", False))
