"""Request bodies of the OpenAI-compatible API (with vLLM's extra sampling fields), checked by
pydantic: a wrong type or an out-of-range value is a 400 naming the field and the rule.

No field is silently dropped. Every field of OpenAI's spec and of vLLM's extensions is
declared: honoured, or listed in ``REFUSED`` with the values we can honour (a request that
sets it otherwise is a 400 naming it: ``http_common.refuse_unsupported``). Fields neither
knows are kept in ``model_extra`` and the route logs one warning naming them, as vLLM does.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from llm_serving.inputs import cache_salt_problem
from llm_serving.sampling_params import (MAX_STOPS, BeamSearchParams, RequestOutputKind,
                                         SamplingParams, StructuredOutputsParams)

# vLLM's vllm_xargs: strings and numbers, or lists of them, by name
XArgs = dict[str, Union[str, int, float, list[Union[str, int, float]]]]

# Fields beam search would ignore: with use_beam_search, any value but "unset" is a 400.
_NOT_WITH_BEAM_SEARCH = ("stop", "stop_token_ids", "seed", "top_p", "top_k", "min_p",
                         "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
                         "logprob_token_ids", "logprobs", "top_logprobs", "prompt_logprobs",
                         "echo",
                         "kv_transfer_params", "tools")

# Fields we declare but cannot honour: the values that mean "not used" (None always does).
_REFUSED_COMMON = {
    "logits_processors": (),
    "return_token_ids": (False,),
    "mm_processor_kwargs": (), "guided_decoding_backend": (
        "llguidance", "auto", "guidance"),
    "store": (False,), "metadata": (), "service_tier": ("auto", "default"),
    "prediction": (), "prompt_cache_key": (), "watermarking": (False,),
}
_REFUSED_CHAT = {
    "audio": (), "modalities": (["text"],), "function_call": (), "functions": (),
    "web_search_options": (), "verbosity": (), "documents": (),
}


# What a request that leaves a sampling field out gets, unless the model's
# generation_config.json says otherwise (EngineArgs.generation_config): SamplingParams' own
# defaults, which are OpenAI's meaning of each.
_OPENAI_DEFAULTS = {name: SamplingParams.__dataclass_fields__[name].default
                    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                 "presence_penalty", "frequency_penalty")}


def sampling_knobs(req, defaults: Optional[dict]) -> dict:
    """temperature, top_p, top_k, min_p and the penalties of a request: its own value, else
    the server's default (``generation_defaults``), else OpenAI's (``_OPENAI_DEFAULTS``)."""
    defaults = {**_OPENAI_DEFAULTS, **(defaults or {})}
    return {k: defaults[k] if getattr(req, k) is None else getattr(req, k)
            for k in _OPENAI_DEFAULTS}


def _checked_cache_salt(cls, v):
    problem = cache_salt_problem(v)
    if problem is not None:     # said as is (a ValueError's would read "Value error, ...")
        raise PydanticCustomError("cache_salt", problem)
    return v


def cache_salt_validator():
    """A request model's check of its cache_salt field, vLLM's (a 400 naming it)."""
    return field_validator("cache_salt", mode="before")(_checked_cache_salt)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False

    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class _SamplingFields(BaseModel):
    # A NaN or an infinity is refused as such (not as "should be >= 0").
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    # Left out (None): the model's generation_config.json default, else OpenAI's (vLLM).
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    user: Optional[str] = None
    # vLLM's extras.
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # vLLM's: logprobs name tokens 'token_id:<id>' (None: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: Optional[bool] = None
    repetition_penalty: Optional[float] = Field(None, gt=0)
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOPS)
    priority: int = 0
    # vLLM's: the logprobs of these token ids at each position, in place of the top ones
    # (with logprobs set; SamplingParams.logprob_token_ids).
    logprob_token_ids: Optional[list[int]] = None
    # vLLM's: end the output once it repeats a pattern (RepetitionDetectionParams' keys).
    repetition_detection: Optional[dict[str, Any]] = None
    # vLLM's: a stream's chunks every this many tokens; raises --stream-interval.
    stream_interval: Optional[int] = Field(None, ge=1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's older forms: a structural tag (JSON text), JSON's whitespace (a regex)
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    guided_whitespace_pattern: Optional[str] = None
    # vLLM's beam search: n beams (beam_search_params)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: keep this many prompt tokens (-1: the model's length less one), the last ones
    # unless truncation_side is "right".
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    # Declared so that they are refused by name (see _REFUSED_COMMON).
    logits_processors: Any = None
    return_token_ids: Any = None
    guided_decoding_backend: Any = None
    # PD disaggregation (vLLM's field; the engine refuses it without a kv_transfer config).
    kv_transfer_params: Optional[dict[str, Any]] = None
    # vLLM's: the prompt's prefix-cache blocks are shared only with requests of this salt
    cache_salt: Optional[str] = None
    # vLLM's: the request's SamplingParams.extra_args, for custom logits processors
    vllm_xargs: Optional[XArgs] = None
    # vLLM's: the response's id after its prefix (an X-Request-Id header wins)
    request_id: Optional[str] = None
    # vLLM's: each prompt token's logprob and the top ones (-1: the whole vocabulary; the
    # engine checks max_logprobs), returned as the choice's (chat: the answer's)
    # prompt_logprobs. A stream takes only 0, and shows none (as vLLM).
    prompt_logprobs: Optional[int] = Field(None, ge=-1)
    mm_processor_kwargs: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    watermarking: Any = None
    # vLLM's: the most tokens the model may think (-1: no limit; SamplingParams checks it)
    thinking_token_budget: Any = None
    safety_identifier: Optional[str] = None     # as `user`: named in the request's log line

    REFUSED: ClassVar[dict] = _REFUSED_COMMON

    _check_cache_salt = cache_salt_validator()

    def stream_usage(self) -> tuple[bool, bool]:
        """(a final chunk with usage, usage in every chunk), from stream_options."""
        opts = self.stream_options
        return bool(opts and opts.include_usage), bool(opts and opts.continuous())

    def check_combinations(self) -> None:
        """Fields that are refused together (ValueError naming the field), as vLLM."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream true")
        if self.logprob_token_ids and self.logprobs in (None, False):
            raise ValueError("logprob_token_ids: needs logprobs set (as vLLM)")
        if self.stream and self.prompt_logprobs:
            raise ValueError("prompt_logprobs: not available when stream is true (as vLLM)")

    def unknown_fields(self) -> list[str]:
        nested = self.stream_options.model_extra if self.stream_options else None
        return sorted([*(self.model_extra or ()), *(f"stream_options.{k}" for k in nested or ())])

    def structured(self) -> Optional[StructuredOutputsParams]:
        """The one structured-output request among response_format, guided_* and
        structured_outputs (ValueError naming the field when more than one or bad)."""
        found = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found["response_format"] = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format: json_schema needs json_schema.schema, "
                                     "a JSON schema object")
                found["response_format"] = StructuredOutputsParams(json=schema)
            elif kind == "structural_tag":
                found["response_format"] = _params("response_format", structural_tag=rf)
            elif kind != "text":
                raise ValueError(f"response_format: type must be text, json_object, "
                                 f"json_schema or structural_tag, got {kind!r}")
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                          ("structural_tag", "structural_tag")):
            value = getattr(self, name)
            if value is not None:
                found[name] = _params(name, **{key: value})
        if self.structured_outputs is not None:
            try:
                found["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if len(found) > 1:
            raise ValueError(f"{sorted(found)[1]}: give only one of "
                             f"{' and '.join(sorted(found))}")
        self._structured_field = next(iter(found), None)
        structured = next(iter(found.values()), None)
        ws = self.guided_whitespace_pattern
        if ws is not None:
            if structured is None:
                raise ValueError("guided_whitespace_pattern: applies to a JSON constraint "
                                 "(guided_json, response_format, structural_tag), none given")
            if structured.whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern: give only one of "
                                 "guided_whitespace_pattern and "
                                 "structured_outputs.whitespace_pattern")
            structured = _params("guided_whitespace_pattern", **{
                **vars(structured), "whitespace_pattern": ws})
        return structured

    def structured_field(self) -> Optional[str]:
        """The request field the structured output came from (after ``structured()``)."""
        return getattr(self, "_structured_field", None)

    def beam_search_params(self, max_tokens: Optional[int],
                           defaults: Optional[dict] = None) -> BeamSearchParams:
        """use_beam_search: n beams, as vLLM reads a request (temperature left out is 1.0 or
        the server's default; it only decides the token each step's request samples, which
        the search does not use). What beam search would ignore is refused by name (vLLM
        ignores it), as are streaming (as vLLM) and logprobs. ValueError naming the field."""
        if self.stream:
            raise ValueError("stream: streaming is not supported with beam search "
                             "(use_beam_search), as in vLLM")
        for name in _NOT_WITH_BEAM_SEARCH:
            if getattr(self, name, None) not in (None, False, 0, [], {}):
                raise ValueError(f"{name}: not supported with beam search (use_beam_search)")
        if self.thinking_token_budget not in (None, -1):
            raise ValueError("thinking_token_budget: not supported with beam search "
                             "(use_beam_search)")
        if self.structured() is not None:
            raise ValueError(f"{self.structured_field()}: not supported with beam search "
                             "(use_beam_search)")
        if max_tokens is None:
            max_tokens = (defaults or {}).get("max_tokens")
        temperature = sampling_knobs(self, defaults)["temperature"]
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens,
                                ignore_eos=self.ignore_eos, temperature=temperature,
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                skip_special_tokens=self.skip_special_tokens)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        structured: Optional[StructuredOutputsParams] = None,
                        defaults: Optional[dict] = None) -> SamplingParams:
        """``defaults``: the server's (``generation_defaults``) for what the request leaves
        out, over OpenAI's own (``_OPENAI_DEFAULTS``); ``max_tokens`` among them applies when
        ``max_tokens`` is None."""
        if structured is None:
            structured = self.structured()
        knobs = sampling_knobs(self, defaults)
        if max_tokens is None:
            max_tokens = (defaults or {}).get("max_tokens")
        return SamplingParams(
            n=self.n, **knobs, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=None if self.logprob_token_ids else logprobs,
            logprob_token_ids=self.logprob_token_ids or None, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, structured_outputs=structured,
            kv_transfer_params=self.kv_transfer_params, output_kind=RequestOutputKind.DELTA,
            extra_args=self.vllm_xargs or None, stream_interval=self.stream_interval,
            repetition_detection=self.repetition_detection,
            thinking_token_budget=self.thinking_token_budget)


