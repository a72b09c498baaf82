"""Anthropic's Messages API as vLLM 0.32 serves it: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, so that an Anthropic SDK client (and the tools built on
one) can use this server.

A request is a chat completions request underneath (``anthropic_protocol.to_chat``): the
same chat template, sampling, tool calls (--enable-auto-tool-choice, --tool-call-parser),
reasoning (--reasoning-parser: "thinking" blocks), queue bounds and abort on a client gone;
its answer is the chat answer said in Anthropic's words. stop_reason is max_tokens for an
answer cut by max_tokens, tool_use when it called a tool, stop_sequence (with the
stop_sequence) when it ended on one, else end_turn. Streamed, it is vLLM's event sequence
(``event: <type>`` and ``data: <json>``): message_start, then per content block
content_block_start, content_block_delta..., content_block_stop, then message_delta (the
stop_reason and the usage) and message_stop. Errors have Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llm_serving.entrypoints import openai_routes, tool_calls
from llm_serving.entrypoints.anthropic_protocol import (EFFORTS, CountTokensRequest,
                                                        MessagesRequest)
from llm_serving.entrypoints.http_common import (ANTHROPIC_PATH, SSE_DONE, refuse_unsupported,
                                                server_state, translate_error)
from llm_serving.entrypoints.openai_protocol import with_reasoning_effort
from llm_serving.entrypoints.openai_routes import template_kwargs

router = APIRouter()
logger = logging.getLogger("llm_serving.server")
PATH = ANTHROPIC_PATH


def is_anthropic(request: Request) -> bool:
    """Whether ``request`` is one of these routes (whose errors have Anthropic's shape)."""
    return request.url.path.removeprefix(request.scope.get("root_path", "")).startswith(PATH)


def _checked(req: CountTokensRequest):
    refuse_unsupported(req, req.REFUSED)
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       ", ".join(unknown))


# (tokenizer, chat template, what is asked) -> what the template answered
_PROBED: dict = {}


def _template_says(request: Request, question: str, probe) -> Any:
    """What ``probe(render)`` finds of the server's chat template, asked once per template:
    ``render(messages, **kwargs)`` is the template's text, None when it raises."""
    state = server_state(request)
    tok = state.require_engine().tokenizer
    key = (id(tok), state.chat_template, question)
    if key not in _PROBED:
        def render(messages, **kwargs) -> Optional[str]:
            try:
                return tok.render_chat_template(messages, chat_template=state.chat_template,
                                                **kwargs)
            except Exception:   # noqa: BLE001 - whatever the template raises
                return None
        _PROBED[key] = probe(render)
    return _PROBED[key]


def _merge_system(request: Request, req: CountTokensRequest) -> bool:
    """Whether the system messages among ``req``'s messages join the leading one: as vLLM,
    when the chat template (with tools and without) refuses a conversation of system, user,
    system, user (Qwen's take a system message first only)."""
    if not req.inline_system():
        return False
    turns = [{"role": role, "content": "t"} for role in ("system", "user") * 2]
    return _template_says(request, "system first", lambda render: any(
        render(turns, add_generation_prompt=False, tools=tools) is None
        for tools in (None, [])))


def _disabled_effort(request: Request, req: CountTokensRequest) -> str:
    """The reasoning_effort of thinking disabled: "none", unless the template cannot render
    it or renders it as it renders an effort (it cannot turn thinking off): then "low", as
    vLLM probes it."""
    if not req.thinking_disabled():
        return "none"
    state = server_state(request)
    if state.frontend.anthropic_disabled_thinking_effort != "auto":
        return state.frontend.anthropic_disabled_thinking_effort
    hi = [{"role": "user", "content": "Hi"}]

    def probe(render) -> str:
        def text(effort):
            return render(hi, **template_kwargs(state, with_reasoning_effort(None, effort)))
        none = text("none")
        return "low" if none is None or any(text(e) == none for e in EFFORTS) else "none"
    return _template_says(request, "thinking off", probe)


def _usage(usage: Optional[dict]) -> dict:
    """Anthropic's usage of the chat usage: input_tokens leave out the prefix-cached tokens
    (cache_read_input_tokens, with --enable-prompt-tokens-details), as vLLM's."""
    usage = usage or {}
    out = {"input_tokens": usage.get("prompt_tokens", 0),
           "output_tokens": usage.get("completion_tokens") or 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        out["input_tokens"] = max(0, out["input_tokens"] - cached)
        out["cache_read_input_tokens"] = cached
    return out


def _stop_reason(finish: Optional[str], stop, tool_used: bool,
                 tool_complete: bool) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) of a chat finish_reason and stop_reason, as vLLM maps
    them: max_tokens first; tool_use when the calls are complete (a stop string cut them
    otherwise)."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _arguments(text: str) -> Optional[dict]:
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


@router.post(PATH)
async def create_message(req: MessagesRequest, request: Request):
    _checked(req)
    try:
        chat = req.to_chat(_merge_system(request, req), _disabled_effort(request, req))
    except ValueError as e:
        raise translate_error(e) from None
    answer = await openai_routes.chat_completions(chat, request)
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_events(answer.body_iterator),
                                 media_type="text/event-stream")
    return JSONResponse(_message(json.loads(answer.body)))


