"""OpenAI's Responses API as vLLM 0.32 serves it, for text: ``POST /v1/responses``, and
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``, which find nothing since
nothing is stored (vLLM's default, without VLLM_ENABLE_RESPONSES_API_STORE).

A request is a chat request underneath: the same chat template, sampling defaults, queue
bounds, engine stream, abort on a client gone and error shape. Streamed, it is vLLM's event
sequence (``event: <type>`` and ``data: <json>`` lines, each event with its
``sequence_number``, no ``[DONE]``): response.created, response.in_progress, then with the
first text response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, and last response.completed (also for an answer cut by
max_output_tokens, whose status is "incomplete", as vLLM sends it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Optional

from fastapi import APIRouter, Request

from llm_serving.entrypoints.http_common import (HTTPError, event_stream, log_request,
                                                engine_request_id,
                                                output_error, refuse_unsupported, renamed,
                                                translate_error)
from llm_serving.entrypoints import reasoning, tool_calls, unread_offers
from llm_serving.entrypoints.openai_routes import (chat_logprobs, collect_choices, encode_text,
                                                   grammar_named, json_answer, merge_streams,
                                                   render_chat, start_requests, server_state,
                                                   template_kwargs)
from llm_serving.entrypoints.responses_items import OutputItems, message, reasoning_item
from llm_serving.entrypoints.responses_protocol import ResponsesRequest
from llm_serving.inputs import with_cache_salt

router = APIRouter()
logger = logging.getLogger("llm_serving.server")


def _not_found(response_id: str, param: str) -> HTTPError:
    """vLLM's answer for a response it does not hold (with no store, every one)."""
    return HTTPError(404, f"Response with id '{response_id}' not found.", param=param)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str):
    raise _not_found(response_id, "response_id")


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str):
    raise _not_found(response_id, "response_id")


def _check_fields(req: ResponsesRequest) -> None:
    refuse_unsupported(req, req.REFUSED)
    if req.previous_response_id is not None:
        raise _not_found(req.previous_response_id, "previous_response_id")
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       ", ".join(unknown))


