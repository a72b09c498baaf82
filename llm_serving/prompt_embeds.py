"""vLLM's prompt embeddings (``enable_prompt_embeds``): a prompt given as its input embeddings,
a (tokens, hidden_size) float tensor, instead of token ids.

Over HTTP ``prompt_embeds`` is base64 of ``torch.save(tensor)``. It is read as vLLM reads it
(``torch.load(..., weights_only=True)``: plain tensors only, nothing in the pickle runs), but
without torch, by the restricted unpickler that reads PyTorch checkpoints
(``model_executor/torch_bin.py``). Offline, ``LLM.generate`` takes ``{"prompt_embeds": t}``
with a torch tensor or a NumPy array. Either way the rows become a float32 [tokens, hidden]
array that rides on the request's sequence (kept for a recompute after preemption) and goes
to the model runner, a step's rows at a time, in ``StepInput.embeds``.

A prompt may also mix token ids and embeddings (vLLM's mixed form, which its chat route makes
of a message's ``{"type": "prompt_embeds", "data": ...}`` parts): offline as vLLM takes it,
``{"prompt_embeds": t, "prompt_token_ids": ids, "prompt_is_token_ids": mask}`` with ``t``
as long as the prompt, or compact, as the chat route gives it, with ``prompt_embeds`` only the
embedded rows and ``prompt_embeds_positions`` their positions. Either way the sequence keeps
the embedded rows and their positions only (``mixed_prompt``).
"""
from __future__ import annotations

import base64
import binascii
from typing import Optional

import numpy as np

FIELD = "prompt_embeds"
MASK = "prompt_is_token_ids"            # vLLM's mixed form: True where the token id is used
POSITIONS = "prompt_embeds_positions"   # the compact mixed form: the rows' prompt positions
NOT_ENABLED = (f"{FIELD}: prompt embeddings are taken with enable_prompt_embeds=True "
               "(--enable-prompt-embeds)")


def decode_prompt_embeds(data, max_model_len: int, hidden_size: int) -> np.ndarray:
    """An HTTP ``prompt_embeds`` string (base64 of torch.save's bytes) as its tensor's array;
    ValueError naming the field. A string longer than max_model_len float64 rows could be is
    refused before it is decoded."""
    from llm_serving.model_executor.torch_bin import read_torch_tensor
    if not isinstance(data, str):
        raise ValueError(f"{FIELD}: expected a base64 string of torch.save(tensor)'s bytes "
                         f"(or a list of them), got a {type(data).__name__}")
    most = 4 * (max_model_len * hidden_size * 8 + (1 << 16)) // 3
    if len(data) > most:
        raise ValueError(f"{FIELD}: {len(data)} base64 characters are more than "
                         f"{max_model_len} rows of {hidden_size} floats take")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{FIELD}: not valid base64") from None
    try:
        return read_torch_tensor(raw, FIELD)
    except ValueError as e:
        raise ValueError(f"{FIELD}: could not be read as a torch.save'd tensor ({e})") from None


def as_prompt_embeds(value, hidden_size: int, max_model_len: int) -> np.ndarray:
    """The prompt's embeddings as a float32 [tokens, hidden_size] array, checked as vLLM
    checks them: 2-D, or 3-D with a batch of one; the model's hidden size; a floating-point
    dtype (cast to float32); at least one row, and room for one generated token under
    max_model_len. ValueError naming the field."""
    arr = _to_numpy(value)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2:
        raise ValueError(f"{FIELD}: must be a 2-D tensor of shape (num_tokens, hidden_size) "
                         f"(or (1, num_tokens, hidden_size)); got shape {tuple(arr.shape)}")
    if arr.shape[1] != hidden_size:
        raise ValueError(f"{FIELD}: hidden size {arr.shape[1]} does not match the model's "
                         f"hidden_size {hidden_size}")
    if arr.dtype.kind != "f":
        raise ValueError(f"{FIELD}: dtype {arr.dtype} is not a floating-point type")
    if not len(arr):
        raise ValueError(f"{FIELD}: it is empty (it has no rows)")
    if len(arr) >= max_model_len:
        raise ValueError(f"{FIELD}: it has {len(arr)} rows (tokens); the maximum model length "
                         f"is {max_model_len}, leaving no room to generate")
    out = np.array(arr, np.float32, order="C")     # its own copy: kept for recomputes
    if not np.isfinite(out).all():
        raise ValueError(f"{FIELD}: holds values that are not finite (NaN or infinity)")
    out.flags.writeable = False
    return out


def mixed_prompt(prompt: dict, hidden_size: int, max_model_len: int
                 ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """An EmbedsPrompt's (token ids, embedded positions int32 [E], their rows float32 [E,
    hidden]): placeholder 0s at every position for embeddings alone, or the mixed forms'
    token ids with 0s at the embedded positions. ValueError naming the field."""
    rows = as_prompt_embeds(prompt[FIELD], hidden_size, max_model_len)
    ids = prompt.get("prompt_token_ids")
    if ids is None:
        for key in (MASK, POSITIONS):
            if key in prompt:
                raise ValueError(f"{key}: given without prompt_token_ids, the mixed prompt's "
                                 "token ids")
        return [0] * len(rows), np.arange(len(rows), dtype=np.int32), rows
    try:
        ids = [int(t) for t in ids]
    except (TypeError, ValueError):
        raise ValueError("prompt_token_ids must be a list of integers") from None
    if (MASK in prompt) == (POSITIONS in prompt):
        raise ValueError(f"{MASK}: a prompt of prompt_token_ids and {FIELD} needs it (True "
                         f"where the token id is used, False where the {FIELD} row is)")
    if MASK in prompt:                  # vLLM's: a row per position, a mask to pick them
        mask = np.asarray(prompt[MASK])
        if mask.dtype != bool or mask.shape != (len(ids),) or len(rows) != len(ids):
            raise ValueError(f"{MASK}: must be a list of booleans as long as "
                             f"prompt_token_ids ({len(ids)}) and {FIELD} ({len(rows)})")
        pos = np.flatnonzero(~mask).astype(np.int32)
        rows = rows[pos]
        rows.flags.writeable = False
    else:
        pos = np.asarray(prompt[POSITIONS], np.int32)
        if pos.shape != (len(rows),) or (len(pos) and (
                pos[0] < 0 or pos[-1] >= len(ids) or (np.diff(pos) <= 0).any())):
            raise ValueError(f"{POSITIONS}: must be ascending positions of prompt_token_ids, "
                             f"one per {FIELD} row")
    for p in pos.tolist():
        ids[p] = 0          # placeholders (vLLM's too), so that the lookups stay in range
    return ids, pos, rows


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "is_floating_point"):     # a torch tensor
        t = value.detach().cpu()
        if t.is_floating_point() and str(t.dtype) == "torch.bfloat16":
            t = t.float()           # NumPy has no bfloat16; widening is exact
        return t.numpy()
    raise ValueError(f"{FIELD}: expected a torch tensor or a NumPy array, got "
                     f"{type(value).__name__}")


def embeds_of(prompt) -> Optional[object]:
    """A prompt dict's prompt_embeds (None for a string or a dict without them)."""
    return prompt.get(FIELD) if isinstance(prompt, dict) else None
