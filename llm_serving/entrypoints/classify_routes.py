"""POST /classify: a sequence classifier's class probabilities (vLLM's classification API on
a pooling runner): one entry per input (a string, a list of strings, token ids or a list of
such lists), or one for vLLM's chat form (messages: a conversation the chat template renders) with its probs (softmax over the labels, sigmoid for one label; the raw logits
with use_activation false), the most likely label's name from config.json's id2label, and
num_classes."""
from __future__ import annotations

import time

import numpy as np
from fastapi import APIRouter, Request

from llm_serving.entrypoints.embedding_routes import (pooling_engine, prompt_token_lists,
                                                      run_pooled)
from llm_serving.entrypoints.http_common import new_request_id, translate_error
from llm_serving.entrypoints.openai_protocol import ClassificationRequest
from llm_serving.entrypoints.openai_routes import json_answer
from llm_serving.pooling_params import PoolingParams

router = APIRouter()


@router.post("/classify")
async def classify(req: ClassificationRequest, request: Request):
    state, engine, pooler = pooling_engine(req, request, "/classify",
                                           lambda p: p.task == "classify",
                                           "a sequence classifier (*ForSequenceClassification)")
    field, token_lists = prompt_token_lists(state, engine, req)
    try:
        params = PoolingParams(use_activation=req.use_activation, task="classify")
    except ValueError as e:
        raise translate_error(e) from None
    rid = new_request_id("classify")
    outs = await run_pooled(request, engine, rid, token_lists, params, req.priority, field,
                            cache_salt=req.cache_salt)
    id2label = pooler.id2label or {}
    tokens = sum(len(o.prompt_token_ids) for o in outs)

    def build() -> dict:
        data = [{"index": i, "label": id2label.get(int(np.argmax(o.embedding))),
                 "probs": o.embedding, "num_classes": len(o.embedding)}
                for i, o in enumerate(outs)]
        return {"id": rid, "object": "list", "created": int(time.time()),
                "model": state.served_model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None,
                          "completion_tokens_details": None}}
    return await json_answer(build)
