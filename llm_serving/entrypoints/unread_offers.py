"""PD consumer: a request refused before the engine has it declines the producer's offer it
carries.

In the P-then-D order the producer has computed the prompt and holds its KV blocks for the
consumer before the consumer has looked at the request; a field only the consumer refuses
(``max_tokens: -1``, ``n: 0``: the producer got 1 and no ``n``), its own limits or a full
queue end the request with an error before the engine sees it. The error handlers then
decline the offers the request carries (``decline``), so the producer frees the blocks at
once rather than when the offer expires (``kv_transfer_timeout``). Once the engine has a
request it declines what it does not read itself (``engine/remote_kv.py``).

The routes name the offers of their request (``hold``, also after a first-D request got the
producer's answer) and say when the engine took them (``handed_over``); a body the route
never saw (refused by its schema) is read by the validation handler.

``POST /kv_transfer/decline`` takes a producer's answer (its ``kv_transfer_params``, as the
proxy got them) that no consumer will read, and declines its offers on the instance that
made them: the proxy's way out when no decode instance could take a request P has prefilled.
The offers' random tokens are what allow it, as for a consumer's decline.
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import APIRouter, Request

from llm_serving.distributed.kv_transfer.config import KVTransferConfig
from llm_serving.entrypoints.http_common import HTTPError, ServerState

from llm_serving.proxy import pd_request as pd

logger = logging.getLogger("llm_serving.server")
router = APIRouter()


def offers_in(params) -> list:
    """The offers of a request's ``kv_transfer_params``: the producer's answer for one
    prompt, or each prompt's (``pd_request.per_prompt_offers``); none for anything else."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return []
    items = params.get(pd.PROMPTS_KEY, [params])
    if not isinstance(items, list):
        return []
    return [p for p in items if isinstance(p, dict) and p.get("transfer_id")]


def hold(request: Request, params) -> None:
    """The request's kv_transfer_params, not handed to the engine yet."""
    request.state.kv_offers = offers_in(params)


def handed_over(request: Request, unread: Optional[list] = None) -> None:
    """The engine has the request (``unread``: the kv_transfer_params of prompts it never
    got)."""
    request.state.kv_offers = [o for params in unread or () for o in offers_in(params)]


def decline(request: Request, body=None) -> None:
    """The request ends with an error: decline the offers the engine never got. ``body``:
    the parsed body of a request the route never saw (a schema error)."""
    offers = getattr(request.state, "kv_offers", None)
    if offers is None:
        if not isinstance(body, dict) or not pd.is_generation_route(request.url.path):
            return
        offers = offers_in(pd.kv_params(request.url.path, body))
    if not offers:
        return
    request.state.kv_offers = []
    engine = request.app.state.server.engine
    if engine is not None and engine.is_running:
        engine.decline_kv_offers(offers)
        logger.info("declined %d KV offer(s) of a refused request", len(offers))


@router.post("/kv_transfer/decline")
async def decline_route(request: Request):
    """Decline the offers of a producer's ``kv_transfer_params`` (the body); 200 with how
    many."""
    state: ServerState = request.app.state.server
    if KVTransferConfig.from_dict(state.engine_args.kv_transfer_config) is None:
        raise HTTPError(400, "kv_transfer_params: this instance has no KV transfer configured",
                        param=pd.KV_FIELD)
    try:
        body = await request.json()
    except ValueError:
        raise HTTPError(400, "body: expected a producer's kv_transfer_params (JSON)",
                        param="body") from None
    offers = offers_in(body)
    if not offers:
        raise HTTPError(400, "kv_transfer_params: expected a producer's answer (do_remote_prefill "
                        "and a transfer_id, or one per prompt)", param=pd.KV_FIELD)
    state.require_engine().decline_kv_offers(offers)
    logger.info("declined %d KV offer(s) no consumer took", len(offers))
    return {"declined": len(offers)}
