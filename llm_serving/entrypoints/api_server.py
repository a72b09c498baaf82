"""The HTTP server: FastAPI on uvicorn, in the master process, over the AsyncLLMEngine.

Routes:
- llm-serving's own (``llm_serving_routes.py``);
- the OpenAI-compatible API (``openai_routes.py``);
- operations (here): ``/health``, ``/ready``, ``/metrics``, ``/version``.

The model loads in a background thread after the server starts listening, so ``/ready``
answers 503 while loading. The engine's step loop runs on its own thread: no handler waits
on a model step. Every error is a JSON body naming the problem, with a 4xx code for bad input
and 503 (with Retry-After) for a full queue.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

import llm_serving
from llm_serving.config import EngineArgs
from llm_serving.errors import EngineDeadError, LLMServingError, QueueFullError

logger = logging.getLogger("llm_serving.server")
MAX_BODY_BYTES = 4 << 20


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


@dataclass
class ServerState:
    engine_args: EngineArgs
    served_model_name: str
    api_key: Optional[str] = None
    chat_template: Optional[str] = None
    engine: object = None                 # AsyncLLMEngine once loaded
    load_error: Optional[str] = None
    draining: bool = False
    metrics: object = None
    started: float = field(default_factory=time.time)

    def model_names(self) -> set[str]:
        return {self.served_model_name, self.engine_args.model}

    def require_engine(self):
        if self.engine is None:
            raise HTTPError(503, self.load_error or "the model is still loading",
                            kind="service_unavailable", headers={"Retry-After": "5"})
        if self.draining:
            raise HTTPError(503, "the server is shutting down", kind="service_unavailable")
        return self.engine

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.model_names():
            raise HTTPError(404, f"model {name!r} does not exist; this server serves "
                            f"{self.served_model_name!r}", param="model",
                            kind="not_found_error")


def error_response(status: int, message: str, param: Optional[str] = None,
                   kind: str = "invalid_request_error",
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def translate_error(e: BaseException) -> HTTPError:
    """Engine and validation errors, as the HTTP error a client should get."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, QueueFullError):
        return HTTPError(503, str(e), kind="service_unavailable", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return HTTPError(503, str(e), kind="service_unavailable")
    if isinstance(e, (ValueError, TypeError)):
        msg = str(e)
        return HTTPError(400, msg, param=msg.split(" ", 1)[0] if msg else None)
    if isinstance(e, LLMServingError):
        return HTTPError(500, str(e), kind="internal_error")
    return HTTPError(500, f"internal error: {type(e).__name__}", kind="internal_error")


def log_request(rid: str, prompt_tokens: int, completion_tokens: int, t0: float) -> None:
    """The one access-log line of a request (nothing is logged per token)."""
    logger.info("request %s: %d prompt + %d completion tokens in %.3f s", rid, prompt_tokens,
                completion_tokens, time.perf_counter() - t0)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def stream_or_disconnect(request: Request, stream: AsyncIterator) -> AsyncIterator:
    """Items of ``stream``; stops (closing it, which aborts the request) once the client
    has gone, even while no output is coming."""
    it = stream.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=0.5)
            if nxt in done:
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
                nxt = asyncio.ensure_future(it.__anext__())
            elif await request.is_disconnected():
                return
    finally:
        if not nxt.done():
            nxt.cancel()
        if hasattr(it, "aclose"):
            await it.aclose()


class _BodyLimit:
    """ASGI middleware: a request body over the limit gets 413 before it is read in full.
    Bodies are JSON whatever the declared type (curl -d sends form-urlencoded)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        if scope.get("method") == "POST" and not any(
                k == b"content-type" and b"json" in v for k, v in headers):
            headers = [(k, v) for k, v in headers if k != b"content-type"]
            scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        declared = dict(headers).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await error_response(413, f"the body exceeds {self.limit} bytes")(
                scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise HTTPError(413, f"the body exceeds {self.limit} bytes")
            return msg
        return await self.app(scope, limited, send)


def build_app(state: ServerState, load: bool = True) -> FastAPI:
    from contextlib import asynccontextmanager

    from llm_serving.entrypoints import llm_serving_routes, openai_routes
    from llm_serving.entrypoints.metrics import ServerMetrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load and state.engine is None:
            threading.Thread(target=_load_engine, args=(state,), daemon=True,
                             name="llm-load").start()
        yield
        state.draining = True
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="llm_serving", version=llm_serving.__version__, lifespan=lifespan)
    app.state.server = state
    state.metrics = ServerMetrics()

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return error_response(e.status, e.message, e.param, e.kind, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {err['msg']}", "body")
        loc = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        return error_response(400, f"{loc}: {err['msg']}", loc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        err = translate_error(e)
        return error_response(err.status, err.message, err.param, err.kind, err.headers)

    @app.middleware("http")
    async def _auth_and_log(request: Request, call_next):
        path = request.url.path
        if state.api_key and path != "/health":
            if request.headers.get("authorization") != f"Bearer {state.api_key}":
                return error_response(401, "missing or wrong API key (Authorization: Bearer)",
                                      kind="authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.engine is not None and state.engine.is_dead:
            return error_response(503, "the engine loop stopped", kind="service_unavailable")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        if state.engine is None or state.draining or not state.engine.is_running:
            reason = ("shutting down" if state.draining else state.load_error
                      or ("loading" if state.engine is None else
                          "the engine loop stopped" if state.engine.is_dead else
                          "restarting the model process"))
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return {"ready": True}

    @app.get("/version")
    async def version():
        return {"version": llm_serving.__version__}

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None and state.engine.is_running:
            state.metrics.update(await state.engine.get_stats())
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    app.include_router(openai_routes.router)
    app.include_router(llm_serving_routes.router)
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    return app


def _load_engine(state: ServerState) -> None:
    from llm_serving.engine.async_engine import AsyncLLMEngine
    try:
        state.engine = AsyncLLMEngine(state.engine_args)
    except Exception as e:   # noqa: BLE001 - reported by /ready and every request
        logger.exception("loading the model failed")
        state.load_error = f"loading the model failed: {e}"


def run_server(engine_args: EngineArgs, served_model_name: str, host: str, port: int,
               api_key: Optional[str] = None, chat_template: Optional[str] = None) -> None:
    """Load the model, then serve until SIGINT/SIGTERM; prints one line when ready."""
    import socket

    import uvicorn
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = api_key or os.environ.get("LLM_SERVING_API_KEY") or None
    state = ServerState(engine_args, served_model_name, api_key, chat_template)
    # A busy port fails at once, before the model loads.
    probe = socket.socket()
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as e:
        raise LLMServingError(f"cannot listen on {host}:{port}: {e.strerror} "
                              "(another server running? pass --port)") from None
    finally:
        probe.close()
    app = build_app(state, load=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    failed = []

    async def announce():
        while not server.started or (state.engine is None and state.load_error is None):
            await asyncio.sleep(0.05)
        if state.engine is None:
            failed.append(state.load_error)
            server.should_exit = True
            return
        print(f"llm_serving ready: http://{host}:{port} (model {served_model_name!r})",
              flush=True)

    async def main():
        task = asyncio.ensure_future(announce())
        await server.serve()
        task.cancel()
    asyncio.run(main())
    if failed:
        raise LLMServingError(failed[0])
