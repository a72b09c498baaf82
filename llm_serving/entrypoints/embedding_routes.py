"""POST /v1/embeddings: OpenAI's embeddings API on a pooling runner (``--runner pooling``),
as vLLM serves it: one embedding per input (a string, a list of strings, a list of token ids
or a list of such lists), as floats or as base64 of little-endian float32 values."""
from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import APIRouter, Request

from llm_serving.entrypoints.http_common import (HTTPError, new_request_id, server_state,
                                                 stream_or_disconnect, translate_error)
from llm_serving.entrypoints.openai_protocol import EmbeddingRequest
from llm_serving.entrypoints.openai_routes import (check_fields, json_answer, merge_streams,
                                                   prompt_ids)
from llm_serving.pooling_params import PoolingParams

router = APIRouter()


def _inputs(req: EmbeddingRequest) -> list:
    """The request's prompts, one per input."""
    x = req.input
    if x is None:
        raise HTTPError(400, "input: Field required", param="input")
    if isinstance(x, str) or (isinstance(x, list) and x and isinstance(x[0], int)):
        x = [x]
    if not x:
        raise HTTPError(400, "input: must not be empty", param="input")
    return x


def _tokens(engine, req: EmbeddingRequest, prompt) -> list[int]:
    """A prompt's token ids, truncated as truncate_prompt_tokens asks (vLLM: -1 is the model's
    length; the tokenizer's side, right unless it says left, unless truncation_side)."""
    side = req.truncation_side or getattr(engine.tokenizer, "truncation_side", "right")
    return prompt_ids(engine, prompt, "input", req.add_special_tokens,
                      req.truncate_prompt_tokens, side, engine.limits.max_model_len)


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request):
    state = server_state(request)
    state.check_model(req.model)
    check_fields(req)
    engine = state.require_engine()
    if engine.limits.pooler is None:
        raise HTTPError(404, "this model is a generative model: /v1/embeddings needs an "
                        "embedding model served with --runner pooling", kind="not_found_error")
    prompts = _inputs(req)
    if len(prompts) > engine.limits.max_waiting:
        raise HTTPError(400, f"input: {len(prompts)} inputs in one request exceed the "
                        f"waiting-queue bound (max_waiting_requests={engine.limits.max_waiting})",
                        param="input")
    try:
        params = PoolingParams(req.dimensions, req.use_activation)
    except ValueError as e:
        raise translate_error(e) from None
    rid = new_request_id("embd")
    try:
        news = [await engine.check_request(f"{rid}-{i}",
                                           {"prompt_token_ids": _tokens(engine, req, p)},
                                           params, req.priority)
                for i, p in enumerate(prompts)]
    except HTTPError:
        raise
    except Exception as e:
        raise _named(translate_error(e)) from None
    streams = []
    try:
        for new in news:
            streams.append(engine.queue(new))
    except Exception as e:
        for s in streams:
            await s.aclose()
        raise translate_error(e) from None
    vectors: list = [None] * len(prompts)
    tokens = 0
    async for i, out in stream_or_disconnect(request, merge_streams(streams)):
        if out.finished:
            if out.error is not None or out.embedding is None:
                raise HTTPError(500, out.error or "the request ended without an embedding",
                                kind="internal_server_error")
            vectors[i] = out.embedding
            tokens += len(out.prompt_token_ids)
    if any(v is None for v in vectors):     # the client left: its requests were aborted
        raise HTTPError(499, "the client closed the connection")
    as_b64 = req.encoding_format == "base64"

    def build() -> dict:
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
                               if as_b64 else v)}
                for i, v in enumerate(vectors)]
        return {"id": rid, "object": "list", "created": int(time.time()),
                "model": state.served_model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0}}
    return await json_answer(build)


def _named(err: HTTPError) -> HTTPError:
    """The engine's checks name their field by its engine name: the request's is input."""
    if err.status == 400 and err.param in ("prompt", "prompt_token_ids"):
        err.param = "input"
        err.message = "input" + err.message[len("prompt"):] if err.message.startswith(
            "prompt") else err.message
    return err
