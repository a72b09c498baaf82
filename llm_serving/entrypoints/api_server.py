"""The HTTP server: FastAPI on uvicorn, in the master process, over the AsyncLLMEngine.

Routes:
- llm-serving's own (``llm_serving_routes.py``);
- the OpenAI-compatible API (``openai_routes.py``), and its Responses API
  (``responses_routes.py``);
- Anthropic's Messages API (``anthropic_routes.py``), whose errors have Anthropic's shape;
- operations (here): ``/live`` (the process is up), ``/health`` (requests can be served, as
  vLLM's), ``/ready`` (the same, and not shutting down), ``/metrics``, ``/version``.

The model loads in a background thread after the server starts listening, so ``/ready``
answers 503 while loading. The engine's step loop runs on its own thread: no handler waits
on a model step. Every error is a JSON body naming the problem, with a 4xx code for bad input
and 503 (with Retry-After) for a full queue.

Shutdown (SIGTERM, Ctrl-C): the server drains (``drain``) while still listening, so that
``/ready`` answers 503 and new requests get 503; the requests in flight have
``shutdown_timeout`` seconds to finish, then the engine ends what is left with "the server is
shutting down" (a 503, or an error event closing a stream). Then uvicorn closes the port and
the connections, and the lifespan stops the engine and the WorkAgents. Connections are
bounded (``connections.py``).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import os
import stat
import threading
import time
import uuid
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import llm_serving
from llm_serving import vllm_env
from llm_serving.cli_args import (REQUEST_READ_TIMEOUT_S, RESPONSE_WRITE_TIMEOUT_S,
                                  SHUTDOWN_TIMEOUT_S)
from llm_serving.config import EngineArgs
from llm_serving.entrypoints.frontend_args import FrontendArgs
from llm_serving.model_executor.layers.pooler import served_routes
from llm_serving.entrypoints.http_common import (ANTHROPIC_PATH, HTTPError, ServerState,
                                                ShuttingDown, anthropic_error_response,
                                                error_response, logger, translate_error)
from llm_serving.errors import ConfigError, LLMServingError
from llm_serving.profiler import ProfilerConfig

MAX_BODY_BYTES = 4 << 20
# with --enable-prompt-embeds: a prompt's embeddings are megabytes (each is bounded by
# max_model_len rows of the hidden size, prompt_embeds.decode_prompt_embeds)
PROMPT_EMBEDS_BODY_BYTES = 256 << 20
SHUTDOWN_REASON = "the server is shutting down"
# After the drain window, how long the aborted requests' handlers have to send their error
# (then uvicorn cancels what is left, e.g. a stream whose client stopped reading).
ANSWER_ABORTED_S = 3.0
# A drain window at least this long in which no model step ended, with requests in flight:
# the engine loop is held in a step (a hung WorkAgent) and would not take the abort either.
HELD_AFTER_S = 1.0


class _RequestLimits:
    """ASGI middleware: a request with more headers, or more header bytes, than allowed gets
    431; a body over the limit gets 413 before it is read in full. Bodies are JSON whatever
    the declared type (curl -d sends form-urlencoded)."""

    def __init__(self, app, limit: int, max_headers: int, max_header_bytes: int):
        self.app, self.limit = app, limit
        self.max_headers, self.max_header_bytes = max_headers, max_header_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        if len(headers) > self.max_headers:
            return await error_response(431, f"the request has {len(headers)} headers, more "
                                        f"than {self.max_headers} (--h11-max-header-count)")(
                scope, receive, send)
        if sum(len(k) + len(v) + 4 for k, v in headers) > self.max_header_bytes:
            return await error_response(431, f"the request's headers exceed "
                                        f"{self.max_header_bytes} bytes "
                                        "(--h11-max-incomplete-event-size)")(
                scope, receive, send)
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


class _ApiKey:
    """ASGI middleware: the OpenAI routes (``/v1/...``, as vLLM guards) and llm-serving's
    generation routes (``/models/...``) need ``Authorization: Bearer <key>`` (401 otherwise),
    or on Anthropic's Messages API its own header, ``x-api-key: <key>`` (what an Anthropic SDK
    client sends of its api_key; vLLM reads the Bearer only); health, metrics, /tokenize and
    the info routes stay open, as on vLLM. The key is compared in constant time. Plain ASGI, not Starlette's ``BaseHTTPMiddleware``, which carries every
    streamed chunk through a memory stream and a task group: with it, the server process spent
    5.0-5.2 CPU seconds under W1 all at once (200 streams), without it 3.2-3.8."""

    GUARDED = ("/v1/", "/models/")

    def __init__(self, app, keys: list):
        self.app = app
        self.expected = [hashlib.sha256(k.encode()).digest() for k in keys]

    def _accepts(self, header: bytes) -> bool:
        """'Bearer KEY' with one of the keys (the scheme in any case, as vLLM)."""
        scheme, _, token = header.partition(b" ")
        return self._known(token) and scheme.lower() == b"bearer"

    def _known(self, token: bytes) -> bool:
        """One of the keys: every key is compared, in constant time, on digests of equal
        length."""
        given = hashlib.sha256(token).digest()
        found = False
        for key in self.expected:
            found |= hmac.compare_digest(given, key)
        return found

    async def __call__(self, scope, receive, send):
        # the route's path: behind --root-path, FastAPI keeps the prefix in scope["path"]
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" \
                and path.startswith(self.GUARDED):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            on_messages = path.startswith(ANTHROPIC_PATH)
            x_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None) \
                if on_messages else None
            if not (self._accepts(given) or (x_key is not None and self._known(x_key))):
                if on_messages:
                    return await anthropic_error_response(
                        401, "missing or wrong API key (x-api-key, or Authorization: Bearer)",
                        "authentication_error")(scope, receive, send)
                return await error_response(401, "missing or wrong API key (Authorization: "
                                            "Bearer)", kind="authentication_error")(
                    scope, receive, send)
        return await self.app(scope, receive, send)


class _PoolingRunner:
    """ASGI middleware: on a pooling runner (--runner pooling) the generation routes are not
    served, a 404 saying so (vLLM registers none of them there: its plain 404). Plain ASGI,
    as _ApiKey: the body is not touched."""

    GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                  "/models/", "/generative_scoring")

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        engine = self.state.engine
        if scope["type"] == "http" and engine is not None and engine.limits.pooler is not None:
            path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
            if path.startswith(self.GENERATION):
                message = (f"this model is a pooling model (runner pooling): {path} is not "
                           f"served; it serves {served_routes(engine.limits.pooler)}")
                answer = anthropic_error_response(404, message, "not_found_error") \
                    if path.startswith(ANTHROPIC_PATH) else \
                    error_response(404, message, kind="not_found_error")
                return await answer(scope, receive, send)
        return await self.app(scope, receive, send)


class _RequestIdHeader:
    """ASGI middleware (--enable-request-id-headers, vLLM's): every answer carries an
    X-Request-Id header, the request's own if it sent one, else a new id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)
        return await self.app(scope, receive, send_with_id)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _is_type_name(part) -> bool:
    """Field names are lower-case; type names are builtins, bracketed generics and literals,
    or model classes."""
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or part[:1].isupper())


