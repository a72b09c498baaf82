"""The request body of OpenAI's Responses API (``POST /v1/responses``) as vLLM 0.32 takes it:
``input`` (a string, or items: messages whose content is a string or ``input_text`` /
``output_text`` parts, and a conversation's ``function_call`` and ``function_call_output``
items), ``instructions``, the sampling fields, ``text.format`` (structured outputs), function
``tools`` and ``tool_choice`` (as the chat route serves them), ``metadata`` and ``user``
(echoed).

As on the other routes, no field is silently dropped: a field we cannot honour is declared
and listed in ``REFUSED`` with the values that mean "not used" (a request that sets it
otherwise is a 400 naming it); fields neither OpenAI nor vLLM knows are logged once.
``store`` is taken and not honoured, as vLLM does unless VLLM_ENABLE_RESPONSES_API_STORE is
set: nothing is stored, so ``previous_response_id`` and ``GET /v1/responses/{id}`` answer
404 (the route).
"""
from __future__ import annotations

import uuid
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llm_serving.entrypoints.openai_protocol import (ChatMessage, FunctionDef, ReasoningEffort,
                                                     Tool, ToolChoiceFunction, XArgs,
                                                     cache_salt_validator, sampling_knobs,
                                                     with_reasoning_effort)
from llm_serving.sampling_params import (MAX_LOGPROBS, MAX_STOPS, RequestOutputKind,
                                         SamplingParams, StructuredOutputsParams)

# Message content parts that carry text (the model's own earlier answers carry output_text).
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"


class ReasoningParam(BaseModel):
    """The request's ``reasoning``: its effort is honoured; summaries are not made here, so
    asking for one is refused by name."""
    model_config = ConfigDict(extra="forbid")
    effort: Optional[ReasoningEffort] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value):
        if value is not None:
            raise ValueError("no reasoning summaries are made by this server")
        return value