def _usage(prompt_tokens: int, output_tokens: int, cached: int, thought: int = 0) -> dict:
    """vLLM's usage of a one-turn response; ``thought``: the reasoning's tokens."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": thought, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt_tokens + output_tokens}


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request):
    unread_offers.hold(request, req.kv_transfer_params)
    state = server_state(request)
    lora = state.check_model(req.model)
    _check_fields(req)
    engine = state.require_engine()
    args = state.engine_args
    auto_ok = bool(args.enable_auto_tool_choice and args.tool_call_parser)
    try:
        messages, continue_final = req.messages()
        structured, grammar_field = req.structured()
        top = req.logprobs()
        given, choice = req.chat_tools()
        tools, forced = tool_calls.resolve(given, choice, auto_ok,
                                           req.parallel_tool_calls is not False)
        shown = tool_calls.prompt_tools(given, choice,
                                        state.frontend.exclude_tools_when_tool_choice_none)
        if forced is not None and structured is not None:
            raise ValueError(f"tool_choice: a forced tool call cannot be combined with "
                             f"{grammar_field}")
    except ValueError as e:
        raise translate_error(e) from None
    if forced is not None:
        structured, grammar_field = forced, "tools"

    thinking = reasoning.thinking_enabled(template_kwargs(state, req.template_vars()))
    show_reasoning = req.include_reasoning

    def answer_calls() -> Optional[tool_calls.ChoiceStream]:
        """How the answer's text becomes function calls (None: it is all the message)."""
        return tool_calls.ChoiceStream(choice, args.tool_call_parser) if tools else None

    def prompt() -> tuple[str, list[int]]:
        try:
            text = render_chat(state, engine.tokenizer, messages, not continue_final,
                               continue_final, None, req.template_vars(), shown)
        except HTTPError as e:
            raise renamed(e, "input" if e.param == "messages" else None) from None
        return text, encode_text(engine, text, "input", False)
    # off the event loop, as chat's: a long conversation takes a while to template
    text, ids = await asyncio.to_thread(prompt)
    longest = engine.limits.max_model_len
    if len(ids) >= longest:
        raise HTTPError(400, f"input: the prompt is {len(ids)} tokens, which leaves nothing "
                        f"to generate within the maximum model length ({longest})",
                        param="input")
    if req.max_output_tokens is not None and req.max_output_tokens > longest:
        raise HTTPError(400, f"max_output_tokens: {req.max_output_tokens} is more than the "
                        f"maximum model length ({longest})", param="max_output_tokens")
    # vLLM's bound: what is left after the prompt, the request's or the model's default.
    asked = req.max_output_tokens or engine.default_sampling_params.get("max_tokens")
    max_tokens = min(longest - len(ids), asked or longest)
    try:
        params = req.sampling_params(max_tokens, engine.default_sampling_params, structured,
                                     top)
    except ValueError as e:
        raise translate_error(e) from None
    # --reasoning-parser: the thinking split off first, as on the chat route (a grammar holds
    # after it)
    think_parser = reasoning.gate_grammar(params, args, thinking,
                                          show_reasoning, text, ids, engine.tokenizer)

    def thinker() -> Optional[reasoning.Thoughts]:
        return reasoning.Thoughts(think_parser, thinking, engine.tokenizer) \
            if think_parser else None
    resp_id = req.response_id()
    as_ids = state.frontend.return_tokens_as_token_ids

    def logprobs(entries) -> list:
        """vLLM's output_text logprobs: each token's text, logprob, bytes and top ones."""
        return chat_logprobs(entries, top or 0, as_ids)["content"]
    prompts = with_cache_salt([{"prompt": text, "prompt_token_ids": ids}], req.cache_salt)
    streams = await start_requests(request, engine_request_id(resp_id), resp_id, prompts,
                                   params, req.priority, grammar_field, lora, one_answer=True)
    created = int(time.time())
    t0 = time.perf_counter()

    def response(status: str, output: list, usage: Optional[dict],
                 kv_transfer_params: Optional[dict] = None) -> dict:
        return {"id": resp_id, "created_at": created,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "instructions": req.instructions, "metadata": req.metadata,
                "model": state.model_name(lora), "object": "response", "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "temperature": params.temperature, "tool_choice": req.echoed_tool_choice(),
                "tools": req.tools or [],
                "top_p": params.top_p, "background": False, "max_output_tokens": max_tokens,
                "max_tool_calls": None, "previous_response_id": None, "prompt": None,
                "reasoning": None, "service_tier": req.service_tier or "auto",
                "status": status, "text": req.text, "top_logprobs": top,
                "truncation": "disabled", "usage": usage, "user": req.user,
                "presence_penalty": params.presence_penalty,
                "frequency_penalty": params.frequency_penalty,
                "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None,
                "input_messages": None, "output_messages": None}

    if req.stream:
        scorer = logprobs if top is not None and (show_reasoning or not think_parser) \
            else None
        return event_stream(request, _events(streams, response, len(ids), resp_id, t0,
                                             grammar_field, scorer, answer_calls(), thinker(),
                                             show_reasoning))

    cached: dict = {}
    counted = thinker()

    def count(c) -> None:
        counted.feed(c.text, c.token_ids, c.finish_reason is not None)
    extra: dict = {}        # a PD producer's offer (kv_transfer_params)
    choices, _ = await collect_choices(request, streams, 1, extra=extra,
                                       grammar_field=grammar_field, cached=cached,
                                       watch=count if counted else None)
    ch = choices[0]
    log_request(resp_id, len(ids), ch["ids"], t0)
    status = "incomplete" if ch["finish"] == "length" else "completed"

    def build() -> dict:
        # vLLM's: the message's logprobs are the whole output's, unless that shows the
        # reasoning it leaves out
        scored = logprobs(ch["lp"]) if top is not None and (
            show_reasoning or not think_parser) else None
        thought, text = (reasoning.split(ch["text"], think_parser, thinking, ch["token_ids"],
                                         engine.tokenizer)
                         if think_parser else (None, ch["text"]))
        reasoned = [reasoning_item(f"rs_{uuid.uuid4().hex}", thought, None)] \
            if thought and show_reasoning else []
        if not tools and not think_parser:
            output = [message(f"msg_{uuid.uuid4().hex}", text, "completed", scored)]
        else:   # as the chat route reads them: the message, if any, then the calls
            content, calls, _ = tool_calls.message_calls(text or "", choice,
                                                         args.tool_call_parser) \
                if tools else (text, [], False)
            items = OutputItems()
            if content:
                items.content(content, scored)
            for i, call in enumerate(calls):
                items.call({"index": i, **call})
            items.close()
            output = reasoned + items.done
        return response(status, output, _usage(len(ids), ch["ids"], cached.get(0, 0),
                                               counted.tokens if counted else 0),
                        extra.get("kv_transfer_params"))
    return await json_answer(build)


