"""Engine arguments: one set of knobs for LLM(...), the YAML config and the CLI.

Names follow vLLM where vLLM has one; ``num_blocks`` comes from llm-serving's pa_config.
Every value is checked on construction, and an error names the key.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from llm_serving.errors import ConfigError


@dataclass
class EngineArgs:
    model: str
    tokenizer: Optional[str] = None
    checkpoint: Optional[str] = None        # a MindSpore .ckpt (mindformers names) to load
    max_num_seqs: int = 256                 # llm-serving's decode_batch_size
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    block_size: int = 16
    num_blocks: Optional[int] = None        # llm-serving's pa_config.num_blocks
    kv_cache_space: float = 2.0             # GiB for the KV cache when num_blocks is unset
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    chat_template: Optional[str] = None

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
        if not isinstance(self.kv_cache_space, (int, float)) or self.kv_cache_space <= 0:
            raise ConfigError("kv_cache_space", f"expected GiB > 0, got {self.kv_cache_space!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError("dtype", "expected one of auto, float32, float16, bfloat16, "
                              f"got {self.dtype!r}")
        if str(self.device).lower() not in ("auto", "cpu", "ascend", "npu"):
            raise ConfigError("device", f"expected auto, cpu or ascend, got {self.device!r}")
        for key in ("enable_chunked_prefill", "enable_prefix_caching"):
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