def _message(body: dict) -> dict:
    """The non-streamed answer: a thinking block, a text block, then the tool_use blocks."""
    choice = body["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    content = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"],
                        "signature": uuid.uuid4().hex})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in calls:
        fn = call["function"]
        args = _arguments(fn["arguments"])
        if args is None:        # cut by max_tokens: not a call to run, its text shown
            if fn["arguments"]:
                content.append({"type": "text", "text": fn["arguments"]})
            continue
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                        "input": args})
    stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice["stop_reason"],
                                              bool(calls), bool(calls))
    out = {"id": body["id"], "type": "message", "role": "assistant",
           "content": content or [{"type": "text", "text": ""}], "model": body["model"],
           "stop_reason": stop_reason, "usage": _usage(body.get("usage"))}
    if stop_sequence is not None:
        out["stop_sequence"] = stop_sequence
    if body.get("kv_transfer_params") is not None:
        out["kv_transfer_params"] = body["kv_transfer_params"]
    return out


def _event(kind: str, **fields) -> bytes:
    """One event, its type named twice and its fields in vLLM's order."""
    body = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed answer: one open at a time, each started, fed and
    stopped by its events. Text that comes while a tool_use block is open is held and sent as
    a text block of its own after it (vLLM's order)."""

    def __init__(self):
        self.index, self.kind, self.signature, self.call_id = 0, None, None, None
        self.held: list[str] = []

    def start(self, block: dict) -> list[bytes]:
        events = self.stop()
        self.kind = block["type"]
        self.signature = uuid.uuid4().hex if self.kind == "thinking" else None
        self.call_id = block.get("id")
        return events + [_event("content_block_start", content_block=block, index=self.index)]

    def delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", delta=delta, index=self.index)

    def stop(self) -> list[bytes]:
        """Stop the open block (its signature first, for thinking), then send the held text."""
        held, self.held = "".join(self.held), []
        events = []
        if self.kind is not None:
            if self.signature is not None:
                events.append(self.delta({"type": "signature_delta",
                                          "signature": self.signature}))
            events.append(_event("content_block_stop", index=self.index))
            self.index += 1
            self.kind = self.signature = self.call_id = None
        if held:
            events += self.start({"type": "text", "text": ""})
            events.append(self.delta({"type": "text_delta", "text": held}))
            events += self.stop()
        return events

    def text(self, kind: str, text: str) -> list[bytes]:
        """A text or thinking delta, in a block of its kind."""
        if kind == "text" and self.kind == "tool_use":
            self.held.append(text)
            return []
        events = [] if self.kind == kind else self.start({"type": kind, kind: ""})
        return events + [self.delta({"type": f"{kind}_delta", kind: text})]


async def _events(chunks):
    """The chat stream's chunks (SSE bytes, usage in each) as Anthropic's events. Closing
    it (a client gone) closes the chat stream, which aborts the request."""
    blocks = _Blocks()
    started, finish, stop, tool_used, last_args = False, None, None, False, []
    ids: dict[int, str] = {}        # a call's index -> its id
    try:
        async for raw in chunks:
            if not raw.startswith(b"data:"):
                yield raw                   # a keep-alive comment
                continue
            if raw == SSE_DONE:
                for e in blocks.stop():
                    yield e
                yield _event("message_stop")
                return
            chunk = json.loads(raw[5:])
            if "error" in chunk:
                err = chunk["error"]
                yield _event("error", error={"type": err.get("type"),
                                             "message": err.get("message")})
                return
            if not started:
                started = True
                yield _event("message_start", message={
                    "id": chunk["id"], "type": "message", "role": "assistant", "content": [],
                    "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
                    "usage": _usage(chunk.get("usage"))})
                continue
            if not chunk["choices"]:        # the last chunk: the usage
                for e in blocks.stop():
                    yield e
                reason, seq = _stop_reason(finish or "stop", stop, tool_used,
                                           tool_used and _arguments("".join(last_args))
                                           is not None)
                yield _event("message_delta",
                             delta={"stop_reason": reason, "stop_sequence": seq},
                             usage=_usage(chunk.get("usage")))
                continue
            ch = chunk["choices"][0]
            if ch["finish_reason"] is not None:
                finish, stop = ch["finish_reason"], ch.get("stop_reason")
            delta = ch["delta"]
            for kind, field in (("thinking", "reasoning"), ("text", "content")):
                if delta.get(field):
                    for e in blocks.text(kind, delta[field]):
                        yield e
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id") is not None:
                    ids[call["index"]] = call["id"]
                    if blocks.call_id != call["id"] and fn.get("name") is not None:
                        tool_used, last_args = True, []
                        for e in blocks.start({"type": "tool_use", "id": call["id"],
                                               "name": fn["name"], "input": {}}):
                            yield e
                if fn.get("arguments") and blocks.call_id == ids.get(call["index"]):
                    last_args.append(fn["arguments"])
                    yield blocks.delta({"type": "input_json_delta",
                                        "partial_json": fn["arguments"]})
    finally:
        await chunks.aclose()


@router.post(PATH + "/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    """The prompt's tokens, as /v1/messages would count them (input_tokens)."""
    _checked(req)
    state = server_state(request)
    state.check_model(req.model)
    engine = state.require_engine()
    try:
        chat = req.chat_request(_merge_system(request, req), _disabled_effort(request, req))
        tools, _ = tool_calls.resolve(chat.tools, chat.tool_choice, True, True)
    except ValueError as e:
        raise translate_error(e) from None
    tools = tool_calls.prompt_tools(tools, chat.tool_choice,
                                    state.frontend.exclude_tools_when_tool_choice_none)
    _, ids, _ = await asyncio.to_thread(openai_routes.chat_prompt_ids, state, engine, chat,
                                        tools)
    return {"input_tokens": len(ids), "context_management": {
        "original_input_tokens": len(ids)}}
