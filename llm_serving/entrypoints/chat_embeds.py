"""vLLM's prompt embeddings inside chat messages (--enable-prompt-embeds): a content part
``{"type": "prompt_embeds", "data": <base64 of torch.save(tensor)>}`` puts the tensor's rows
into the prompt where the part stands, between the chat template's text.

As vLLM, each part is rendered as the marker ``<prompt_embeds>`` (a message's parts joined as
its text parts are), and the rendered prompt's marker is replaced by the tensor's N rows. vLLM
makes the marker a special token; here the rendered text is split at the markers and its
pieces are tokenized one by one (the first with the request's add_special_tokens, as the whole
text would be), which gives the same ids for a tokenizer that splits special tokens out first.
The prompt's token ids hold placeholder 0s at the embedded positions (as vLLM's engine does);
the engine keeps the embedded rows and their positions only (prompt_embeds.mixed_prompt).
"""
from __future__ import annotations

import asyncio
from typing import Optional

import numpy as np

from llm_serving.entrypoints.http_common import HTTPError, translate_error
from llm_serving.prompt_embeds import (FIELD, NOT_ENABLED, POSITIONS, as_prompt_embeds,
                                       decode_prompt_embeds)

MARKER = "<prompt_embeds>"


def embeds_parts(messages: list) -> list[str]:
    """The ``data`` of the messages' prompt_embeds parts, in prompt order ([]: none); a 400
    naming prompt_embeds for a part without data, or the messages for text holding the
    marker (both as vLLM)."""
    data, texts = [], []
    for m in messages:
        parts = m.content if isinstance(m.content, list) else [{"text": m.content or ""}]
        for part in parts:
            if part.get("type") == FIELD:
                d = part.get("data")
                if not isinstance(d, str) or not d:
                    raise HTTPError(400, "prompt_embeds: a prompt_embeds content part "
                                    "needs a non-empty data field, base64 of "
                                    "torch.save(tensor)'s bytes", param=FIELD)
                data.append(d)
            elif isinstance(part.get("text"), str):
                texts.append(part["text"])
    if data and any(MARKER in t for t in texts):
        raise HTTPError(400, f"messages: text may not hold {MARKER!r}, which marks where a "
                        "prompt_embeds part goes", param="messages")
    return data


async def decode_parts(engine, data: list[str]) -> list[np.ndarray]:
    """The parts' (or completions' prompt_embeds') tensors as float32 [rows, hidden] arrays,
    decoded off the event loop; a 400
    naming prompt_embeds (the flag off, a payload that is not a tensor of the model's
    hidden size)."""
    limits = engine.limits
    if not limits.prompt_embeds_size:
        raise HTTPError(400, NOT_ENABLED, param=FIELD)

    def decode() -> list[np.ndarray]:
        return [as_prompt_embeds(decode_prompt_embeds(d, limits.max_model_len,
                                                      limits.prompt_embeds_size),
                                 limits.prompt_embeds_size, limits.max_model_len)
                for d in data]
    try:
        return await asyncio.to_thread(decode)
    except ValueError as e:
        raise translate_error(e) from None


def splice(text: str, arrays: list[np.ndarray], encode, add_special_tokens: bool
           ) -> tuple[list[int], dict]:
    """The rendered prompt's token ids, the arrays' rows in place of its markers, and the
    prompt dict's embeddings fields (their rows and positions). ``encode(text,
    add_special_tokens)``: the route's tokenizer call."""
    pieces = text.split(MARKER)
    if len(pieces) != len(arrays) + 1:
        raise HTTPError(400, f"messages: the chat template rendered {len(pieces) - 1} "
                        f"prompt_embeds markers for {len(arrays)} parts", param="messages")
    ids: list[int] = []
    starts: list[int] = []
    for i, piece in enumerate(pieces):
        if piece or not i:
            ids += encode(piece, add_special_tokens and not i)
        if i < len(arrays):
            starts.append(len(ids))
            ids += [0] * len(arrays[i])
    positions = np.concatenate([np.arange(s, s + len(a), dtype=np.int32)
                                for s, a in zip(starts, arrays)])
    return ids, {FIELD: np.concatenate(arrays), POSITIONS: positions}


def refused_with_embeds(req) -> Optional[str]:
    """The chat request's field not taken beside prompt_embeds parts (None: all taken)."""
    for name in ("truncate_prompt_tokens", "prompt_logprobs"):
        if getattr(req, name, None) is not None:
            return name
    for name in ("echo", "use_beam_search"):
        if getattr(req, name, False):
            return name
    return None
