"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, plus vLLM's
/tokenize and /detokenize. Streaming is SSE (``data: {...}`` lines, then ``data: [DONE]``)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from llm_serving.entrypoints.api_server import (HTTPError, ServerState, log_request,
                                                new_request_id, stream_or_disconnect,
                                                translate_error)
from llm_serving.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                     DetokenizeRequest, TokenizeRequest)
from llm_serving.outputs import RequestOutput

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _finish_reason(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else ("length" if reason == "length" else "stop")


async def _start(state: ServerState, rid: str, prompts: list, params, priority: int):
    """Queue one engine request per prompt; all or none."""
    engine = state.require_engine()
    bound = engine.engine.scheduler.max_waiting
    if len(prompts) > bound:
        raise HTTPError(400, f"prompt: {len(prompts)} prompts in one request exceed the "
                        f"waiting-queue bound (max_waiting_requests={bound})", param="prompt")
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await engine.add_request(f"{rid}-{i}", prompt, params, priority,
                                                    strict_length=True))
    except Exception as e:
        for s in streams:
            await s.aclose()
        raise translate_error(e) from None
    return streams


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all the streams as they come; closing it aborts them."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as e:   # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
        await queue.put((i, None, None))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            i, out, err = await queue.get()
            if err is not None:
                raise translate_error(err)
            if out is None:
                open_streams -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def _collect(request: Request, streams, n: int) -> tuple[dict, int]:
    """The whole of every completion, for non-streaming answers: choice index (prompt * n +
    completion) -> {"text", "ids" (count), "lp" (logprob entries), "finish"}, and the prompt
    tokens. A client that leaves first aborts the requests (HTTPError 499)."""
    choices: dict[int, dict] = {}
    prompt_tokens: dict[int, int] = {}
    async for i, out in stream_or_disconnect(request, _merge(streams)):
        if out.error:
            raise HTTPError(503, out.error, kind="service_unavailable")
        prompt_tokens[i] = len(out.prompt_token_ids)
        for c in out.outputs:
            ch = choices.setdefault(i * n + c.index, {"text": [], "ids": 0, "lp": [],
                                                      "finish": None})
            ch["text"].append(c.text)
            ch["ids"] += len(c.token_ids)
            if c.logprobs:
                ch["lp"].extend(c.logprobs)
            ch["finish"] = c.finish_reason
    if len(choices) < len(streams) * n:
        raise HTTPError(499, "the client closed the connection")
    for ch in choices.values():
        ch["text"] = "".join(ch["text"])
    return dict(sorted(choices.items())), sum(prompt_tokens.values())


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# ---- completions -------------------------------------------------------------------------

