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
  a 400: there is no sleep mode here (nor in vLLM-CPU).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from llm_serving.cpu_info import cpu_description
from llm_serving.entrypoints.http_common import HTTPError, server_state

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