def _params(field: str, **kw) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kw) for a request field: its errors name the field."""
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise ValueError(f"{field}: {str(e).split(': ', 1)[-1]}") from None


class CompletionRequest(_SamplingFields):
    # required unless prompt_embeds is given (the route checks it)
    prompt: Optional[Union[str, list[str], list[int], list[list[int]]]] = None
    # vLLM's (--enable-prompt-embeds): base64 of torch.save(tensor), or a list of them; each
    # is a prompt of its own, before the ones in prompt
    prompt_embeds: Optional[Union[str, list[str]]] = None
    # 0 only with echo (checked by the route); null is the default, as vLLM (not "no limit").
    max_tokens: Optional[int] = Field(16, ge=0)
    # -1: the whole vocabulary (vLLM's); the engine checks max_logprobs
    logprobs: Optional[int] = Field(None, ge=-1)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=1)
    suffix: Optional[str] = None
    add_special_tokens: bool = True     # vLLM's: false tokenizes a text prompt without a BOS
    # vLLM's: each choice carries its token_ids and its prompt's prompt_token_ids (the way
    # out of a --skip-tokenizer-init server)
    return_token_ids: Optional[bool] = None

    REFUSED: ClassVar[dict] = {k: v for k, v in _REFUSED_COMMON.items()
                               if k != "return_token_ids"}

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, v):
        return 16 if v is None else v

    def check_combinations(self) -> None:
        super().check_combinations()
        if self.prompt_embeds is not None:      # vLLM's refusals
            for name in ("echo", "suffix", "prompt_logprobs", "use_beam_search"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name}: not supported with prompt_embeds")
        if self.logprob_token_ids and self.echo and self.max_tokens == 0:
            raise ValueError("logprob_token_ids: not with echo and max_tokens 0, which "
                             "generate no tokens (as vLLM)")


# OpenAI's reasoning effort levels, and vLLM's "max"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def with_reasoning_effort(kwargs: Optional[dict], effort: Optional[str]) -> Optional[dict]:
    """Chat template variables with a request's reasoning effort (vLLM 0.32's, chat's
    reasoning_effort and the Responses API's reasoning.effort): the template's
    reasoning_effort variable and, unless ``kwargs`` set it, enable_thinking = (effort !=
    "none") (Qwen3's switch, and the qwen3 reasoning parser's)."""
    if effort is None:
        return kwargs
    given = kwargs or {}
    out = {**given, "reasoning_effort": effort}
    if "enable_thinking" not in given:
        out["enable_thinking"] = effort != "none"
    return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    # OpenAI's roles, and any other the chat template knows (Llama 3's "ipython", the older
    # "function"): vLLM hands every role to the template, which refuses what it cannot render.
    role: str = Field(min_length=1, max_length=64)
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    # An assistant turn's thinking, sent back for templates that render it (Qwen3's, for the
    # turns after the last user message): vLLM's field, and the older reasoning_content.
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None

    def for_template(self, embeds_marker: Optional[str] = None) -> dict:
        """The message as the chat template sees it (tool calls' arguments as objects, as
        Hugging Face templates expect; the thinking as both reasoning and reasoning_content,
        as vLLM hands it over). A list of parts stays one, of text parts only, for the
        template's content format (chat_content_format.py) to give as it asks; with
        ``embeds_marker``, a prompt_embeds part is a text part of it (chat_embeds.py)."""
        content = self.content
        if isinstance(content, list):
            self.text(embeds_marker)        # text parts only
            content = [{"type": "text", "text": embeds_marker
                        if p.get("type") == "prompt_embeds" else p["text"]} for p in content]
        m: dict[str, Any] = {"role": self.role, "content": content}
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:
            if self.role != "assistant":
                raise ValueError("messages: reasoning is an assistant message's, not a "
                                 f"{self.role!r} one's")
            m["reasoning"] = m["reasoning_content"] = thought
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        return m

    def text(self, embeds_marker: Optional[str] = None) -> str:
        """The message's text (its text parts joined); a prompt_embeds part is refused, or
        is ``embeds_marker`` when given."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") == "prompt_embeds":
                if embeds_marker is not None:
                    parts.append(embeds_marker)
                    continue
                raise ValueError("messages: content parts of type prompt_embeds are taken "
                                 "by /v1/chat/completions only")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)          # as vLLM joins a message's text parts


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class _NamedFunction(BaseModel):
    name: str