def _event(kind: str, number: int, **fields) -> bytes:
    """One server-sent event of the Responses API: its type named twice, as vLLM sends it."""
    body = json.dumps({"type": kind, "sequence_number": number, **fields},
                      ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n".encode()


async def _events(streams, response, prompt_tokens: int, resp_id: str, t0: float,
                  grammar_field: Optional[str], logprobs, calls, thinker, show_reasoning):
    """The streamed answer: vLLM's events, numbered from 0. ``logprobs``: makes the output
    text's logprobs of engine entries, when asked for; ``thinker``: splits the reasoning off
    first (a ``reasoning.Thoughts``, None without a reasoning parser), which is streamed
    when ``show_reasoning``; ``calls``: reads function calls out of the rest (a
    ``tool_calls.ChoiceStream``), None without tools. Closing it (a client gone) aborts the
    request."""
    seq = iter(range(1 << 62))
    begun = response("in_progress", [], None)
    yield _event("response.created", next(seq), response=begun)
    yield _event("response.in_progress", next(seq), response=begun)
    items = OutputItems()
    tokens, cached, finish = 0, 0, None
    pending = calls.start() if calls is not None else []
    merged = merge_streams(streams)
    try:
        async for _, out in merged:
            if out.error:
                raise grammar_named(output_error(out.error), grammar_field)
            if out.num_cached_tokens is not None:
                cached = out.num_cached_tokens
            for c in out.outputs:
                tokens += len(c.token_ids)
                finish = c.finish_reason or finish
                lp = logprobs(c.logprobs) if logprobs is not None and c.logprobs else []
                text = c.text
                if thinker is not None:
                    thought, text = thinker.feed(text, c.token_ids, c.finish_reason is not None)
                    if thought and show_reasoning:
                        for kind, fields in items.reasoning(thought):
                            yield _event(kind, next(seq), **fields)
                if calls is None:
                    deltas = [{"content": text}] if text else []
                else:
                    deltas = pending + calls.feed(text)
                    pending = []
                    if c.finish_reason is not None:
                        deltas += calls.finish()[0]
                for delta in deltas:
                    if delta.get("content"):
                        for kind, fields in items.content(delta["content"], lp):
                            yield _event(kind, next(seq), **fields)
                        lp = []
                    for call in delta.get("tool_calls") or ():
                        for kind, fields in items.call(call):
                            yield _event(kind, next(seq), **fields)
    except HTTPError as e:
        yield _event("error", next(seq), error={"message": e.message, "type": e.kind,
                                                "param": e.param, "code": e.status})
        return
    finally:
        await merged.aclose()
        log_request(resp_id, prompt_tokens, tokens, t0)
    for kind, fields in items.close():
        yield _event(kind, next(seq), **fields)
    status = "incomplete" if finish == "length" else "completed"
    yield _event("response.completed", next(seq),
                 response=response(status, items.done, _usage(
                     prompt_tokens, tokens, cached, thinker.tokens if thinker else 0)))
