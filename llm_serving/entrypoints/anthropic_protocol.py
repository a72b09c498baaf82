"""Request bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as vLLM 0.32 takes them, and their translation into the chat
request the chat completions route serves (``to_chat``).

The translation is vLLM's: ``system`` (a string or text blocks, joined) is the first system
message; a message's text blocks are its content, its ``thinking`` blocks the assistant's
reasoning, its ``tool_use`` blocks tool calls (``input`` as JSON arguments) and a user's
``tool_result`` blocks each a ``tool`` message before it; ``tools`` are functions (their
``input_schema`` the parameters), ``tool_choice`` any / tool / auto / none is required /
named / auto / none; ``stop_sequences`` are ``stop``; ``thinking`` enabled is its
``budget_tokens`` as ``thinking_token_budget`` (at least 1024 and below ``max_tokens``),
disabled a ``reasoning_effort`` (none, or ``--anthropic-disabled-thinking-effort``'s). What
is not text (images, documents, tool references) is refused by name, as every field we cannot
honour.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_serving.entrypoints.openai_protocol import ChatCompletionRequest
from llm_serving.sampling_params import MAX_STOPS

# Claude Code's first system block: a per-request hash, dropped as vLLM drops it (it would
# defeat the prefix cache).
_BILLING_HEADER = "x-anthropic-billing-header"


class ContentBlock(BaseModel):
    """One block of a message's content (or of ``system``): only the fields of its type are
    read. ``cache_control`` is taken and needs nothing: the prefix cache is automatic."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None
    cache_control: Optional[dict[str, Any]] = None
    citations: Optional[list[Any]] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    strict: Optional[bool] = None
    cache_control: Optional[dict[str, Any]] = None
    type: Optional[str] = None
    defer_loading: Optional[bool] = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


