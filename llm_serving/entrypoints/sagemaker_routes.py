"""POST /invocations (vLLM's SageMaker entry point): one route for every task the model
serves, the request's shape choosing the handler as vLLM's order does: on a generative model
chat (``messages``), then completions (``prompt``); on a pooling model embeddings or
classification (``input``), then rerank (``query`` and ``documents``), then score (a pair of
vLLM's score fields). A body that fits none is a 400 naming what the route expects."""
from __future__ import annotations

import json

import pydantic
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError

from llm_serving.entrypoints import classify_routes, embedding_routes, openai_routes, score_routes
from llm_serving.entrypoints.http_common import HTTPError, server_state
from llm_serving.entrypoints.openai_protocol import (ChatCompletionRequest,
                                                     ClassificationRequest, CompletionRequest,
                                                     EmbeddingRequest, RerankRequest,
                                                     ScoreRequest)

router = APIRouter()

_SCORE_KEYS = {k for pair in ScoreRequest.PAIRS for k in pair}


def _holds(*keys):
    return lambda body: all(k in body for k in keys)


def _handlers(engine) -> list:
    """(whether a body is of the kind, its request model, its handler), in vLLM's order."""
    pooler = engine.limits.pooler
    if pooler is None:
        return [(_holds("messages"), ChatCompletionRequest, openai_routes.chat_completions),
                (_holds("prompt"), CompletionRequest, openai_routes.completions)]
    if pooler.task == "embed":
        first = [(_holds("input"), EmbeddingRequest, embedding_routes.embeddings)]
    else:
        first = [(_holds("input"), ClassificationRequest, classify_routes.classify)]
    if pooler.task == "classify" and pooler.num_labels != 1:
        return first
    return first + [(_holds("query", "documents"), RerankRequest, score_routes.rerank),
                    (lambda body: not _SCORE_KEYS.isdisjoint(body), ScoreRequest,
                     score_routes.score)]


@router.post("/invocations")
async def invocations(request: Request):
    engine = server_state(request).require_engine()
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}", param="body") from None
    handlers = _handlers(engine)
    if isinstance(body, dict):
        for fits, model, handler in handlers:
            if fits(body):
                try:
                    req = model.model_validate(body)
                except pydantic.ValidationError as e:
                    raise RequestValidationError(
                        [{**err, "loc": ("body", *err["loc"])} for err in e.errors()],
                        body=body) from None
                return await handler(req, request)
    names = [model.__name__ for _, model, _ in handlers]
    raise HTTPError(400, f"no route of this model takes this body: /invocations expects one "
                    f"of {', '.join(names)}", param="body")