def _field_of(loc) -> tuple[str, str]:
    """The request field a validation error's location names, and where in its value the
    error is: pydantic puts the type it tried after a field that takes several
    (``stop.str``, ``prompt.list[int].0``), which is not part of either."""
    loc = [p for p in loc if p != "body"]
    cut = next((i for i, p in enumerate(loc) if _is_type_name(p)), len(loc))
    inner = ".".join(str(p) for p in loc[cut:] if not _is_type_name(p))
    return ".".join(str(p) for p in loc[:cut]) or "body", inner


def _not_serving(state: ServerState) -> str:
    return state.load_error or ("loading the model" if state.engine is None else
                                "the engine loop stopped" if state.engine.is_dead else
                                "restarting the model process")


def build_app(state: ServerState, load: bool = True) -> FastAPI:
    from contextlib import asynccontextmanager

    from llm_serving.entrypoints import (anthropic_routes, chat_batch_routes, classify_routes,
                                         dev_routes, embedding_routes,
                                         generative_scoring_routes,
                                         llm_serving_routes, lora_routes, openai_routes,
                                         profile_routes, remote_prefill, responses_routes,
                                         sagemaker_routes, score_routes, unread_offers)
    from llm_serving.entrypoints.metrics import ServerMetrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if load and state.engine is None:
            loader = threading.Thread(target=_load_engine, args=(state,), daemon=True,
                                      name="llm-load")
            loader.start()
        stats_task = None
        if state.log_stats_interval > 0:
            from llm_serving.entrypoints.stats_logger import StatsLogger
            stats_task = asyncio.ensure_future(StatsLogger().run(state,
                                                                 state.log_stats_interval))
        yield
        state.draining = True
        if stats_task is not None:
            stats_task.cancel()
        await remote_prefill.close(app)
        if loader is not None and loader.is_alive():
            # Stopped while loading: the agents are killed and the shared memory freed
            # (within a second) before the process exits.
            from llm_serving.executor.multiproc_executor import stop_loading
            stop_loading()
            await asyncio.get_running_loop().run_in_executor(None, loader.join, 30)
        if state.engine is not None:
            state.engine.shutdown()

    front = state.frontend
    docs = {} if not front.disable_fastapi_docs else dict(openapi_url=None, docs_url=None,
                                                           redoc_url=None)
    app = FastAPI(title="llm_serving", version=llm_serving.__version__, lifespan=lifespan,
                  **docs)
    app.root_path = front.root_path or ""       # behind a path-based proxy (vLLM's way)
    app.state.server = state
    state.metrics = ServerMetrics.for_engine(state.served_model_name, state.engine_args)

    def log_stack(request: Request, e: Exception) -> None:
        """--log-error-stack (vLLM's): the stack of an error answered to a request."""
        if front.log_error_stack:
            logger.error("error answered to %s %s: %s", request.method, request.url.path, e,
                         exc_info=e)

    def shaped_error(status, message, param=None, kind="invalid_request_error",
                     headers=None, request: Optional[Request] = None):
        """The route's error: Anthropic's shape on its Messages API, else OpenAI's."""
        if request is not None and anthropic_routes.is_anthropic(request):
            return anthropic_error_response(status, message, kind, headers)
        return error_response(status, message, param, kind, headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        log_stack(request, e)
        if not isinstance(e, ShuttingDown):        # another instance may take it, offer and all
            unread_offers.decline(request)
        return shaped_error(e.status, e.message, e.param, e.kind, e.headers, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        log_stack(request, e)
        unread_offers.decline(request, e.body)
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            return shaped_error(400, f"the body is not valid JSON: {err['msg']}", "body",
                                request=request)
        if err["type"] == "extra_forbidden":     # the unknown key itself is named
            loc = ".".join(str(p) for p in err["loc"] if p != "body")
            return shaped_error(400, f"{loc}: not a field this route supports", loc,
                                request=request)
        field = _field_of(err["loc"])[0]
        # a field taking several types fails once per type: say what each wanted
        wanted = dict.fromkeys(f"at {inner}: {x['msg']}" if inner else x["msg"]
                               for x in e.errors()
                               for f, inner in [_field_of(x["loc"])] if f == field)
        return shaped_error(400, f"{field}: {'; or '.join(wanted)}", field, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException):
        """FastAPI's own: a body it could not read (it hides why behind "There was an error
        parsing the body"), said in the API's error shape; others (an unknown route: 404)
        as FastAPI says them, as vLLM does."""
        log_stack(request, e)
        cause = e.__cause__
        if isinstance(cause, HTTPError):            # the body limit, reached while reading
            return shaped_error(cause.status, cause.message, request=request)
        if e.status_code == 400:
            return shaped_error(400, "the body could not be read as JSON: it must be UTF-8 "
                                f"JSON, nested at most a few hundred levels, with numbers of "
                                f"at most 4300 digits ({type(cause).__name__})", "body",
                                request=request)
        return JSONResponse({"detail": e.detail}, status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        unread_offers.decline(request)
        err = translate_error(e)
        return shaped_error(err.status, err.message, err.param, err.kind, err.headers,
                            request)

    @app.get("/live")
    async def live():
        """The process is up (it may still be loading the model); 503 once the engine loop
        stopped for good (a WorkAgent that could not be replaced), so that a liveness probe
        restarts the server."""
        if state.engine is not None and state.engine.is_dead:
            return error_response(503, _not_serving(state), kind="service_unavailable")
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        """vLLM's meaning: 200 only when requests can be served (the model is loaded and the
        WorkAgents are up); 503 while loading, restarting a dead agent, or after the engine
        loop stopped."""
        if state.engine is None or not state.engine.is_running:
            return error_response(503, _not_serving(state), kind="service_unavailable")
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's (SageMaker's) name for /health."""
        return await health()

    @app.get("/load")
    async def load():
        """vLLM's server load: the requests the engine holds (waiting, running, swapped)."""
        if state.engine is None or not state.engine.is_running:
            return {"server_load": 0}
        stats = await state.stats()
        return {"server_load": stats.num_unfinished}

    @app.get("/ready")
    async def ready():
        if state.engine is None or state.draining or not state.engine.is_running:
            reason = "shutting down" if state.draining else _not_serving(state)
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return {"ready": True}

    @app.get("/version")
    async def version():
        return {"version": llm_serving.__version__}

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None and state.engine.is_running:
            await state.stats()
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    app.include_router(openai_routes.router)
    app.include_router(chat_batch_routes.router)
    app.include_router(embedding_routes.router)
    app.include_router(classify_routes.router)
    app.include_router(score_routes.router)
    app.include_router(generative_scoring_routes.router)
    app.include_router(sagemaker_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(llm_serving_routes.router)
    app.include_router(unread_offers.router)
    if vllm_env.server_dev_mode():
        logger.warning("SECURITY WARNING: Development endpoints are enabled "
                       "(VLLM_SERVER_DEV_MODE)! This should NOT be used in production!")
        app.include_router(dev_routes.router)
    if lora_routes.runtime_lora_updating():
        logger.warning("LoRA dynamic loading & unloading is enabled in the API server "
                       "(%s). This should ONLY be used for local development!",
                       lora_routes.RUNTIME_LORA_ENV)
        app.include_router(lora_routes.router)
    profiler = ProfilerConfig.from_value(getattr(state.engine_args, "profiler_config", None))
    if profiler is not None:
        logger.warning(profiler.describe())
        app.include_router(profile_routes.router)
    app.add_middleware(_PoolingRunner, state=state)
    if state.api_keys:
        app.add_middleware(_ApiKey, keys=state.api_keys)
    embeds = getattr(state.engine_args, "enable_prompt_embeds", False)
    app.add_middleware(_RequestLimits,
                       limit=PROMPT_EMBEDS_BODY_BYTES if embeds else MAX_BODY_BYTES,
                       max_headers=front.h11_max_header_count,
                       max_header_bytes=front.h11_max_incomplete_event_size)
    if front.enable_request_id_headers:
        app.add_middleware(_RequestIdHeader)
    if front.allowed_origins:   # outermost: preflights answered, and errors carry the headers
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=front.allowed_origins,
                           allow_methods=front.allowed_methods,
                           allow_headers=front.allowed_headers,
                           allow_credentials=front.allow_credentials)
    for middleware in front.middleware_objects():   # --middleware: outermost, as vLLM's
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    return app


def _load_engine(state: ServerState) -> None:
    from llm_serving.engine.async_engine import AsyncLLMEngine
    try:
        engine = AsyncLLMEngine(state.engine_args)
        if state.frontend.enable_log_outputs:
            engine.log_outputs(state.frontend.max_log_len)
        if engine.engine.tracer is not None:    # spans name the model as it is served
            engine.engine.tracer.model = state.served_model_name
        state.engine = engine
    except Exception as e:   # noqa: BLE001 - reported by /ready and every request
        if state.draining:        # stopped while loading: not an error
            return
        logger.exception("loading the model failed")
        state.load_error = f"loading the model failed: {e}"


async def drain(state: ServerState, timeout: float, forced=lambda: False) -> None:
    """The first step of a shutdown, while the port is still open: not ready, new requests
    refused (503); the requests in flight may finish within ``timeout`` seconds (``forced``:
    a second Ctrl-C ends the wait), then the engine aborts the rest with SHUTDOWN_REASON, and
    their handlers answer with it (waited for up to ANSWER_ABORTED_S, not at all when no model
    step ended during a window of HELD_AFTER_S or more: the loop is held in a step)."""
    state.draining = True
    engine = state.engine
    if engine is None or engine.is_dead:
        return
    start, steps = time.monotonic(), engine.num_steps
    deadline = start + timeout
    if engine.num_requests:
        logger.info("shutting down: %d request(s) in flight may finish within %g s "
                    "(--shutdown-timeout)", engine.num_requests, timeout)
    while engine.num_requests and time.monotonic() < deadline and not forced():
        await asyncio.sleep(0.05)
    if engine.num_requests:
        logger.warning("shutting down: aborting %d unfinished request(s)", engine.num_requests)
    engine.abort_all(SHUTDOWN_REASON)
    held = (engine.num_requests and engine.num_steps == steps
            and time.monotonic() - start >= HELD_AFTER_S)
    deadline = time.monotonic() + (0.0 if held else ANSWER_ABORTED_S)
    while engine.num_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if engine.num_requests:
        if held:
            logger.warning("shutting down: no model step ended in %.1f s (a WorkAgent hung?); "
                           "answering %d request(s) now", time.monotonic() - start,
                           engine.num_requests)
        else:
            logger.warning("shutting down: the engine did not end %d request(s) within %g s "
                           "(a model step still running); answering them now",
                           engine.num_requests, ANSWER_ABORTED_S)
        engine.fail_open_streams(SHUTDOWN_REASON)


class _QuietPaths(logging.Filter):
    """--disable-access-log-for-endpoints: no uvicorn access line for these paths (its
    record's arguments: client, method, path with query, HTTP version, status)."""

    def __init__(self, paths: frozenset):
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)
                    and args[2].partition("?")[0] in self.paths)


