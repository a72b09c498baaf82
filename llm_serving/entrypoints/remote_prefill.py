"""First D, then P (seed 001 §6.3): a consumer's server asks the producer itself.

A request to a consumer (``kv_role`` kv_consumer or kv_both) whose ``kv_transfer_params``
are ``{"do_remote_prefill": true, "remote_prefill_url": "http://P-host:port"}`` (no producer
parameters yet) is first sent to P as the proxy would send it (the same route and body, max
tokens 1, ``do_remote_decode``; ``llm_serving/proxy/pd_request.py``), within
``kv_transfer_timeout``. P's answer carries the producer's ``kv_transfer_params``; they
replace the request's, and the engine loads the KV as in the P-then-D order.

If P cannot be reached, fails, answers an error or without parameters, or takes longer than
the timeout, ``kv_failure_policy`` decides: ``recompute`` (the request is computed here,
logged and counted in /metrics as a failed transfer and a recompute) or ``fail`` (503
naming kv_transfer_params). A client that disconnects meanwhile closes the request to P,
which aborts it (or declines the offer it made as the client left); one that is gone once P
has answered is not queued, and its offer is declined (unread_offers), so P frees the blocks
at once.

Only ``http``/``https`` URLs are followed. The routes call ``resolve`` once the engine has
checked the request (``AsyncLLMEngine.check_request``) and before it queues it (``queue``),
so a request this instance refuses is never sent to P; it changes nothing for any other
request.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional
from urllib.parse import urlsplit

from fastapi import Request

from llm_serving.distributed.kv_transfer.config import KVTransferConfig
from llm_serving.entrypoints import unread_offers
from llm_serving.entrypoints.http_common import HTTPError, ServerState, client_gone
from llm_serving.proxy import pd_request as pd

logger = logging.getLogger("llm_serving.server")
MAX_CONNECTIONS = 64


class RemotePrefillError(Exception):
    pass


async def resolve(request: Request, params: Optional[dict]) -> Optional[dict]:
    """The kv_transfer_params a request goes on with: the producer's answer (or None, to
    compute the prompt here) when ``params`` ask for a remote prefill by URL, else
    ``params``. Called once every check of the request has passed."""
    if not pd.is_d_first(params):
        return params
    state: ServerState = request.app.state.server
    config = KVTransferConfig.from_dict(state.engine_args.kv_transfer_config)
    if config is None or not config.is_consumer:
        return params              # the engine refuses it, naming kv_transfer_params
    url = str(params["remote_prefill_url"]).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise HTTPError(400, f"kv_transfer_params.remote_prefill_url: expected an http(s) URL "
                        f"of a producer instance, got {url!r}", param="kv_transfer_params")
    try:
        answer = await _ask_producer(request, url, config)
        unread_offers.hold(request, answer)
        if await request.is_disconnected():     # left as P answered: the offer is declined
            raise HTTPError(499, "the client closed the connection")
        return answer
    except RemotePrefillError as e:
        reason = f"KV transfer failed: the remote prefill at {url} {e}"
        if state.metrics is not None:
            state.metrics.kv_transfers.labels(outcome="failed").inc()
        if config.kv_failure_policy == "fail":
            raise HTTPError(503, reason, param="kv_transfer_params",
                            kind="service_unavailable") from None
        logger.warning("%s; computing the prefill here", reason)
        if state.metrics is not None:
            state.metrics.counters["kv_transfer_recomputes"].inc()
        return None


async def _ask_producer(request: Request, url: str, config: KVTransferConfig) -> dict:
    import httpx2 as httpx
    body = await request.json()
    path, p_body = pd.prefill_request(request.url.path, body)
    headers = {k: v for k, v in request.headers.items() if k == "authorization"}
    timeout = float(config.kv_transfer_timeout)
    call = asyncio.ensure_future(producer_client(request.app).post(
        url + path, json=p_body, headers=headers, timeout=timeout))
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not call.done():
            raise HTTPError(499, "the client closed the connection")
        resp = call.result()
    except httpx.TimeoutException:
        raise RemotePrefillError(f"did not answer within {timeout:g} s "
                                 "(kv_transfer_timeout)") from None
    except httpx.HTTPError as e:
        raise RemotePrefillError(f"failed: {type(e).__name__}: {e}") from None
    finally:
        gone.cancel()
        if not call.done():
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
    if resp.status_code != 200:
        raise RemotePrefillError(f"answered {resp.status_code}: {resp.text[:300]}")
    try:
        got: Optional[dict] = resp.json().get(pd.KV_FIELD)
    except (ValueError, AttributeError):
        got = None
    if not isinstance(got, dict) or not got.get("do_remote_prefill"):
        raise RemotePrefillError("answered without kv_transfer_params (is it a kv_producer "
                                 "or kv_both instance?)")
    return got


def producer_client(app):
    """The server's client for its producers (bounded; made on first use)."""
    import httpx2 as httpx
    client = getattr(app.state, "remote_prefill_client", None)
    if client is None:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=MAX_CONNECTIONS),
                                   headers={"accept-encoding": "identity"})
        app.state.remote_prefill_client = client
    return client


async def close(app) -> None:
    """At shutdown: close the producers' client and its connections (if one was made)."""
    client = getattr(app.state, "remote_prefill_client", None)
    if client is not None:
        app.state.remote_prefill_client = None
        await client.aclose()
