"""Pooling (vLLM's ``--runner pooling``): one vector per prompt from the decoder's final-norm
hidden states: an embedding (task embed), or a sequence classifier's class probabilities
(task classify: its ``score`` head on the pooled row, then vLLM's activation).

A prompt may run over several prefill chunks, so pooling is split in two:

- in the model runner, ``pool_rows`` sums the hidden states of each pooled row range of the
  step (a chunk's rows for MEAN, its last row for LAST, its first for CLS): float32 [P, H];
- on the master, the output processor adds a prompt's parts up and ``finish_embedding``
  divides (MEAN), truncates (Matryoshka ``dimensions``) and L2-normalizes.

For classify the runner applies the score head to the pooled rows (LAST or CLS: one row per
prompt, so the head sees exactly that row) and ``finish_classification`` the activation.

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
TASKS = ("embed", "classify")
# vLLM's classifier activations (get_act_fn): classify is softmax over two or more labels and
# sigmoid for one; the sentence-transformers cross-encoder activations it loads by name
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Sigmoid": "classify",
                   "torch.nn.modules.activation.Softmax": "classify"}
_PROBLEM_TYPES = {"regression": "identity", "single_label_classification": "classify",
                  "multi_label_classification": "sigmoid"}
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
    task: str = "embed"                      # embed, or classify (a score head's logits)
    num_labels: int = 0                      # classify: the score head's rows
    activation: str = "classify"             # classify: classify, sigmoid or identity
    use_sep_token: bool = True               # score: a pair is the tokenizer's pair encoding
    id2label: Optional[dict] = None          # classify: config.json's label names by index


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
                   error, task: str = "embed", num_labels: int = 0) -> PoolerSettings:
    """The pooler of a pooling runner: the user's --pooler-config first, then the model
    directory's sentence-transformers files, then vLLM's decoder default (LAST, normalized).
    ``task`` classify: a sequence classifier of ``num_labels`` (LAST by default, vLLM's
    activation from config.json). ``error(key, message)`` makes the exception raised for a
    bad key."""
    user = dict(user or {})
    if "normalize" in user:
        raise error("pooler_config", "normalize was removed in vLLM; use use_activation")
    unknown = sorted(set(user) - set(_POOLER_KEYS))
    if unknown:
        raise error("pooler_config", f"unknown key {unknown[0]!r}; this server takes "
                    + ", ".join(_POOLER_KEYS))
    if user.get("task", task) != task:
        raise error("pooler_config", f"task {user['task']!r} is not served by this model "
                    f"(its task: {task})")
    if user.get("pooling_type") is not None and user.get("seq_pooling_type") is not None:
        raise error("pooler_config", "cannot set both pooling_type and seq_pooling_type")
    kind = user.get("pooling_type") or user.get("seq_pooling_type")
    st = _st_pooling(model_dir) if task == "embed" else {}
    kind = kind or st.get("seq_pooling_type") or "LAST"
    if kind not in POOLING_TYPES:
        raise error("pooler_config", f"pooling_type {kind!r} is not served here; expected "
                    + ", ".join(POOLING_TYPES))
    normalize = user.get("use_activation")
    if normalize is None:
        normalize = st.get("use_activation", True)
    if not isinstance(normalize, bool):
        raise error("pooler_config", f"use_activation: expected true or false, got {normalize!r}")
    if task == "classify":
        if kind == "MEAN":
            raise error("pooler_config", "pooling_type MEAN is not served for classify here "
                        "(LAST or CLS)")
        if user.get("dimensions") is not None:
            raise error("pooler_config", "dimensions: only for embed, not classify")
        return PoolerSettings(kind, normalize, None, hidden_size, task="classify",
                              num_labels=num_labels, activation=_classifier_activation(hf, error),
                              use_sep_token=bool(hf.get("use_sep_token",
                                                        hf.get("use_pad_token", True))),
                              id2label={int(k): str(v)
                                        for k, v in (hf.get("id2label") or {}).items()})
    dims = hf.get("matryoshka_dimensions")
    settings = PoolerSettings(kind, normalize, None, hidden_size,
                              bool(dims) or bool(hf.get("is_matryoshka", False)),
                              tuple(dims) if dims else None)
    if user.get("dimensions") is not None:
        check_dimensions(settings, user["dimensions"], error, "pooler_config")
        settings = PoolerSettings(kind, normalize, user["dimensions"], hidden_size,
                                  settings.is_matryoshka, settings.matryoshka_dimensions)
    return settings


def _classifier_activation(hf: dict, error) -> str:
    """vLLM's get_act_fn on config.json: problem_type first, then a sentence-transformers
    cross-encoder's activation_fn, else classify (softmax, or sigmoid for one label)."""
    problem = hf.get("problem_type")
    if problem in _PROBLEM_TYPES:
        return _PROBLEM_TYPES[problem]
    st = hf.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) \
        or hf.get("sbert_ce_default_activation_function")
    if name is None:
        return "classify"
    if name not in _ST_ACTIVATIONS:
        raise error("activation_fn", f"config.json's classifier activation {name!r} is not "
                    f"served here; expected one of {', '.join(_ST_ACTIVATIONS)}")
    return _ST_ACTIVATIONS[name]


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


def finish_classification(logits: np.ndarray, p: PoolerSettings, activate: bool) -> list[float]:
    """A prompt's class probabilities from its score head's logits: vLLM's activation
    (softmax over two or more labels, sigmoid for one; or the checkpoint's), or the raw logits
    when ``activate`` is false."""
    v = logits.astype(np.float64)
    kind = p.activation if activate else "identity"
    if kind == "classify" and len(v) > 1:
        e = np.exp(v - v.max())
        v = e / e.sum()
    elif kind != "identity":            # sigmoid (and classify over one label)
        v = 1.0 / (1.0 + np.exp(-v))
    return v.astype(np.float32).tolist()


def served_routes(p: PoolerSettings) -> str:
    """The HTTP routes a pooling runner serves (vLLM registers only those)."""
    if p.task == "embed":
        return "/v1/embeddings, /score and /rerank"
    return "/classify, /score and /rerank" if p.num_labels == 1 else "/classify"