def api_keys(given: Optional[Union[str, list]]) -> list:
    """The keys that open the guarded routes: --api-key's (one or more), else
    $LLM_SERVING_API_KEY, else vLLM's $VLLM_API_KEY; none: the routes are open."""
    given = given or os.environ.get("LLM_SERVING_API_KEY") or os.environ.get("VLLM_API_KEY")
    return [k for k in ([given] if isinstance(given, str) else given or []) if k]


def _check_address(host: str, port: int, uds: Optional[str]) -> None:
    """Fails at once, before the model loads, when the port or socket is taken."""
    import socket
    if uds:
        probe = socket.socket(socket.AF_UNIX)
        try:
            if os.path.exists(uds):
                try:
                    probe.connect(uds)
                except OSError:         # nobody listens: a stale socket file, replaced
                    if not stat.S_ISSOCK(os.stat(uds).st_mode):
                        raise LLMServingError(f"cannot listen on {uds}: a file that is not a "
                                              "socket is there") from None
                else:
                    raise LLMServingError(f"cannot listen on {uds}: another server listens "
                                          "on it (pass another --uds)")
            else:                       # a missing directory, no permission: said now
                try:
                    probe.bind(uds)
                except OSError as e:
                    raise LLMServingError(f"cannot listen on {uds}: {e.strerror}") from None
                os.unlink(uds)
        finally:
            probe.close()
        return
    probe = socket.socket()
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as e:
        raise LLMServingError(f"cannot listen on {host}:{port}: {e.strerror} "
                              "(another server running? pass --port)") from None
    finally:
        probe.close()