class ResponsesRequest(BaseModel):
    # A NaN or an infinity is refused as such (not as "should be >= 0").
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    model: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = False
    # Taken, never honoured (vLLM's default): nothing is stored.
    store: Optional[bool] = True
    metadata: Optional[dict[str, str]] = Field(None, max_length=16)
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    # Only "text", "json_object" and "json_schema" formats (structured outputs).
    text: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = True
    service_tier: Optional[str] = "auto"
    truncation: Optional[str] = "disabled"
    # Function tools only (the chat route's); "auto" needs --enable-auto-tool-choice.
    tool_choice: Any = "auto"
    tools: Optional[list[Any]] = None
    # vLLM's extras.
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOPS)
    ignore_eos: bool = False
    logit_bias: Optional[dict[str, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # The response's id ("resp_<hex>" when left out), as vLLM.
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # Without a reasoning parser there is no reasoning to leave out: either value holds.
    include_reasoning: bool = True
    # Only "message.output_text.logprobs": the output's log-probabilities, each token with
    # its top_logprobs most likely.
    include: Optional[list[str]] = None
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    # vLLM's: reasoning.effort becomes the chat template's reasoning_effort (and, "none",
    # enable_thinking false), as chat's reasoning_effort
    reasoning: Optional[ReasoningParam] = None
    # Declared so that they are refused by name (see REFUSED).
    background: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    stream_options: Any = None
    prompt_cache_key: Any = None
    # vLLM's: the prompt's prefix-cache blocks are shared only with requests of this salt
    cache_salt: Optional[str] = None
    session_id: Any = None
    vllm_xargs: Optional[XArgs] = None     # extra_args, as on the chat route
    # PD disaggregation (docs/pd_disaggregation.md), as on the chat route
    kv_transfer_params: Optional[dict[str, Any]] = None
    ec_transfer_params: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    watermarking: Any = None
    enable_response_messages: Any = None
    previous_input_messages: Any = None
    # Nothing is stored: a previous response is never found (the route answers 404).
    previous_response_id: Optional[str] = None

    _check_cache_salt = cache_salt_validator()

    REFUSED: ClassVar[dict] = {
        "background": (False,), "max_tool_calls": (),
        "prompt": (), "conversation": (), "stream_options": (),
        "service_tier": ("auto", "default"),
        "truncation": ("disabled",), "prompt_cache_key": (),
        "session_id": (), "ec_transfer_params": (),
        "mm_processor_kwargs": (), "media_io_kwargs": (),
        "mm_payload": ("tensors",), "return_mm_kwargs": (), "watermarking": (False,),
        "enable_response_messages": (False,), "previous_input_messages": (),
    }

    def template_vars(self) -> Optional[dict]:
        return with_reasoning_effort(self.chat_template_kwargs,
                                     self.reasoning.effort if self.reasoning else None)

    def logprobs(self) -> Optional[int]:
        """The top log-probabilities asked for (``include``), else None; ValueError naming
        an ``include`` we cannot serve."""
        other = sorted(set(self.include or ()) - {LOGPROBS})
        if other:
            raise ValueError(f"include: {other[0]!r} is not supported by this server (only "
                             f"{LOGPROBS!r})")
        return self.top_logprobs if LOGPROBS in (self.include or ()) else None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def response_id(self) -> str:
        return self.request_id or f"resp_{uuid.uuid4().hex}"

    def chat_tools(self) -> tuple[Optional[list[Tool]], Any]:
        """The function tools as the chat route's, and tool_choice as the chat route's
        ("none", "auto", "required" or the named function; None without tools, where "auto"
        and "none" mean no tools, as vLLM). ValueError naming the field."""
        tools = []
        for i, t in enumerate(self.tools or ()):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise ValueError(f"tools: tool {i} is of type {kind!r}; this server takes "
                                 f"only function tools")
            try:
                tools.append(Tool(function=FunctionDef(
                    **{k: v for k, v in t.items() if k != "type"})))
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"tools: tool {i}: {'.'.join(map(str, err['loc']))}: "
                                 f"{err['msg']}") from None
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            if not isinstance(choice.get("name"), str):
                raise ValueError("tool_choice: a function choice needs its name")
            choice = ToolChoiceFunction(function={"name": choice["name"]})
        elif choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: must be none, auto, required or "
                             f"{{\"type\": \"function\", \"name\": ...}}, got {choice!r}")
        if not tools and choice in ("auto", "none"):
            return None, None
        return tools or None, choice

    def echoed_tool_choice(self) -> Any:
        """tool_choice as the response echoes it: "none" when there are no tools (vLLM)."""
        if not self.tools and self.tool_choice in ("auto", "none"):
            return "none"
        return self.tool_choice

    def messages(self) -> tuple[list[ChatMessage], bool]:
        """The conversation the chat template renders: ``instructions`` as a system message
        first, then the input's items as the chat route's messages (a ``function_call`` is
        a tool call of the assistant message before it, or of a new one; a
        ``function_call_output`` a tool message, as vLLM renders them); and whether the last
        one is an assistant message to continue (its status "in_progress" or "incomplete",
        as vLLM). ValueError naming the item for anything else."""
        out = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions else []
        if isinstance(self.input, str):
            return out + [ChatMessage(role="user", content=self.input)], False
        if not self.input:
            raise ValueError("input: give at least one message")
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "function_call":
                _add_call(out, item, i)
                continue
            if kind == "function_call_output":
                call_id = item.get("call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise ValueError(f"input: item {i} (function_call_output) needs its "
                                     f"call_id")
                out.append(ChatMessage(role="tool", content=_text(item.get("output"), i),
                                       tool_call_id=call_id))
                continue
            if kind == "reasoning":
                _add_reasoning(out, item, i)
                continue
            if kind != "message":
                raise ValueError(f"input: item {i} is of type {kind!r}; this server takes "
                                 f"message, reasoning, function_call and function_call_output "
                                 f"items")
            role = item.get("role")
            if not isinstance(role, str) or not 1 <= len(role) <= 64:
                raise ValueError(f"input: item {i} needs a role")
            text = _text(item.get("content"), i)
            if role == "assistant" and out and out[-1].role == "assistant" \
                    and out[-1].content is None:      # the answer after its reasoning item
                out[-1].content = text
            else:
                out.append(ChatMessage(role=role, content=text))
        last = self.input[-1]
        return out, last.get("type", "message") == "message" and \
            last.get("role") == "assistant" and \
            last.get("status") in ("in_progress", "incomplete")

    def structured(self) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
        """The structured output ``text.format`` or ``structured_outputs`` asks for, and the
        field it came from (ValueError naming the field when both or bad)."""
        fmt = (self.text or {}).get("format")
        bad = sorted(set(self.text or {}) - {"format", "verbosity"})
        if bad:
            raise ValueError(f"text: unknown field {bad[0]!r}")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise ValueError(f"text.verbosity: not supported by this server (got "
                             f"{self.text['verbosity']!r})")
        found = None
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                found = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                if not isinstance(fmt.get("schema"), dict):
                    raise ValueError("text.format: json_schema needs schema, a JSON schema "
                                     "object")
                found = StructuredOutputsParams(json=fmt["schema"])
            elif kind != "text":
                raise ValueError(f"text.format: type must be text, json_object or "
                                 f"json_schema, got {kind!r}")
        if self.structured_outputs is not None:
            if found is not None:
                raise ValueError("structured_outputs: give only one of structured_outputs "
                                 "and text.format")
            try:
                return StructuredOutputsParams(**self.structured_outputs), "structured_outputs"
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        return found, "text.format" if found is not None else None

    def sampling_params(self, max_tokens: Optional[int], defaults: Optional[dict],
                        structured: Optional[StructuredOutputsParams],
                        logprobs: Optional[int]) -> SamplingParams:
        """``defaults``: the server's (``generation_defaults``) for what the request leaves
        out; ``max_tokens``: the output bound the route worked out."""
        return SamplingParams(
            n=1, **sampling_knobs(self, defaults), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, structured_outputs=structured,
            kv_transfer_params=self.kv_transfer_params, output_kind=RequestOutputKind.DELTA,
            extra_args=self.vllm_xargs or None)


