"""vLLM's run-time adapter routes, served when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true
(as vLLM, which warns that this is for development): ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path", "load_inplace"}`` serves a PEFT adapter as a model name, and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` stops serving it (requests in flight run
on). Both answer 200 with vLLM's plain-text message; a bad request is a 400 naming the field,
an unknown adapter a 404."""
from __future__ import annotations

import asyncio
import os
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from llm_serving.entrypoints.http_common import HTTPError, server_state

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

router = APIRouter()


def runtime_lora_updating() -> bool:
    """vLLM's reading of the variable: 1 or true (any case)."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


def _registry(request: Request):
    state = server_state(request)
    loras = state.require_engine().loras
    if loras is None:
        raise HTTPError(400, "LoRA adapters are served with --enable-lora", param="lora_name")
    return state, loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, request: Request):
    state, loras = _registry(request)
    if not req.lora_name or not req.lora_path:
        raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                        param="lora_name" if not req.lora_name else "lora_path")
    if req.lora_name in state.model_names():
        raise HTTPError(400, f"lora_name: the lora adapter '{req.lora_name}' conflicts with a "
                        "served base model.", param="lora_name")
    try:        # reads the adapter's config and weights: off the event loop
        lora = await asyncio.to_thread(loras.load, req.lora_name, req.lora_path, None,
                                       req.load_inplace)
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise HTTPError(400, str(e), param=field if field == "lora_name" else "lora_path") \
            from None
    # The WorkAgents read it now too (vLLM's add_lora), so that its requests run even if the
    # directory is removed after this answer.
    why = await state.require_engine().read_lora(lora)
    if why is not None:
        loras.unload(req.lora_name)
        raise HTTPError(400, f"lora_path: the model process could not read the adapter: {why}",
                        param="lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, request: Request):
    _, loras = _registry(request)
    if not req.lora_name:
        raise HTTPError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                        param="lora_name")
    if loras.unload(req.lora_name) is None:
        raise HTTPError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                        param="lora_name", kind="not_found_error")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                             "successfully.")