EFFORTS = ("low", "medium", "high", "xhigh", "max")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Optional[Literal[EFFORTS]] = None
    format: Optional[dict[str, Any]] = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=1024)
    display: Optional[Literal["summarized", "omitted", "updates"]] = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt of a conversation, without sampling."""
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[Message]
    system: Optional[Union[str, list[ContentBlock]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None     # vLLM's
    cache_control: Optional[dict[str, Any]] = None      # taken: the prefix cache is automatic

    # Fields we cannot honour, with the values that mean "not used" (None always does).
    REFUSED: ClassVar[dict] = {}

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def chat_request(self, merge_system: bool = False,
                     disabled_effort: str = "none") -> ChatCompletionRequest:
        """The chat request of the conversation (ValueError naming the field it cannot be)."""
        return _chat_request(self.chat_fields(merge_system, disabled_effort))

    def thinking_disabled(self) -> bool:
        return self.thinking is not None and self.thinking.type == "disabled"

    def inline_system(self) -> bool:
        """Whether system messages stand among the messages (Claude Code's reminders)."""
        return any(m.role == "system" for m in self.messages)

    def chat_fields(self, merge_system: bool = False, disabled_effort: str = "none") -> dict:
        """The chat request's fields of the conversation (messages, tools, template).
        ``merge_system``: the system messages among the messages join the leading one, for
        a template that takes a system message first only; ``disabled_effort``: the
        reasoning_effort of thinking disabled, "low" for a template that cannot turn
        thinking off (vLLM's)."""
        inline = [m for m in self.messages if merge_system and m.role == "system"]
        messages = _system([*_blocks(self.system), *(b for m in inline
                                                     for b in _blocks(m.content))])
        for i, msg in enumerate(self.messages):
            if not any(msg is m for m in inline):
                messages += _message(msg, f"messages[{i}]")
        fields: dict[str, Any] = {"model": self.model, "messages": messages,
                                  "chat_template_kwargs": self.chat_template_kwargs}
        if self.tools is not None:
            fields["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool" else
                {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
            if choice.type == "tool" and not choice.name:
                raise ValueError("tool_choice.name: required when type is 'tool'")
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise ValueError("thinking.budget_tokens: required with type 'enabled'")
            fields["thinking_token_budget"] = thinking.budget_tokens
        if thinking is not None and thinking.type == "disabled":
            fields["reasoning_effort"] = disabled_effort
        out = self.output_config
        if out is not None and out.effort is not None:
            fields["reasoning_effort"] = out.effort
        if out is not None and out.format is not None:
            if out.format.get("type", "json_schema") != "json_schema" \
                    or not isinstance(out.format.get("schema"), dict):
                raise ValueError("output_config.format: only {'type': 'json_schema', "
                                 "'schema': {...}} is supported")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "json_schema", "schema": out.format["schema"]}}
        return fields


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = Field(None, max_length=MAX_STOPS)
    stream: bool = False
    # the chat route's bounds
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    metadata: Optional[dict[str, Any]] = None   # taken without effect, as vLLM takes it
    # vLLM's own fields, passed to the chat request (which refuses what it cannot honour)
    kv_transfer_params: Optional[dict[str, Any]] = None
    cache_salt: Any = None
    vllm_xargs: Any = None
    watermarking: Any = None
    ec_transfer_params: Any = None
    # Anthropic's, which we cannot honour
    container: Any = None
    mcp_servers: Any = None
    service_tier: Any = None
    context_management: Any = None

    REFUSED: ClassVar[dict] = {"ec_transfer_params": (), "container": (), "mcp_servers": (),
                               "service_tier": ("auto", "standard_only"),
                               "context_management": ()}

    def to_chat(self, merge_system: bool = False,
                disabled_effort: str = "none") -> ChatCompletionRequest:
        """The chat request this one is (ValueError naming the field it cannot be)."""
        fields = self.chat_fields(merge_system, disabled_effort)
        budget = fields.get("thinking_token_budget")
        # as vLLM, not on a PD prefill leg (max_tokens 1; its decode leg is checked)
        prefill_leg = bool((self.kv_transfer_params or {}).get("do_remote_decode"))
        if budget is not None and budget >= self.max_tokens and not prefill_leg:
            raise ValueError(f"thinking.budget_tokens: must be less than max_tokens "
                             f"({budget} >= {self.max_tokens}), as vLLM checks")
        fields.update(max_tokens=self.max_tokens, stop=self.stop_sequences,
                      temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      stream=self.stream, kv_transfer_params=self.kv_transfer_params,
                      cache_salt=self.cache_salt, vllm_xargs=self.vllm_xargs,
                      watermarking=self.watermarking)
        if self.stream:     # vLLM's: message_start and message_delta carry the usage
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return _chat_request(fields)


def _chat_request(fields: dict) -> ChatCompletionRequest:
    """The chat request of ``fields`` (ValueError naming the first field it refuses)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _blocks(content) -> list[ContentBlock]:
    """A system content as blocks."""
    if content is None:
        return []
    return [ContentBlock(type="text", text=content)] if isinstance(content, str) else content


def _system(blocks: list[ContentBlock]) -> list[dict]:
    """One system message of the text blocks, joined."""
    text = "".join(b.text for b in blocks if b.type == "text" and b.text
                   and not b.text.startswith(_BILLING_HEADER))
    return [{"role": "system", "content": text}] if text else []


def _message(msg: Message, where: str) -> list[dict]:
    """A message as chat messages: a user's tool results first (each a ``tool`` message),
    then the message itself unless a user's holds nothing else."""
    if msg.role == "system":
        return _system(_blocks(msg.content))
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    before: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, block in enumerate(msg.content):
        at = f"{where}.content[{j}]"
        kind = block.type
        if kind == "text":
            if block.text:
                texts.append(block.text)
        elif kind == "thinking":
            if msg.role != "assistant":
                raise ValueError(f"{at}: thinking blocks are an assistant message's")
            thoughts.append(block.thinking or "")
        elif kind == "redacted_thinking":
            pass            # opaque, as vLLM skips it
        elif kind == "tool_use":
            calls.append({"id": block.id or f"call_{j}", "type": "function",
                          "function": {"name": block.name or "",
                                       "arguments": json.dumps(block.input or {},
                                                               ensure_ascii=False)}})
        elif kind == "tool_result":
            result = _tool_result_text(block.content, at)
            if msg.role == "user":
                before.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                               "content": result})
            else:
                texts.append(f"Tool result: {result}")
        else:
            raise ValueError(f"{at}: {kind} blocks are not supported by this server (text, "
                             "thinking, tool_use and tool_result are)")
    out: dict[str, Any] = {"role": msg.role}
    if thoughts:
        out["reasoning"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    if texts:
        out["content"] = texts[0] if len(texts) == 1 else [
            {"type": "text", "text": t} for t in texts]
    if msg.role == "user" and "content" not in out:
        return before
    return before + [out]


def _tool_result_text(content, where: str) -> str:
    """A tool result's text: its text blocks, one a line."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, item in enumerate(content):
        if item.get("type") != "text":
            raise ValueError(f"{where}.content[{k}]: {item.get('type')} blocks in a tool "
                             "result are not supported by this server (text is)")
        texts.append(item.get("text") or "")
    return "\n".join(texts)


def _tool(tool: AnthropicTool, where: str) -> dict:
    if tool.type not in (None, "custom"):
        raise ValueError(f"{where}.type: {tool.type!r} (a server tool) is not supported by "
                         "this server; only custom tools with an input_schema are")
    if tool.defer_loading:
        raise ValueError(f"{where}.defer_loading: not supported by this server")
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": {"type": "object", **tool.input_schema}, "strict": tool.strict}}
