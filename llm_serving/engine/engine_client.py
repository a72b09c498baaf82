"""The engine as the HTTP layer sees it: a small protocol, so that the routes never reach into
the scheduler, the model runner or the engine's configuration. ``AsyncLLMEngine`` implements
it (vLLM calls the same idea ``EngineClient``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Optional, Protocol, Union

from llm_serving.config import EngineConfig
from llm_serving.outputs import RequestOutput
from llm_serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llm_serving.engine.input_processor import NewRequest
    from llm_serving.model_executor.layers.pooler import PoolerSettings
    from llm_serving.engine.metrics import EngineStats
    from llm_serving.tokenizer import Tokenizer

PromptType = Union[str, dict]


@dataclass(frozen=True)
class EngineLimits:
    """The bounds a route checks or reports (from the resolved EngineConfig)."""
    max_model_len: int
    max_num_seqs: int               # sequences that may run at once (max_num_active_seqs)
    max_num_batched_tokens: int     # tokens a step may run (max_num_scheduled_tokens)
    max_waiting: int
    vocab_size: int
    device: str                 # "cpu", "ascend", or "auto" when the master cannot tell
    dtype: str
    # The KV cache's configuration as vLLM's cache_config_info labels it: (name, value) pairs.
    cache: tuple[tuple[str, str], ...] = ()
    # A pooling runner's pooler (embed or classify); None: a generate runner.
    pooler: Optional["PoolerSettings"] = None
    # LoRA: the most adapters in one step (vLLM's max_lora label); None without LoRA.
    max_loras: Optional[int] = None
    # skip_tokenizer_init: text is not tokenized, nor ids decoded (token ids in and out)
    skip_tokenizer_init: bool = False
    # enable_prompt_embeds: the hidden size prompt embeddings have (0: not taken)
    prompt_embeds_size: int = 0

    @classmethod
    def of(cls, config: EngineConfig, device: Optional[str] = None) -> "EngineLimits":
        device = (device or config.device.device).lower().replace("npu", "ascend")
        c = config.cache
        cache = (("block_size", c.block_size), ("num_gpu_blocks", c.num_blocks),
                 ("num_cpu_blocks", c.num_cpu_blocks),
                 ("enable_prefix_caching", c.enable_prefix_caching),
                 ("cache_dtype", config.model.kv_cache_dtype),
                 ("kv_cache_size_tokens", c.num_blocks * c.block_size))
        s = config.scheduler
        return cls(config.model.max_model_len, s.running_seqs, s.step_tokens, s.max_waiting,
                   config.model.vocab_size, device,
                   config.model.weight_dtype, tuple((k, str(v)) for k, v in cache),
                   config.model.pooler,
                   config.lora.max_loras if config.lora is not None else None,
                   config.model.skip_tokenizer_init,
                   config.model.hf.hidden_size if config.model.enable_prompt_embeds else 0)


class RequestStream(Protocol):
    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs; DELTA outputs that piled up behind a slow reader come merged."""

    def steps(self) -> AsyncIterator[list[RequestOutput]]:
        """Outputs in the batches that piled up, one per engine step, not merged."""

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    tokenizer: "Tokenizer"
    # The LoRA adapters served by name (lora.registry.LoRARegistry); None without enable_lora
    loras: object
    limits: EngineLimits
    # Sampling defaults of OpenAI requests that leave a field out (EngineArgs.generation_config)
    default_sampling_params: dict
    # Requests refused so far by each admission limit (max_num_queued_reqs, ..._tokens)
    admission_rejections: dict

    @property
    def is_running(self) -> bool:
        """Ready to serve: the model is loaded and the step loop is alive."""

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: Optional[SamplingParams] = None,
                          priority: int = 0, lora_request=None) -> RequestStream:
        """Queue a request (``lora_request``: the LoRARequest of the adapter it runs with);
        its outputs come on the stream. Raises ValueError (bad input),
        QueueFullError, EngineDeadError, ShuttingDownError (after ``abort_all``)."""

    async def check_request(self, request_id: str, prompt: PromptType,
                            params: Optional[SamplingParams] = None,
                            priority: int = 0, lora_request=None) -> "NewRequest":
        """``add_request`` without queueing: every check, and the tokens (same errors)."""

    def queue(self, new: "NewRequest", kv_transfer_params=...,
              trace_headers: Optional[dict] = None,
              trace_id: Optional[str] = None) -> RequestStream:
        """Queue a request ``check_request`` returned; ``kv_transfer_params``, when given,
        replace its own (a first-D request's producer answer, checked here);
        ``trace_headers``, the W3C trace context its span is parented to, ``trace_id`` the
        request id the span names (tracing on)."""

    def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams],
                 request_id: str, priority: int = 0,
                 lora_request=None) -> AsyncIterator[RequestOutput]:
        """vLLM's entry point: the request's outputs; leaving early aborts it."""

    def abort(self, request_id: str) -> None: ...

    @property
    def num_requests(self) -> int:
        """Requests whose outputs are still coming (queued or running)."""

    def abort_all(self, reason: str) -> None:
        """End every request with the error ``reason``; later requests are refused with it."""

    def decline_kv_offers(self, offers: list) -> None:
        """PD consumer: offers (a producer's ``kv_transfer_params``, one per prompt) of
        requests refused before they were queued; the producer frees their blocks at once."""

    async def get_stats(self) -> "EngineStats": ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while a request is unfinished (vLLM's)."""

    async def read_lora(self, lora) -> Optional[str]:
        """The model runner reads a newly registered LoRA adapter: None, or why it could
        not."""

    async def start_profile(self, profile_prefix: Optional[str] = None) -> None:
        """--profiler-config: every process starts recording its trace (``profiler.py``)."""

    async def stop_profile(self) -> None:
        """Every process writes its trace."""

    async def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                             kwargs: Optional[dict] = None) -> list:
        """vLLM's: ``method`` run on every model process between two steps, the results by
        rank (``executor/collective_rpc.py``)."""
