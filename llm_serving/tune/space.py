"""The knobs ``llm-serving tune`` searches, and how an Optuna trial picks a value of each.

A knob the user fixes (an engine flag on the ``tune`` command line, e.g. ``--block-size 16``)
is not searched. The KV pool is searched as a token capacity (``kv_tokens``) so that it means
the same whatever the block size; it becomes ``num_blocks = ceil(kv_tokens / block_size)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Knob:
    name: str                      # the Optuna parameter name
    kind: str                      # "int_log" | "choice" | "bool"
    low: Optional[int] = None
    high: Optional[int] = None
    choices: tuple = ()
    engine_args: tuple = ()        # the engine arguments it sets (fixing one removes the knob)


def default_space(max_model_len: int, tensor_parallel_size: int = 1,
                  kv_tokens_up_to: int = 0) -> list[Knob]:
    """The default search space. ``max_model_len`` bounds the KV pool from below: a pool that
    cannot hold one longest sequence is refused at start (and that trial recorded as failed);
    ``kv_tokens_up_to`` widens it to the pools trials must run (the engine's default pool)."""
    space = [
        Knob("max_num_seqs", "int_log", 1, 256, engine_args=("max_num_seqs",)),
        Knob("max_num_batched_tokens", "int_log", 128, 4096,
             engine_args=("max_num_batched_tokens",)),
        Knob("block_size", "choice", choices=(16, 32, 64, 128), engine_args=("block_size",)),
        Knob("kv_tokens", "int_log", max_model_len,
             max(16 * max_model_len, 65536, kv_tokens_up_to),
             engine_args=("num_blocks", "kv_cache_space")),
        Knob("enable_prefix_caching", "bool", engine_args=("enable_prefix_caching",)),
        Knob("async_scheduling", "bool", engine_args=("async_scheduling",)),
    ]
    if tensor_parallel_size > 1:       # multi-stream only overlaps tensor-parallel traffic
        space.append(Knob("enable_multi_stream", "bool", engine_args=("enable_multi_stream",)))
    return space


def without_fixed(space: list[Knob], fixed: dict) -> list[Knob]:
    """The knobs left once the user's fixed engine arguments are taken out."""
    return [k for k in space if not any(a in fixed for a in k.engine_args)]


def suggest(trial, space: list[Knob]) -> dict[str, Any]:
    """The trial's value of every knob (Optuna's sampler picks them)."""
    out: dict[str, Any] = {}
    for k in space:
        if k.kind == "int_log":
            out[k.name] = trial.suggest_int(k.name, k.low, k.high, log=True)
        elif k.kind == "choice":
            out[k.name] = trial.suggest_categorical(k.name, list(k.choices))
        else:
            out[k.name] = trial.suggest_categorical(k.name, [False, True])
    return out


def engine_kwargs(params: dict[str, Any], fixed: dict) -> dict[str, Any]:
    """Engine arguments from a trial's knob values plus the fixed ones."""
    kw = dict(fixed)
    for name, value in params.items():
        if name == "kv_tokens":
            block = kw.get("block_size", params.get("block_size", 16))
            kw["num_blocks"] = math.ceil(value / block)
        else:
            kw[name] = value
    return kw