class ToolChoiceFunction(BaseModel):
    type: Literal["function"] = "function"
    function: _NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=-1)  # as completions' logprobs
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ToolChoiceFunction]] = None
    parallel_tool_calls: bool = True
    # Declared so that they are refused by name (see _REFUSED_CHAT).
    audio: Any = None
    modalities: Any = None
    function_call: Any = None
    functions: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    documents: Any = None
    # vLLM's: the prompt ends inside the last message (add_generation_prompt false), and
    # echo puts a last assistant message before the reply.
    continue_final_message: bool = False
    echo: bool = False
    # vLLM's: false leaves the reasoning (--reasoning-parser) out of the answer.
    include_reasoning: bool = True
    # OpenAI's, as vLLM takes it: the chat template's reasoning_effort variable (template_vars)
    reasoning_effort: Optional[ReasoningEffort] = None
    # vLLM's: the answer (a stream: its first chunks) carries the chat template's prompt text
    return_prompt_text: Optional[bool] = None
    # vLLM's: each choice (each chunk) carries its token_ids, the answer (a stream: each
    # choice's first chunk) the prompt's prompt_token_ids
    return_token_ids: Optional[bool] = None

    REFUSED: ClassVar[dict] = {k: v for k, v in {**_REFUSED_COMMON, **_REFUSED_CHAT}.items()
                               if k != "return_token_ids"}

    def unknown_fields(self) -> list[str]:
        return super().unknown_fields() + [f"messages[{i}].{k}" for i, m in
                                           enumerate(self.messages) for k in m.model_extra or ()]

    def template_vars(self) -> Optional[dict]:
        return with_reasoning_effort(self.chat_template_kwargs, self.reasoning_effort)

    def check_combinations(self) -> None:
        super().check_combinations()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM 0.32's): the chat fields, with ``messages`` a
    list of conversations, each answered as one choice."""
    messages: list[list[ChatMessage]] = Field(min_length=1)     # type: ignore[assignment]

    def check_combinations(self) -> None:
        super().check_combinations()
        if any(not conversation for conversation in self.messages):
            raise ValueError("messages: every conversation needs at least one message")
        for name, refused in (("stream", self.stream), ("tools", self.tools),
                              ("use_beam_search", self.use_beam_search), ("n", self.n != 1)):
            if refused:
                raise ValueError(f"{name}: not supported by batch chat completions (as vLLM)")

    def unknown_fields(self) -> list[str]:
        return []           # each conversation's request names them (the chat route's check)

    def conversation(self, i: int) -> ChatCompletionRequest:
        """Conversation i as a chat completion request of its own."""
        return ChatCompletionRequest.model_validate(
            {**self.model_dump(exclude_unset=True), "messages": self.model_dump()["messages"][i]})


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered as the chat route renders them. A
    field it does not know is refused by name."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    # Default: True for a prompt, False for messages (the template writes them), as vLLM.
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int]


class PoolingBaseRequest(BaseModel):
    """vLLM's fields common to its pooling requests (/v1/embeddings, /classify, /score,
    /rerank), and the ones refused by name."""
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    use_activation: Optional[bool] = None
    priority: int = 0
    # Declared so that they are refused by name (see REFUSED).
    padding: Any = None
    request_id: Any = None
    mm_processor_kwargs: Any = None
    normalize: Any = None           # removed in vLLM: refused with its word
    # vLLM's: the prompts' prefix-cache blocks are shared only with requests of this salt
    cache_salt: Optional[str] = None

    REFUSED: ClassVar[dict] = {
        "padding": ("do_not_pad",), "request_id": (), "mm_processor_kwargs": (),
    }
    _check_cache_salt = cache_salt_validator()

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def check_combinations(self) -> None:
        if self.normalize is not None:
            raise ValueError("normalize: was removed (vLLM); use use_activation instead")


class ClassificationRequest(PoolingBaseRequest):
    """POST /classify: vLLM's completion form (``input``: one class vector per input) or its
    chat form (``messages``: one conversation, rendered by the chat template)."""
    input: Union[str, list[str], list[int], list[list[int]], None] = None
    messages: Optional[list[ChatMessage]] = None
    # Default: True for input, False for messages (the template writes them), as vLLM.
    add_special_tokens: Optional[bool] = None
    # vLLM's chat options, with its pooling defaults (no generation prompt)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    media_io_kwargs: Any = None     # declared so that it is refused by name (no media here)

    REFUSED: ClassVar[dict] = {**PoolingBaseRequest.REFUSED, "media_io_kwargs": ()}

    def unknown_fields(self) -> list[str]:
        return super().unknown_fields() + [
            f"messages[{i}].{k}" for i, m in enumerate(self.chat_messages())
            for k in m.model_extra or ()]

    def chat_messages(self) -> list:
        """Every message of the request's conversations."""
        return [m for c in self.conversations() for m in c]

    def conversations(self) -> list:
        """The request's conversations (a list of ChatMessage lists): none for input's
        prompts."""
        return [self.messages] if self.messages is not None else []