def run_server(engine_args: EngineArgs, served_model_name: str, host: str, port: int,
               api_key: Optional[Union[str, list]] = None, chat_template: Optional[str] = None,
               log_stats_interval: float = 10.0,
               shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
               request_read_timeout: float = REQUEST_READ_TIMEOUT_S,
               response_write_timeout: float = RESPONSE_WRITE_TIMEOUT_S,
               frontend: Optional[FrontendArgs] = None) -> None:
    """Load the model, then serve until SIGINT/SIGTERM; prints one line when ready.
    ``frontend``: vLLM's server flags (TLS, CORS, uvicorn's logging ...).
    ``shutdown_timeout``: seconds the requests in flight may take to finish once stopped;
    ``request_read_timeout``: seconds a client may take to send a whole request;
    ``response_write_timeout``: seconds it may go without reading a response."""

    import uvicorn

    from llm_serving.entrypoints import connections

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True       # not ready from the signal on, not from the next tick
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            # uvicorn closes the port first, then waits for the connections: drain before
            await drain(state, shutdown_timeout, lambda: self.force_exit)
            await super().shutdown(sockets)
            if self.force_exit:
                # A second Ctrl-C: uvicorn skips the lifespan's shutdown, whose task was then
                # cancelled at exit (a traceback) with the engine and its agents never told.
                await self.lifespan.shutdown()

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    frontend = frontend or FrontendArgs()
    state = ServerState(engine_args, served_model_name, api_keys(api_key), chat_template,
                        log_stats_interval=log_stats_interval, frontend=frontend)
    _check_address(host, port, frontend.uds)   # a busy port fails at once, before loading
    app = build_app(state, load=True)
    bounds, bounded = connections.bounded_server(
        engine_args.max_num_seqs + engine_args.max_waiting_requests, request_read_timeout,
        response_write_timeout)
    try:        # uvicorn reads --log-config-file here
        config = uvicorn.Config(app, host=host, port=port,
                                timeout_graceful_shutdown=ANSWER_ABORTED_S,
                                timeout_keep_alive=vllm_env.http_keep_alive(),
                                **frontend.uvicorn_kwargs(), **bounded)
    except ValueError as e:
        if not frontend.log_config_file:
            raise
        raise ConfigError("--log-config-file", f"{frontend.log_config_file}: not a logging "
                          f"config uvicorn can use ({e})") from None
    if frontend.quiet_paths:
        logging.getLogger("uvicorn.access").addFilter(_QuietPaths(frontend.quiet_paths))
    server = Server(config)
    failed = []
    where = f"unix:{frontend.uds}" if frontend.uds else f"{frontend.scheme}://{host}:{port}"

    async def announce():
        while not server.started or (state.engine is None and state.load_error is None):
            await asyncio.sleep(0.05)
        if state.engine is None:
            failed.append(state.load_error)
            server.should_exit = True
            return
        print(f"llm_serving ready: {where} (model {served_model_name!r})", flush=True)
        # An engine loop that stopped for good (a WorkAgent that could not be replaced) ends
        # the server with an error, as vLLM's does, so that a supervisor restarts it.
        while not (state.engine.is_dead or state.draining):
            await asyncio.sleep(1.0)
        if not state.draining:
            failed.append(_not_serving(state))
            server.should_exit = True

    async def main():
        asyncio.get_running_loop().set_exception_handler(bounds.log_accept_errors)
        task = asyncio.ensure_future(announce())
        await server.serve()
        task.cancel()
    try:
        asyncio.run(main())
    finally:
        if frontend.uds and os.path.exists(frontend.uds):
            os.unlink(frontend.uds)     # uvicorn leaves its socket file behind
    if failed:
        raise LLMServingError(failed[0])
