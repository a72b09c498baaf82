"""POST /v1/embeddings: OpenAI's embeddings API on a pooling runner (``--runner pooling``),
as vLLM serves it: one embedding per input (a string, a list of strings, a list of token ids
or a list of such lists), as floats or as base64 of little-endian float32 values. The
helpers the other pooling routes share (classify_routes, score_routes) are here too: the
inputs, their truncation, and running the prompts to their pooled outputs."""
from __future__ import annotations

import base64
import time
from typing import Optional

import numpy as np
from fastapi import APIRouter, Request

from llm_serving.entrypoints.http_common import (HTTPError, new_request_id, request_trace,
                                                 server_state, stream_or_disconnect,
                                                 translate_error)
from llm_serving.entrypoints.openai_protocol import EmbeddingRequest
from llm_serving.inputs import with_cache_salt
from llm_serving.entrypoints.openai_routes import (check_fields, check_tokenizer,
                                                   json_answer, merge_streams, prompt_ids,
                                                   render_chat)
from llm_serving.model_executor.layers.pooler import served_routes
from llm_serving.pooling_params import PoolingParams

router = APIRouter()


def pooling_engine(req, request: Request, route: str, serves, what: str):
    """(server state, engine, pooler) of a pooling route's request, its fields checked; a
    404 unless the model serves ``route`` (``serves(pooler)``), saying what does (``what``:
    the model kind the route needs)."""
    state = server_state(request)
    state.check_model(req.model)
    check_fields(req)
    engine = state.require_engine()
    pooler = engine.limits.pooler
    if pooler is None:
        raise HTTPError(404, f"this model is a generative model: {route} needs {what} served "
                        "with --runner pooling", kind="not_found_error")
    if not serves(pooler):
        raise HTTPError(404, f"{route} needs {what}; this model serves "
                        f"{served_routes(pooler)}", kind="not_found_error")
    return state, engine, pooler


def prompt_token_lists(state, engine, req) -> tuple[str, list]:
    """The request's field its prompts come from ("input", or "messages" for vLLM's chat
    form) and each prompt's token ids: a conversation (in messages, or in input on
    /v1/embeddings) is rendered by the chat template as the chat route renders it, without
    the generation prompt unless asked (vLLM's pooling default)."""
    if req.messages is not None and req.input is not None:
        raise HTTPError(400, "messages: give input or messages, not both", param="messages")
    conversations = req.conversations()
    if not conversations:
        if req.messages is not None:
            raise HTTPError(400, "messages: must not be empty", param="messages")
        return "input", [_tokens(engine, req, p) for p in _inputs(req)]
    field = "messages" if req.messages is not None else "input"
    if not all(conversations):
        raise HTTPError(400, f"{field}: every conversation needs at least one message",
                        param=field)
    check_bound(engine, len(conversations), field)
    check_tokenizer(engine, field)
    texts = [render_chat(state, engine.tokenizer, c, req.add_generation_prompt,
                         req.continue_final_message, req.chat_template,
                         req.chat_template_kwargs) for c in conversations]
    return field, [_tokens(engine, req, t, bool(req.add_special_tokens), field) for t in texts]


def _inputs(req) -> list:
    """The request's prompts, one per input."""
    x = req.input
    if x is None:
        raise HTTPError(400, "input: Field required", param="input")
    if isinstance(x, str) or (isinstance(x, list) and x and isinstance(x[0], int)):
        x = [x]
    if not x:
        raise HTTPError(400, "input: must not be empty", param="input")
    return x


def _tokens(engine, req, prompt, add_special_tokens: Optional[bool] = None,
            field: str = "input") -> list[int]:
    """A prompt's token ids, truncated as truncate_prompt_tokens asks (vLLM: -1 is the model's
    length; the tokenizer's side, right unless it says left, unless truncation_side)."""
    side = req.truncation_side or getattr(engine.tokenizer, "truncation_side", "right")
    if add_special_tokens is None:
        add_special_tokens = getattr(req, "add_special_tokens", None) is not False
    return prompt_ids(engine, prompt, field, add_special_tokens,
                      req.truncate_prompt_tokens, side, engine.limits.max_model_len)


def truncate(engine, req, ids: list[int]) -> list[int]:
    """Token ids (a scored pair's encoding) truncated as a prompt's are."""
    return _tokens(engine, req, ids, add_special_tokens=True)


def check_bound(engine, n: int, field: str) -> None:
    """A 400 naming ``field`` when its ``n`` prompts are more than the waiting queue holds."""
    if n > engine.limits.max_waiting:
        raise HTTPError(400, f"{field}: {n} inputs in one request exceed the waiting-queue "
                        f"bound (max_waiting_requests={engine.limits.max_waiting})", param=field)


async def run_pooled(request: Request, engine, rid: str, token_lists: list, params,
                     priority: int, field: str = "input",
                     cache_salt: Optional[str] = None) -> list:
    """Each prompt's finished output (RequestOutput: its ``embedding`` vector, its prompt
    ids), the prompts queued all or none; a client that leaves aborts them (499).
    ``cache_salt``: the prompts' (vLLM's field)."""
    check_bound(engine, len(token_lists), field)
    try:
        prompts = with_cache_salt([{"prompt_token_ids": ids} for ids in token_lists],
                                  cache_salt)
        news = [await engine.check_request(f"{rid}-{i}", prompt, params, priority)
                for i, prompt in enumerate(prompts)]
    except HTTPError:
        raise
    except Exception as e:
        raise _named(translate_error(e), field) from None
    streams = []
    try:
        trace = request_trace(request)
        for new in news:
            streams.append(engine.queue(new, trace_headers=trace))
    except Exception as e:
        for s in streams:
            await s.aclose()
        raise translate_error(e) from None
    outs: list = [None] * len(token_lists)
    async for i, out in stream_or_disconnect(request, merge_streams(streams)):
        if out.finished:
            if out.error is not None or out.embedding is None:
                raise HTTPError(500, out.error or "the request ended without its pooled output",
                                kind="internal_server_error")
            outs[i] = out
    if any(o is None for o in outs):     # the client left: its requests were aborted
        raise HTTPError(499, "the client closed the connection")
    return outs


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request):
    state, engine, _ = pooling_engine(req, request, "/v1/embeddings",
                                      lambda p: p.task == "embed", "an embedding model")
    field, token_lists = prompt_token_lists(state, engine, req)
    try:
        params = PoolingParams(req.dimensions, req.use_activation)
    except ValueError as e:
        raise translate_error(e) from None
    rid = new_request_id("embd")
    outs = await run_pooled(request, engine, rid, token_lists, params, req.priority, field,
                            cache_salt=req.cache_salt)
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    as_b64 = req.encoding_format == "base64"

    def build() -> dict:
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(np.asarray(o.embedding, "<f4").tobytes())
                               .decode() if as_b64 else o.embedding)}
                for i, o in enumerate(outs)]
        return {"id": rid, "object": "list", "created": int(time.time()),
                "model": state.served_model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0}}
    return await json_answer(build)


def _named(err: HTTPError, field: str) -> HTTPError:
    """The engine's checks name their field by its engine name: the request's is ``field``."""
    if err.status == 400 and err.param in ("prompt", "prompt_token_ids"):
        err.param = field
        err.message = field + err.message[len("prompt"):] if err.message.startswith(
            "prompt") else err.message
    return err