class EmbeddingRequest(ClassificationRequest):
    """POST /v1/embeddings (OpenAI's fields and vLLM's extras for the embed task). Its chat
    forms, as vLLM 0.32's: ``messages`` one conversation or a list of them (one embedding
    each), or the same given as ``input``."""
    input: Union[str, list[str], list[int], list[list[int]], list[ChatMessage],
                 list[list[ChatMessage]], None] = None
    messages: Union[list[ChatMessage], list[list[ChatMessage]], None] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    embed_dtype: Any = None
    endianness: Any = None

    REFUSED: ClassVar[dict] = {**ClassificationRequest.REFUSED, "embed_dtype": ("float32",),
                               "endianness": ("native", "little")}

    def conversations(self) -> list:
        chat = self.messages if self.messages is not None else self.input
        if not chat or not isinstance(chat, list) or isinstance(chat[0], (str, int)) or (
                isinstance(chat[0], list) and (not chat[0] or isinstance(chat[0][0], int))):
            return []
        return [chat] if isinstance(chat[0], ChatMessage) else chat


class ScoringRequest(PoolingBaseRequest):
    """vLLM's scoring fields (/score, /rerank); the pair texts are the subclasses'."""
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: Any = None
    chat_template_kwargs: Any = None

    REFUSED: ClassVar[dict] = {**PoolingBaseRequest.REFUSED, "max_tokens_per_query": (0,),
                               "max_tokens_per_doc": (0,), "instruction": (),
                               "chat_template_kwargs": ()}


