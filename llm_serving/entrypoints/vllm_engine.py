"""``LLM.llm_engine``: the parts of vLLM's ``LLMEngine`` that map onto this engine.

vLLM scripts reach through ``llm.llm_engine`` for the tokenizer, the model's configuration
(``model_config.max_model_len``, ``model_config.hf_config``) and the request loop
(``add_request`` / ``has_unfinished_requests`` / ``step``). Those are given here with vLLM's
signatures; any other vLLM attribute is an AttributeError that names it (this engine has
another interface: ``llm.engine``).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from llm_serving.engine.llm_engine import LLMEngine, PromptType
from llm_serving.outputs import RequestOutput
from llm_serving.sampling_params import SamplingParams


class VllmModelConfig:
    """vLLM's ``ModelConfig`` fields a script reads, from the resolved configuration.
    ``dtype`` is the weights' dtype by name ("float32"; vLLM's is a torch.dtype) and
    ``hf_config`` the model's config.json as attributes (vLLM's is transformers' config)."""

    def __init__(self, engine: LLMEngine):
        m = engine.config.model
        self.model = m.path
        self.tokenizer = m.tokenizer
        self.served_model_name = m.path
        self.max_model_len = m.max_model_len
        self.dtype = m.weight_dtype
        self.seed = m.seed
        self.architecture = m.hf.architecture
        self.architectures = [m.hf.architecture]
        path = Path(m.path) / "config.json"
        hf = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        self.hf_config = SimpleNamespace(**hf)
        self._hf = m.hf

    def get_vocab_size(self) -> int:
        return self._hf.vocab_size

    def get_hidden_size(self) -> int:
        return self._hf.hidden_size

    def get_head_size(self) -> int:
        return self._hf.head_dim

    def get_num_layers(self, parallel_config=None) -> int:
        return self._hf.num_layers

    def get_max_model_len(self) -> int:
        return self.max_model_len

    def __getattr__(self, name: str):
        raise AttributeError(f"llm.llm_engine.model_config.{name}: vLLM's ModelConfig field "
                             f"{name!r} is not provided by llm_serving")


class VllmLLMEngine:
    """``llm.llm_engine``: vLLM's LLMEngine methods and fields that this engine has."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = VllmModelConfig(engine)
        self._traced: dict = {}     # tracing on: the requests added here, by id, until they end

    def get_tokenizer(self):
        return self._engine.tokenizer

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, lora_request=None,
                    priority: int = 0) -> str:
        """vLLM's argument order: the id first. Outputs come from step()."""
        new = self._engine.process_request(prompt, params, str(request_id), priority,
                                           arrival_time, lora_request)
        self._engine.add_processed(new)
        if self._engine.tracer is not None:
            self._traced[new.request_id] = new
        return new.request_id

    def abort_request(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._trace(self._engine.abort_request(rid))

    def step(self) -> list[RequestOutput]:
        outs = self._engine.step()
        if self._traced:
            for out in outs:
                self._trace(out)
        return outs

    def _trace(self, out: Optional[RequestOutput]) -> None:
        """The span of a request added here that ended (--otlp-traces-endpoint)."""
        if out is not None and out.finished and out.request_id in self._traced:
            new = self._traced.pop(out.request_id)
            self._engine.tracer.record(new, None, new.request_id, out)

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self._engine.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self._engine.reset_prefix_cache()

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs=None) -> list:
        return self._engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func) -> list:
        return self._engine.collective_rpc("apply_model", None, (func,))

    def __getattr__(self, name: str):
        raise AttributeError(f"llm.llm_engine.{name}: vLLM's LLMEngine attribute {name!r} is "
                             "not provided by llm_serving (llm.llm_engine has get_tokenizer, "
                             "tokenizer, model_config, add_request, step, abort_request, "
                             "has_unfinished_requests, get_num_unfinished_requests, "
                             "reset_prefix_cache, collective_rpc, apply_model)")
