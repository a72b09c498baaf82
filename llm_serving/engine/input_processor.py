"""A request as the user gives it -> a checked, tokenized ``NewRequest``.

``InputProcessor.process`` reads no engine state but the configuration, so any thread may call
it (the async engine checks requests on the event loop, before they reach the engine thread).
Every error is a ValueError that names what is wrong.
"""
from __future__ import annotations

import itertools
import pickle
import time

import numpy as np
from dataclasses import dataclass
from typing import Optional, Union

from llm_serving.config import EngineConfig
from llm_serving.inputs import check_cache_salt, salt_of
from llm_serving.lora.request import LoRARequest
from llm_serving.model_executor.layers.pooler import check_dimensions
from llm_serving.pooling_params import PoolingParams
from llm_serving.prompt_embeds import FIELD as EMBEDS, NOT_ENABLED, embeds_of, mixed_prompt
from llm_serving.sampling_params import RequestOutputKind, SamplingParams
from llm_serving.tokenizer import Tokenizer

PromptType = Union[str, dict]


# skip_tokenizer_init (vLLM's): what needs text or the tokenizer is refused with this reason
NO_TOKENIZER = "the tokenizer is not used with skip_tokenizer_init (token ids in and out)"

def encode_prompt(tokenizer: Tokenizer, text: str, max_model_len: int, field: str = "prompt",
                  add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids; a text too long for max_model_len tokens by its length alone is
    refused before it is tokenized (a body of megabytes would hold the caller's thread for
    seconds: the HTTP event loop, for every other request)."""
    most = max_model_len * tokenizer.max_chars_per_token
    if len(text) > most:
        raise ValueError(f"{field}: {len(text)} characters are more than the maximum model "
                         f"length ({max_model_len} tokens) can hold")
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:       # the tokenizer library's answer to a lone surrogate ("\ud800")
        raise ValueError(f"{field}: not a valid Unicode text (it holds an unpaired UTF-16 "
                         "surrogate)") from None


@dataclass
class NewRequest:
    """A checked, tokenized request, ready to queue."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int           # resolved: what fits in max_model_len
    priority: int
    arrival_time: float
    lora: Optional["LoRARequest"] = None     # its adapter (None: the base model)
    pooling: Optional[PoolingParams] = None     # a pooling request (its params, resolved)
    cache_salt: Optional[str] = None     # the prompt's (vLLM's): its own prefix-cache blocks
    # vLLM's prompt_embeds: float32 [E, hidden], the inputs at the prompt positions
    # embeds_positions (int32 [E]; their prompt_token_ids are placeholder 0s)
    prompt_embeds: Optional[np.ndarray] = None
    embeds_positions: Optional[np.ndarray] = None


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, constraints=None,
                 loras=None):
        self.tokenizer = tokenizer
        self.loras = loras                  # lora.registry.LoRARegistry; None: LoRA off
        self.constraints = constraints      # engine.constraints.Constraints
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        self.max_logprobs = config.model.max_logprobs
        # the cap on running sequences a request's n must fit under, and its name
        s = config.scheduler
        self.seq_cap = (s.running_seqs, "max_num_active_seqs" if s.max_num_active_seqs
                        else "max_num_seqs")
        self.policy = config.scheduler.policy
        self.kv_transfer = config.kv_transfer
        if self.kv_transfer is not None:
            from llm_serving.distributed.kv_transfer.factory import connector_class
            self._check_offer = connector_class(self.kv_transfer).check_offer
        self.pooler = config.model.pooler          # None: a generate runner
        self.skip_tokenizer = config.model.skip_tokenizer_init
        self.embeds_enabled = config.model.enable_prompt_embeds
        self.hidden_size = config.model.hf.hidden_size
        # the user's logits processor classes (their validate_params); () : none configured
        self.processors = ()
        if config.model.logits_processors:
            from llm_serving.sample.custom_logits_processors import load_class
            self.processors = tuple(map(load_class, config.model.logits_processors))
        self._ids = itertools.count()

    def process(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                request_id: Optional[str] = None, priority: int = 0,
                arrival_time: Optional[float] = None,
                lora_request: Optional[LoRARequest] = None) -> NewRequest:
        """``max_tokens`` is lowered to what fits in max_model_len after the prompt (vLLM's
        rule, and llm-serving's cap on prompt + output)."""
        pooling = self._pooling(params)
        if pooling is not None:
            params = SamplingParams(max_tokens=1, detokenize=False,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        params = params or SamplingParams()
        if self.skip_tokenizer:     # vLLM's: no text out, and no grammar (it needs the vocab)
            if params.structured_outputs is not None:
                raise ValueError(f"structured_outputs: {NO_TOKENIZER}")
            if params.detokenize:
                params = params.clone()
                params.detokenize = False
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if priority != 0 and self.policy != "priority":
            raise ValueError("priority is only used with scheduling_policy='priority'")
        cap, name = self.seq_cap
        if params.n > cap:
            raise ValueError(f"n: {params.n} is more than {name} ({cap}), the most sequences "
                             "that run at once")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            whole = asked == -1                     # vLLM's: the whole vocabulary
            if whole:
                asked = self.vocab_size
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"{name}: {asked} asked for{' (-1: the vocabulary)' * whole}, "
                                 f"more than this server's max_logprobs ({self.max_logprobs})")
            if whole:
                params = params.clone()
                setattr(params, name, asked)
        if params.logprob_token_ids is not None:
            ids = params.logprob_token_ids
            if len(ids) > self.max_logprobs:
                raise ValueError(f"logprob_token_ids: {len(ids)} ids, more than this server's "
                                 f"max_logprobs ({self.max_logprobs})")
            if max(ids) >= self.vocab_size:
                raise ValueError(f"logprob_token_ids: token ids are in [0, {self.vocab_size})")
        if params.kv_transfer_params is not None:
            self.check_kv_transfer(params.kv_transfer_params)
        if params.extra_args or self.processors:
            self.check_extra_args(params)
        if lora_request is not None:
            if self.loras is None:
                raise ValueError("lora_request: LoRA adapters are served with "
                                 "enable_lora=True (--enable-lora)")
            self.loras.check(lora_request)
        if self.constraints is not None and (params.constrained or params.logit_bias
                                             or params.thinking_token_budget is not None):
            self.constraints.prepare(params)
        salt = salt_of(prompt)
        check_cache_salt(salt)
        embeds = self._embeds(prompt, params)
        if embeds is not None:
            ids, positions, embeds = embeds
            text = None
        else:
            text, ids = self._tokenize(prompt)
            positions = None
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        room = self.max_model_len - len(ids)
        if pooling is not None:         # only prefilled: the whole length is the prompt's
            if room < 0:
                raise ValueError(f"prompt: it has {len(ids)} tokens, more than the maximum "
                                 f"model length ({self.max_model_len})")
            return NewRequest(request_id, text, ids, params, 1, priority,
                              time.time() if arrival_time is None else arrival_time,
                              pooling=pooling, cache_salt=salt)
        if room < 1:
            raise ValueError(f"prompt: it has {len(ids)} tokens; the maximum model length is "
                             f"{self.max_model_len}, leaving no room to generate")
        max_tokens = min(params.max_tokens or room, room)
        return NewRequest(request_id, text, ids, params, max_tokens, priority,
                          time.time() if arrival_time is None else arrival_time,
                          lora=lora_request, cache_salt=salt, prompt_embeds=embeds,
                          embeds_positions=positions)

    def _embeds(self, prompt: PromptType, params: SamplingParams):
        """An EmbedsPrompt's (token ids, embedded positions, their rows), checked (None for
        another prompt)."""
        value = embeds_of(prompt)
        if value is None:
            return None
        if not self.embeds_enabled:
            raise ValueError(NOT_ENABLED)
        if params.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs: not computed for a prompt given as "
                             f"{EMBEDS} (there are no prompt tokens to score; vLLM's rule)")
        return mixed_prompt(prompt, self.hidden_size, self.max_model_len)

    def _pooling(self, params) -> Optional[PoolingParams]:
        """A pooling request's params, resolved against the server's pooler (None for a
        generation request); a request of the other kind than the runner's is refused."""
        if self.pooler is None:
            if isinstance(params, PoolingParams):
                raise ValueError("this model is a generative model (runner generate): it "
                                 "serves no embeddings; start it with --runner pooling")
            return None
        task = self.pooler.task
        if params is not None and not isinstance(params, PoolingParams):
            raise ValueError(f"this model is a pooling model (runner pooling): it serves "
                             f"{'embeddings' if task == 'embed' else 'classify and score'}, "
                             "it does not generate")
        p = params or PoolingParams()
        if p.task not in (None, task):
            raise ValueError(f"task: this model serves {task}, not {p.task}")
        dims = p.dimensions if p.dimensions is not None else self.pooler.dimensions
        if p.dimensions is not None:
            if task != "embed":
                raise ValueError("dimensions: only for embed, not classify")
            check_dimensions(self.pooler, p.dimensions, lambda _, msg: ValueError(msg))
        return PoolingParams(dims, self.pooler.normalize if p.use_activation is None
                             else p.use_activation, task)

    def check_extra_args(self, params: SamplingParams) -> None:
        """extra_args (vllm_xargs) go to the user's logits processors, which check them
        (validate_params); without processors, a key other than kv_transfer_params would be
        read by nothing and is refused."""
        if not self.processors:
            unread = sorted(k for k in params.extra_args if k != "kv_transfer_params")
            if unread:
                raise ValueError(f"extra_args: {', '.join(map(repr, unread))} would be read "
                                 "by custom logits processors, and this engine has none "
                                 "(start it with --logits-processors)")
            return
        from llm_serving.sample.custom_logits_processors import (MAX_PARAMS_BYTES,
                                                                 validate_params)
        validate_params(self.processors, params)
        size = len(pickle.dumps(params, protocol=5))
        if size > MAX_PARAMS_BYTES:
            raise ValueError(f"extra_args: the request's parameters take {size} bytes, more "
                             f"than the {MAX_PARAMS_BYTES} custom logits processors take")

    def check_kv_transfer(self, p: dict) -> None:
        """``kv_transfer_params`` this instance can take (ValueError naming the field)."""
        kv = self.kv_transfer
        if kv is None:
            raise ValueError("kv_transfer_params: this instance has no KV transfer "
                             "configured (start it with --kv-transfer-config)")
        if p.get("do_remote_decode") and not kv.is_producer:
            raise ValueError(f"kv_transfer_params: do_remote_decode needs a kv_producer or "
                             f"kv_both instance, this one is {kv.kv_role}")
        if p.get("do_remote_prefill") and not kv.is_consumer:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs a kv_consumer or "
                             f"kv_both instance, this one is {kv.kv_role}")
        if p.get("do_remote_prefill"):
            self._check_offer(p)

    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            # vLLM's TextPrompt: {"prompt": text} is tokenized as the text alone would be.
            if not isinstance(prompt.get("prompt"), str):
                raise ValueError("a prompt dict needs 'prompt_token_ids' (a TokensPrompt) or "
                                 f"a 'prompt' string (a TextPrompt), got keys {list(prompt)}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str) and self.skip_tokenizer:
            raise ValueError(f"prompt: a text prompt is not taken: {NO_TOKENIZER}; give "
                             "prompt_token_ids")
        if isinstance(prompt, dict):
            try:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
            except (TypeError, ValueError):
                raise ValueError("prompt_token_ids must be a list of integers") from None
            text = prompt.get("prompt")
        elif isinstance(prompt, str):
            # "" is its special tokens alone (the BOS, if the tokenizer adds one), as vLLM's
            text, ids = prompt, encode_prompt(self.tokenizer, prompt, self.max_model_len)
        else:
            raise TypeError(f"a prompt is a string, {{'prompt': text}} or "
                            f"{{'prompt_token_ids': [...]}}, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: it is empty (it has no tokens)")
        return text, ids