ScoreInput = Union[str, dict]


class ScoreRequest(ScoringRequest):
    """POST /score: vLLM's pairs under any of its four names (text_1 / text_2, queries /
    documents, queries / items, data_1 / data_2)."""
    text_1: Union[ScoreInput, list[ScoreInput], None] = None
    text_2: Union[ScoreInput, list[ScoreInput], None] = None
    queries: Union[ScoreInput, list[ScoreInput], None] = None
    documents: Union[ScoreInput, list[ScoreInput], None] = None
    items: Union[ScoreInput, list[ScoreInput], None] = None
    data_1: Union[ScoreInput, list[ScoreInput], None] = None
    data_2: Union[ScoreInput, list[ScoreInput], None] = None

    PAIRS: ClassVar[tuple] = (("queries", "documents"), ("queries", "items"),
                              ("data_1", "data_2"), ("text_1", "text_2"))

    def pair(self) -> tuple:
        """(first, second, their field names): the first name pair the request sets."""
        for a, b in self.PAIRS:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                return getattr(self, a), getattr(self, b), (a, b)
        raise ValueError("text_1: Field required (with text_2; or queries with documents or "
                         "items, or data_1 with data_2)")


class RerankRequest(ScoringRequest):
    """POST /rerank (Jina's and Cohere's form, as vLLM serves it)."""
    query: Optional[ScoreInput] = None
    documents: Union[ScoreInput, list[ScoreInput], None] = None
    top_n: int = Field(default=0, ge=0)
    # every result carries its document (vLLM's answer): asking for none is refused
    return_documents: Any = None

    REFUSED: ClassVar[dict] = {**ScoringRequest.REFUSED, "return_documents": (True,)}

    def pair(self) -> tuple:
        for name in ("query", "documents"):
            if getattr(self, name) is None:
                raise ValueError(f"{name}: Field required")
        return self.query, self.documents, ("query", "documents")


class GenerativeScoringRequest(BaseModel):
    """POST /generative_scoring (vLLM 0.32's): each item joined to the query, scored by the
    probability of label_token_ids as the next token."""
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    query: Union[str, list[int]]
    items: Union[list[str], list[list[int]]]
    label_token_ids: list[int]
    # True: softmax over the labels' logprobs; False: their probabilities over the vocabulary
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True     # the query's; an item never gets them (vLLM)
    priority: int = 0
    # vLLM's: the prompts' prefix-cache salt, and the response's id after its prefix
    cache_salt: Optional[str] = None
    request_id: Optional[str] = None

    REFUSED: ClassVar[dict] = {}
    _check_cache_salt = cache_salt_validator()

    def check_combinations(self) -> None:
        if not self.label_token_ids:
            raise ValueError("label_token_ids: must hold at least one token id")
        if not self.items:
            raise ValueError("items: must hold at least one item")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())
