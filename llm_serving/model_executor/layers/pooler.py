"""Pooling (embedding models, vLLM's ``--runner pooling``): one vector per prompt from the
decoder's final-norm hidden states.

A prompt may run over several prefill chunks, so pooling is split in two:

- in the model runner, ``pool_rows`` sums the hidden states of each pooled row range of the
  step (a chunk's rows for MEAN, its last row for LAST, its first for CLS): float32 [P, H];
- on the master, the output processor adds a prompt's parts up and ``finish_embedding``
  divides (MEAN), truncates (Matryoshka ``dimensions``) and L2-normalizes.

No LM head runs for these rows and nothing is sampled. Only numpy here: the master imports it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's --pooler-config keys taken here (vLLM 0.32's names)
_POOLER_KEYS = ("pooling_type", "seq_pooling_type", "use_activation", "dimensions", "task")
# sentence-transformers' modules.json types (vLLM's get_pooling_config)
_ST_POOLING = {"sentence_transformers.models.Pooling",
               "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}
_ST_NORMALIZE = {"sentence_transformers.models.Normalize",
                 "sentence_transformers.base.modules.normalize.Normalize",
                 "sentence_transformers.sentence_transformer.modules.normalize.Normalize"}


@dataclass(frozen=True)
class PoolerSettings:
    """How a pooling runner pools, resolved at start-up."""
    pooling_type: str = "LAST"               # LAST, MEAN or CLS
    normalize: bool = True                   # vLLM's use_activation default for embed
    dimensions: Optional[int] = None         # the server's default Matryoshka truncation
    hidden_size: int = 0
    is_matryoshka: bool = False              # config.json declares Matryoshka dimensions
    matryoshka_dimensions: Optional[tuple] = None


def _st_pooling(model_dir: str) -> dict:
    """The pooling a sentence-transformers model directory declares (modules.json and its
    Pooling module's config.json), as vLLM reads it: {} when there is none."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        modules = json.load(f)
    out = {"use_activation": any(m.get("type") in _ST_NORMALIZE for m in modules)}
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING), None)
    if pooling is not None:
        cfg_path = os.path.join(model_dir, pooling.get("path", ""), "config.json")
        cfg = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        for key, value in cfg.items():
            if key == "pooling_mode" and isinstance(value, str):
                name = value
            elif value is True:
                name = key
            else:
                continue
            name = name.replace("pooling_mode_", "").split("_", 1)[0]
            name = "LAST" if "lasttoken" in name else name.upper()
            if name in POOLING_TYPES:
                out["seq_pooling_type"] = name
    return out


def resolve_pooler(user: Optional[dict], model_dir: str, hidden_size: int, hf: dict,
                   error) -> PoolerSettings:
    """The pooler of a pooling runner: the user's --pooler-config first, then the model
    directory's sentence-transformers files, then vLLM's decoder default (LAST, normalized).
    ``error(key, message)`` makes the exception raised for a bad key."""
    user = dict(user or {})
    if "normalize" in user:
        raise error("pooler_config", "normalize was removed in vLLM; use use_activation")
    unknown = sorted(set(user) - set(_POOLER_KEYS))
    if unknown:
        raise error("pooler_config", f"unknown key {unknown[0]!r}; this server takes "
                    + ", ".join(_POOLER_KEYS))
    if user.get("task", "embed") != "embed":
        raise error("pooler_config", f"task {user['task']!r} is not served here (only embed)")
    if user.get("pooling_type") is not None and user.get("seq_pooling_type") is not None:
        raise error("pooler_config", "cannot set both pooling_type and seq_pooling_type")
    kind = user.get("pooling_type") or user.get("seq_pooling_type")
    st = _st_pooling(model_dir)
    kind = kind or st.get("seq_pooling_type") or "LAST"
    if kind not in POOLING_TYPES:
        raise error("pooler_config", f"pooling_type {kind!r} is not served here; expected "
                    + ", ".join(POOLING_TYPES))
    normalize = user.get("use_activation")
    if normalize is None:
        normalize = st.get("use_activation", True)
    if not isinstance(normalize, bool):
        raise error("pooler_config", f"use_activation: expected true or false, got {normalize!r}")
    dims = hf.get("matryoshka_dimensions")
    settings = PoolerSettings(kind, normalize, None, hidden_size,
                              bool(dims) or bool(hf.get("is_matryoshka", False)),
                              tuple(dims) if dims else None)
    if user.get("dimensions") is not None:
        check_dimensions(settings, user["dimensions"], error, "pooler_config")
        settings = PoolerSettings(kind, normalize, user["dimensions"], hidden_size,
                                  settings.is_matryoshka, settings.matryoshka_dimensions)
    return settings


def check_dimensions(p: PoolerSettings, dimensions, error, field: str = "dimensions") -> None:
    """vLLM's rule: ``dimensions`` only for a model that declares Matryoshka embeddings, in
    [1, hidden_size] and among its declared sizes if it lists them."""
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise error(field, f"dimensions: expected an integer, got {dimensions!r}")
    if not p.is_matryoshka:
        raise error(field, "dimensions: this model does not support Matryoshka embeddings; "
                    f"it must be unset (received dimensions={dimensions})")
    if not 1 <= dimensions <= p.hidden_size:
        raise error(field, f"dimensions: this model supports dimensions in range "
                    f"[1, {p.hidden_size}], got {dimensions}")
    if p.matryoshka_dimensions is not None and dimensions not in p.matryoshka_dimensions:
        raise error(field, f"dimensions: this model supports Matryoshka dimensions "
                    f"{list(p.matryoshka_dimensions)}, got {dimensions}")


def pool_row_range(kind: str, chunk_start: int, chunk_len: int, final: bool,
                   first_row: int) -> tuple[int, int]:
    """The rows of a prompt chunk (its first row in the step, its first position) that
    ``pool_rows`` sums for this pooling type; an empty range when the chunk adds nothing."""
    if kind == "MEAN":
        return first_row, first_row + chunk_len
    if kind == "LAST":
        return (first_row + chunk_len - 1, first_row + chunk_len) if final else (0, 0)
    return (first_row, first_row + 1) if chunk_start == 0 else (0, 0)       # CLS


def pool_rows(hidden: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """float32 [P, H]: the sum of ``hidden`` rows [starts[i], ends[i]) (zeros when empty)."""
    out = np.zeros((len(starts), hidden.shape[1]), np.float32)
    for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        if b > a:
            out[i] = hidden[a:b].sum(axis=0, dtype=np.float64) if b - a > 1 else hidden[a]
    return out


def finish_embedding(total: np.ndarray, num_tokens: int, p: PoolerSettings,
                     normalize: bool, dimensions: Optional[int]) -> list[float]:
    """A prompt's embedding from the sum of its pooled parts: the mean (MEAN), truncated to
    ``dimensions`` (Matryoshka), then L2-normalized when ``normalize``."""
    v = total.astype(np.float64)
    if p.pooling_type == "MEAN":
        v = v / max(1, num_tokens)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(np.linalg.norm(v), 1e-12)
    return v.astype(np.float32).tolist()
