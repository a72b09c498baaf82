"""Engine arguments: one set of knobs for LLM(...), the YAML config and the CLI.

Names follow vLLM where vLLM has one; ``num_blocks`` comes from llm-serving's pa_config.
Every value is checked on construction, and an error names the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from llm_serving.errors import ConfigError


def _arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    model: str = field(metadata={"help": "model directory (HF layout) or builtin:tiny-llama"})
    tokenizer: Optional[str] = _arg(None,
        "tokenizer directory (default: the model's)")
    checkpoint: Optional[str] = _arg(None,
        "a MindSpore .ckpt with mindformers' parameter names to load")
    max_num_seqs: int = _arg(256,
        "most sequences per step (llm-serving's decode_batch_size)")
    max_num_batched_tokens: Optional[int] = _arg(None,
        "token budget per step (default 2048 with chunked prefill)")
    max_model_len: Optional[int] = _arg(None,
        "longest prompt + output (default: the model's, capped by the KV pool)")
    block_size: int = _arg(16,
        "tokens per KV block")
    num_blocks: Optional[int] = _arg(None,
        "KV blocks (llm-serving's pa_config.num_blocks; default from kv_cache_space)")
    kv_cache_space: float = _arg(2.0,
        "GiB for the KV cache when num_blocks is unset")
    enable_chunked_prefill: bool = _arg(True,
        "chunk long prefills into the step budget (Dynamic SplitFuse)")
    enable_prefix_caching: bool = _arg(False,
        "reuse the KV blocks of shared prompt prefixes")
    preemption_mode: str = _arg("recompute",
        "recompute or swap (to a host pool of swap_space GiB)")
    swap_space: float = _arg(4.0,
        "GiB of host memory for swapped-out KV blocks")
    scheduling_policy: str = _arg("fcfs",
        "fcfs, or priority: lower request priority runs first and may preempt")
    max_waiting_requests: int = _arg(1024,
        "new requests beyond this many waiting are refused at once")
    queue_timeout: Optional[float] = _arg(None,
        "seconds a request may wait before it starts; then it fails")
    watermark: float = _arg(0.01,
        "fraction of KV blocks admission keeps free")
    distributed_executor_backend: str = _arg("uni",
        "uni: run the model in this process; mp: in a WorkAgent process")
    async_scheduling: Optional[bool] = _arg(None,
        "schedule step N+1 while the model computes step N (default: on with mp, off with "
        "uni, where nothing runs in parallel)")
    dump_logits: Optional[str] = _arg(None,
        "directory: save the raw logits of every request at dump_logits_every positions")
    dump_logits_every: int = _arg(100,
        "output positions between logits dumps (0, N, 2N, ...)")
    dtype: str = _arg("auto",
        "auto, float32, float16 or bfloat16")
    device: str = _arg("auto",
        "auto, cpu or ascend")
    seed: int = _arg(0,
        "seed of the sampler for requests without their own")
    chat_template: Optional[str] = _arg(None,
        "a Jinja chat template overriding the tokenizer's")

    def __post_init__(self):
        def positive(key, value, allow_none=False):
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"expected a positive integer, got {value!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", f"expected a model directory path, got {self.model!r}")
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens, True)
        positive("max_model_len", self.max_model_len, True)
        positive("block_size", self.block_size)
        positive("num_blocks", self.num_blocks, True)
        if (not isinstance(self.kv_cache_space, (int, float)) or isinstance(self.kv_cache_space, bool)
                or self.kv_cache_space <= 0):
            raise ConfigError("kv_cache_space", f"expected GiB > 0, got {self.kv_cache_space!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError("dtype", "expected one of auto, float32, float16, bfloat16, "
                              f"got {self.dtype!r}")
        if str(self.device).lower() not in ("auto", "cpu", "ascend", "npu"):
            raise ConfigError("device", f"expected auto, cpu or ascend, got {self.device!r}")
        positive("max_waiting_requests", self.max_waiting_requests)
        positive("dump_logits_every", self.dump_logits_every)

        def number(key, value, low, allow_none=False, low_inclusive=True, high=None):
            if value is None and allow_none:
                return
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
                value >= low if low_inclusive else value > low) and (high is None or value < high)
            if not ok:
                rng = f"{'>=' if low_inclusive else '>'} {low}" + (f" and < {high}" if high else "")
                raise ConfigError(key, f"expected a number {rng}, got {value!r}")
        number("swap_space", self.swap_space, 0)
        number("queue_timeout", self.queue_timeout, 0, allow_none=True, low_inclusive=False)
        number("watermark", self.watermark, 0, high=1)
        for key, allowed in (("distributed_executor_backend", ("uni", "mp")),
                             ("preemption_mode", ("recompute", "swap")),
                             ("scheduling_policy", ("fcfs", "priority"))):
            if getattr(self, key) not in allowed:
                raise ConfigError(key, f"expected one of {', '.join(allowed)}, "
                                  f"got {getattr(self, key)!r}")
        for key in ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling"):
            if key == "async_scheduling" and self.async_scheduling is None:
                continue
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, f"expected true or false, got {getattr(self, key)!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown engine argument; known ones are "
                              + ", ".join(sorted(known)))
        return cls(model=model, **kwargs)
