"""POST /score (and /v1/score) and /rerank (and /v1/rerank, /v2/rerank): vLLM's scoring
APIs on a pooling runner (entrypoints/scoring.py: how a pair is scored). /score answers one
score per pair, 1:1, 1:N or N:N; /rerank scores one query against documents and answers them
by relevance, best first (Jina's and Cohere's form, as vLLM), the top_n first when set.
Served on a cross-encoder (a sequence classifier of one label) and on an embedding model."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request

from llm_serving.entrypoints.embedding_routes import pooling_engine, run_pooled, truncate
from llm_serving.entrypoints.http_common import new_request_id, server_state, translate_error
from llm_serving.entrypoints.openai_protocol import RerankRequest, ScoreRequest
from llm_serving.entrypoints.openai_routes import json_answer
from llm_serving.entrypoints.scoring import (cosine, cross_encoder_prompt, pair_indices,
                                             score_texts)
from llm_serving.pooling_params import PoolingParams

router = APIRouter()


async def _scores(req, request: Request, route: str):
    """(the scores of the request's pairs, their prompt tokens, the response id, the
    second side's texts)."""
    _, engine, pooler = pooling_engine(req, request, route,
                                       lambda p: p.task == "embed" or p.num_labels == 1,
                                       "a cross-encoder (a sequence classifier of one label) "
                                       "or an embedding model")
    try:
        first, second, names = req.pair()
        first, second = score_texts(first, second, names)
        params = PoolingParams(use_activation=req.use_activation, task=pooler.task)
    except ValueError as e:
        raise translate_error(e) from None
    pairs = pair_indices(len(first), len(second))
    rid = new_request_id("score")
    tok = engine.tokenizer
    if pooler.task == "classify":
        template = server_state(request).chat_template      # --chat-template, as vLLM's
        try:
            prompts = [truncate(engine, req, cross_encoder_prompt(
                tok, pooler, first[i], second[j], chat_template=template)) for i, j in pairs]
        except ValueError as e:
            raise translate_error(e) from None
    else:           # a bi-encoder: each text once
        prompts = [truncate(engine, req, tok.encode(t)) for t in first + second]
    outs = await run_pooled(request, engine, rid, prompts, params, req.priority, names[0],
                            cache_salt=req.cache_salt)
    if pooler.task == "classify":
        scores = [o.embedding[0] for o in outs]
    else:
        scores = [cosine(outs[i].embedding, outs[len(first) + j].embedding) for i, j in pairs]
    return scores, sum(len(o.prompt_token_ids) for o in outs), rid, second


@router.post("/score")
@router.post("/v1/score")
async def score(req: ScoreRequest, request: Request):
    scores, tokens, rid, _ = await _scores(req, request, request.url.path)
    model = server_state(request).served_model_name

    def build() -> dict:
        return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None,
                          "completion_tokens_details": None}}
    return await json_answer(build)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(req: RerankRequest, request: Request):
    scores, tokens, rid, documents = await _scores(req, request, request.url.path)
    model = server_state(request).served_model_name
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if 0 < req.top_n < len(order):
        order = order[:req.top_n]

    def build() -> dict:
        return {"id": rid, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": [{"index": i, "document": {"text": documents[i], "multi_modal": None},
                             "relevance_score": scores[i]} for i in order]}
    return await json_answer(build)
