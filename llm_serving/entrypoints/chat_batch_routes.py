"""POST /v1/chat/completions/batch (vLLM 0.32's): several conversations in one request, each
run as its own chat completion at once and answered as one choice (index i for conversation
i) of a single chat.completion, the usage summed. No streaming, tools, beam search or n > 1,
as vLLM."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request

from llm_serving.entrypoints.http_common import HTTPError, request_ids, server_state
from llm_serving.entrypoints.openai_protocol import BatchChatCompletionRequest
from llm_serving.entrypoints.openai_routes import chat_completions, check_fields, json_answer

router = APIRouter()


@router.post("/v1/chat/completions/batch")
async def batch_chat_completions(req: BatchChatCompletionRequest, request: Request):
    state = server_state(request)
    state.check_model(req.model)
    check_fields(req)
    if req.prompt_logprobs is not None:     # vLLM's batch answer has no place for them
        raise HTTPError(400, "prompt_logprobs: not answered by the batch route (its answer "
                        "is one choice per conversation; ask /v1/chat/completions)",
                        param="prompt_logprobs")
    bound = state.require_engine().limits.max_waiting
    if len(req.messages) > bound:
        raise HTTPError(400, f"messages: {len(req.messages)} conversations in one request "
                        f"exceed the waiting-queue bound (max_waiting_requests={bound})",
                        param="messages")
    tasks = [asyncio.ensure_future(chat_completions(req.conversation(i), request))
             for i in range(len(req.messages))]
    try:
        answers = [json.loads(r.body) for r in await asyncio.gather(*tasks)]
    finally:
        for t in tasks:          # one failed: the others' requests are aborted
            t.cancel()
    _, resp_id = request_ids(request, "chatcmpl", req.request_id)

    def build() -> dict:
        first = answers[0]
        usage = {k: sum(a["usage"][k] for a in answers)
                 for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        if "prompt_tokens_details" in first["usage"]:     # --enable-prompt-tokens-details
            usage["prompt_tokens_details"] = {"cached_tokens": sum(
                a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)}
        choices = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
        # vLLM's batch answer: a conversation's own top-level fields (prompt_logprobs,
        # prompt_token_ids, metrics, ...) are not the batch's
        return {"id": resp_id, "object": first["object"], "created": first["created"],
                "model": first["model"], "choices": choices, "usage": usage}
    return await json_answer(build)
