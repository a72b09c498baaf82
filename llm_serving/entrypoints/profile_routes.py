"""vLLM's profiler routes, served when --profiler-config chooses a profiler (as vLLM, which
warns that this is for development): ``POST /start_profile`` (an optional JSON body:
``profile_prefix``, the trace files' names' start; ``delay_iterations``, ``max_iterations``:
model steps before recording, and recorded before the traces are written) and ``POST /stop_profile`` (every process
writes its trace, ``profiler.py``). Both answer 200 with an empty body; a start while a
profile records (or waits for its delay) is vLLM's 409, a bad field a 400 naming it."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict

from llm_serving.entrypoints.http_common import HTTPError, server_state, translate_error
from llm_serving.profiler import ProfilerActiveError

router = APIRouter()


class StartProfileRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    profile_prefix: Optional[str] = None
    delay_iterations: Optional[int] = None
    max_iterations: Optional[int] = None


@router.post("/start_profile")
async def start_profile(request: Request, body: Optional[StartProfileRequest] = None):
    body = body or StartProfileRequest()
    try:
        await server_state(request).require_engine().start_profile(
            body.profile_prefix, delay_iterations=body.delay_iterations,
            max_iterations=body.max_iterations)
    except ProfilerActiveError as e:
        raise HTTPError(409, str(e), kind="Conflict") from None
    except Exception as e:    # noqa: BLE001 - a bad prefix is a 400, the rest as any route's
        raise translate_error(e) from None
    return Response(status_code=200)


@router.post("/stop_profile")
async def stop_profile(request: Request):
    try:
        await server_state(request).require_engine().stop_profile()
    except Exception as e:    # noqa: BLE001
        raise translate_error(e) from None
    return Response(status_code=200)