def _completion_logprobs(entries, text_offset: int, k: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        lp = next(iter(entry.values()))          # the chosen token comes first
        text = lp.decoded_token or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(dict(_top(entry, k)))
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    state = _state(request)
    state.check_model(req.model)
    if req.echo or req.suffix:
        raise HTTPError(400, "echo and suffix are not supported", param="echo")
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise HTTPError(400, "prompt: must not be empty", param="prompt")
    prompts = [{"prompt_token_ids": x} if isinstance(x, list) else x for x in p]
    try:
        params = req.sampling_params(req.max_tokens, req.logprobs)
    except ValueError as e:
        raise translate_error(e) from None
    rid = new_request_id("cmpl")
    streams = await _start(state, rid, prompts, params, req.priority)
    created, model = int(time.time()), state.served_model_name
    n = req.n
    t0 = time.perf_counter()

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def gen():
            prompt_tokens, completion_tokens = {}, 0
            offsets = {}
            try:
                async for i, out in _merge(streams):
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    if out.error:
                        yield _sse({"error": {"message": out.error, "type": "service_unavailable",
                                              "code": 503}})
                        continue
                    for c in out.outputs:
                        if not c.text and not c.token_ids and c.finish_reason is None:
                            continue
                        idx = i * n + c.index
                        completion_tokens += len(c.token_ids)
                        lp = None
                        if c.logprobs is not None:
                            lp = _completion_logprobs(c.logprobs, offsets.get(idx, 0),
                                                      req.logprobs)
                        offsets[idx] = offsets.get(idx, 0) + len(c.text)
                        chunk = {"id": rid, "object": "text_completion", "created": created,
                                 "model": model,
                                 "choices": [{"index": idx, "text": c.text, "logprobs": lp,
                                              "finish_reason": _finish_reason(c.finish_reason)}]}
                        if include_usage:
                            chunk["usage"] = None
                        yield _sse(chunk)
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created,
                                "model": model, "choices": [],
                                "usage": _usage(sum(prompt_tokens.values()), completion_tokens)})
                yield b"data: [DONE]\n\n"
            except HTTPError as e:
                yield _sse({"error": {"message": e.message, "type": e.kind, "code": e.status}})
            finally:
                log_request(rid, sum(prompt_tokens.values()), completion_tokens, t0)
        return StreamingResponse(gen(), media_type="text/event-stream")

    choices, prompt_tokens = await _collect(request, streams, n)
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": idx, "text": ch["text"],
                         "logprobs": (_completion_logprobs(ch["lp"], 0, req.logprobs)
                                      if req.logprobs is not None else None),
                         "finish_reason": _finish_reason(ch["finish"])}
                        for idx, ch in choices.items()],
            "usage": _usage(prompt_tokens, sum(ch["ids"] for ch in choices.values()))}
    log_request(rid, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"], t0)
    return body


# ---- chat --------------------------------------------------------------------------------

def _top(entry: dict, k: int) -> list:
    """The k most likely of a token's (text, logprob): the chosen token plus the top-k."""
    ranked = sorted(entry.values(), key=lambda v: -v.logprob)[:k]
    return [(v.decoded_token or "", v.logprob) for v in ranked]


def _chat_logprobs(entries, top: int) -> dict:
    content = []
    for entry in entries:
        lp = next(iter(entry.values()))          # the chosen token comes first
        text = lp.decoded_token or ""
        content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in _top(entry, top)]})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = _state(request)
    state.check_model(req.model)
    engine = state.require_engine()
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt,
            chat_template=req.chat_template or state.chat_template)
    except ValueError as e:
        raise translate_error(e) from None
    except Exception as e:   # noqa: BLE001 - a template error is the request's fault
        raise HTTPError(400, f"messages: the chat template failed: {e}", param="messages")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    top = req.top_logprobs or 0
    try:
        params = req.sampling_params(max_tokens, top if req.logprobs else None)
    except ValueError as e:
        raise translate_error(e) from None
    rid = new_request_id("chatcmpl")
    streams = await _start(state, rid, [{"prompt": text, "prompt_token_ids": ids}], params,
                           req.priority)
    created, model = int(time.time()), state.served_model_name
    t0 = time.perf_counter()

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(idx, delta, finish=None, lp=None):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created,
                 "model": model, "choices": [{"index": idx, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        async def gen():
            completion_tokens, prompt_tokens = 0, len(ids)
            started = set()
            try:
                async for _, out in _merge(streams):
                    if out.error:
                        yield _sse({"error": {"message": out.error, "type": "service_unavailable",
                                              "code": 503}})
                        continue
                    for c in out.outputs:
                        if c.index not in started:
                            started.add(c.index)
                            yield chunk(c.index, {"role": "assistant", "content": ""})
                        completion_tokens += len(c.token_ids)
                        lp = _chat_logprobs(c.logprobs, top) if c.logprobs else None
                        if c.text or lp:
                            yield chunk(c.index, {"content": c.text}, None, lp)
                        if c.finish_reason is not None:
                            yield chunk(c.index, {}, _finish_reason(c.finish_reason))
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": _usage(prompt_tokens, completion_tokens)})
                yield b"data: [DONE]\n\n"
            except HTTPError as e:
                yield _sse({"error": {"message": e.message, "type": e.kind, "code": e.status}})
            finally:
                log_request(rid, prompt_tokens, completion_tokens, t0)
        return StreamingResponse(gen(), media_type="text/event-stream")

    choices, _ = await _collect(request, streams, req.n)
    completion_tokens = sum(ch["ids"] for ch in choices.values())
    log_request(rid, len(ids), completion_tokens, t0)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": idx,
                         "message": {"role": "assistant", "content": ch["text"]},
                         "logprobs": _chat_logprobs(ch["lp"], top) if req.logprobs else None,
                         "finish_reason": _finish_reason(ch["finish"])}
                        for idx, ch in choices.items()],
            "usage": _usage(len(ids), completion_tokens)}


# ---- models, tokenizer -------------------------------------------------------------------

@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    engine = state.engine
    max_len = engine.engine.max_model_len if engine is not None else None
    return {"object": "list", "data": [{"id": state.served_model_name, "object": "model",
                                        "created": int(state.started), "owned_by": "llm_serving",
                                        "root": state.engine_args.model,
                                        "max_model_len": max_len}]}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    state = _state(request)
    state.check_model(req.model)
    engine = state.require_engine()
    tok = engine.tokenizer
    if req.messages is not None:
        text = tok.apply_chat_template([{"role": m.role, "content": m.text()}
                                        for m in req.messages],
                                       add_generation_prompt=True,
                                       chat_template=state.chat_template)
        ids = tok.encode(text, add_special_tokens=False)
    elif req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise HTTPError(400, "prompt: give a prompt or messages", param="prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    state = _state(request)
    state.check_model(req.model)
    engine = state.require_engine()
    vocab = engine.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise HTTPError(400, f"tokens: ids must be in [0, {vocab}), got {bad[0]}",
                        param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}