def _add_call(out: list[ChatMessage], item: dict, i: int) -> None:
    """A function_call item as a tool call of the assistant message before it (a new one
    when the last message is not the assistant's), as vLLM merges them."""
    fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
    bad = [k for k, v in fields.items() if not isinstance(v, str) or (k != "arguments"
                                                                      and not v)]
    if bad:
        raise ValueError(f"input: item {i} (function_call) needs {bad[0]}, a string")
    call = {"id": fields["call_id"], "type": "function",
            "function": {"name": fields["name"], "arguments": fields["arguments"]}}
    if out and out[-1].role == "assistant":
        out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
    else:
        out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _add_reasoning(out: list[ChatMessage], item: dict, i: int) -> None:
    """A reasoning item (an earlier answer's, sent back) as the thinking of the assistant
    message it belongs to: the one before it when that has none yet, else a new one that the
    next assistant message item completes, as vLLM merges them. Its text is its content's,
    else its summary's."""
    if item.get("encrypted_content"):
        raise ValueError(f"input: item {i} (reasoning) has encrypted_content, which this "
                         "server does not make or read")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"input: item {i} (reasoning): content and summary are lists of "
                         "parts with a text")
    text = parts[0]["text"] if parts else ""
    if out and out[-1].role == "assistant" and out[-1].reasoning is None:
        out[-1].reasoning = text
    else:
        out.append(ChatMessage(role="assistant", content=None, reasoning=text))


def _text(content, i: int) -> str:
    """A message item's content as text: a string, or its text parts joined by newlines (as
    a chat message's)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"input: item {i}'s content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"input: item {i} has a content part of type {kind!r}; this "
                             f"server takes only input_text and output_text parts")
        texts.append(part["text"])
    return "\n".join(texts)


