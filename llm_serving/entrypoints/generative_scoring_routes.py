"""POST /generative_scoring (vLLM 0.32's): how likely a generative model finds each item's
answer. Every item is joined to the query (after it, or before it with ``item_first``) and
generates one token with the labels as its ``logprob_token_ids``; an item's score is the
first label's probability, normalized over the labels (``apply_softmax``, the default) or
over the whole vocabulary."""
from __future__ import annotations

import math
import time

from fastapi import APIRouter, Request

from llm_serving.inputs import with_cache_salt
from llm_serving.entrypoints.http_common import HTTPError, request_ids, server_state
from llm_serving.entrypoints.openai_protocol import GenerativeScoringRequest
from llm_serving.entrypoints.openai_routes import (check_fields, collect_choices, json_answer,
                                                   prompt_ids, start_requests)
from llm_serving.sampling_params import RequestOutputKind, SamplingParams

router = APIRouter()


def label_probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """The labels' probabilities: a softmax over their logprobs, or each one's own."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


@router.post("/generative_scoring")
async def generative_scoring(req: GenerativeScoringRequest, request: Request):
    state = server_state(request)
    lora = state.check_model(req.model)
    check_fields(req)
    engine = state.require_engine()
    vocab = engine.limits.vocab_size
    if any(not 0 <= t < vocab for t in req.label_token_ids):
        raise HTTPError(400, f"label_token_ids: token ids are in [0, {vocab})",
                        param="label_token_ids")
    query = prompt_ids(engine, req.query, "query", req.add_special_tokens)
    longest = engine.limits.max_model_len - 1        # a token left for the one generated
    prompts = []
    for item in req.items:
        ids = prompt_ids(engine, item, "items", add_special_tokens=False)
        joined = ids + query if req.item_first else query + ids
        prompts.append({"prompt_token_ids": joined[:longest]})
    prompts = with_cache_salt(prompts, req.cache_salt)
    params = SamplingParams(temperature=0.0, max_tokens=1,
                            logprob_token_ids=list(req.label_token_ids),
                            output_kind=RequestOutputKind.DELTA)
    rid, resp_id = request_ids(request, "generative-scoring", req.request_id)
    try:
        streams = await start_requests(request, rid, resp_id, prompts, params, req.priority,
                                       lora=lora)
    except HTTPError as e:            # the labels are asked for as logprob_token_ids
        if e.param != "logprob_token_ids":
            raise
        raise HTTPError(e.status, e.message.replace("logprob_token_ids", "label_token_ids"),
                        param="label_token_ids") from None
    choices, prompt_tokens = await collect_choices(request, streams, 1)
    created, model = int(time.time()), state.model_name(lora)

    def build() -> dict:
        data = []
        for i in range(len(prompts)):
            entry = choices[i]["lp"][0]
            probs = label_probabilities([entry[t].logprob for t in req.label_token_ids],
                                        req.apply_softmax)
            data.append({"index": i, "object": "score", "score": probs[0]})
        completion = sum(ch["ids"] for ch in choices.values())
        return {"id": resp_id, "object": "list", "created": created, "model": model,
                "data": data, "usage": {"prompt_tokens": prompt_tokens,
                                        "completion_tokens": completion,
                                        "total_tokens": prompt_tokens + completion}}
    return await json_answer(build)
