"""What the HTTP routes share: the server's state, errors as HTTP answers, streaming helpers
and the mappings from engine results to each API's words (finish reasons, SSE framing).

The routes (``openai_routes.py``, ``llm_serving_routes.py``) and the app (``api_server.py``)
import this module; it imports neither, so there is no import circle among them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from llm_serving.config import EngineArgs
from llm_serving.engine.engine_client import EngineClient
from llm_serving.entrypoints.frontend_args import FrontendArgs
from llm_serving.errors import (EngineDeadError, LLMServingError, QueueFullError,
                                ShuttingDownError)
from llm_serving.tracing import trace_headers

logger = logging.getLogger("llm_serving.server")
# How long a stats read (/metrics, /load) waits for the engine thread before it answers with
# the last stats: a step's length, a few ms, when nothing holds it.
STATS_WAIT_S = 1.0


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


class ShuttingDown(HTTPError):
    """A request refused because the server is draining (it never started): a 503 closing the
    connection. Another instance can take it as it is, with the KV offer it carries, which is
    therefore not declined here (the PD proxy sends it to another decode instance)."""

    def __init__(self):
        super().__init__(503, "the server is shutting down", kind="service_unavailable",
                         headers={"Connection": "close"})


@dataclass
class ServerState:
    engine_args: EngineArgs
    served_model_name: str
    api_keys: list = field(default_factory=list)    # any one opens the guarded routes
    chat_template: Optional[str] = None
    engine: Optional[EngineClient] = None   # the AsyncLLMEngine, once loaded
    load_error: Optional[str] = None
    draining: bool = False
    metrics: object = None
    started: float = field(default_factory=time.time)
    log_stats_interval: float = 10.0      # seconds between stats log lines; 0: none
    frontend: FrontendArgs = field(default_factory=FrontendArgs)   # vLLM's server flags
    _last_stats: object = field(default=None, repr=False)     # the engine's, taken last

    async def stats(self):
        """The engine's stats, also fed to /metrics: the engine hands each finished request's
        timings over once, so every reader goes through here or the histograms miss them.
        The engine thread takes them between two steps: while a step holds it (a long
        prefill, a hung WorkAgent until execute_model_timeout) the last stats are answered
        after STATS_WAIT_S, and the ones asked for fed to /metrics when they come."""
        engine = self.engine if self.engine is not None else self.require_engine()
        read = asyncio.ensure_future(engine.get_stats())
        read.add_done_callback(lambda done: self._took_stats(engine, done))
        if self._last_stats is None:
            return await asyncio.shield(read)
        try:
            return await asyncio.wait_for(asyncio.shield(read), STATS_WAIT_S)
        except asyncio.TimeoutError:
            return self._last_stats

    def _took_stats(self, engine, read: asyncio.Future) -> None:
        if read.cancelled() or read.exception() is not None:   # (the reader is told)
            return
        self._last_stats = stats = read.result()
        if self.metrics is not None:
            self.metrics.update(stats, engine.limits.cache, engine.limits.max_loras,
                                engine.admission_rejections)

    def model_names(self) -> set[str]:
        return {self.served_model_name, self.engine_args.model}

    def require_engine(self):
        if self.engine is None:
            raise HTTPError(503, self.load_error or "the model is still loading",
                            kind="service_unavailable", headers={"Retry-After": "5"})
        if self.draining:
            raise ShuttingDown()
        return self.engine

    def check_model(self, name: Optional[str]):
        """The LoRARequest of the adapter served as model ``name``, None for the base model;
        a 404 for a name this server does not serve."""
        if name is None or name in self.model_names():
            return None
        loras = self.engine.loras if self.engine is not None else None
        lora = loras.find(name) if loras is not None else None
        if lora is None:
            raise HTTPError(404, f"model {name!r} does not exist; this server serves "
                            f"{self.served_model_name!r}", param="model",
                            kind="not_found_error")
        return lora

    def model_name(self, lora) -> str:
        """The model name answers carry: the adapter's for a request run with one."""
        return lora.lora_name if lora is not None else self.served_model_name


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def request_trace(request: Request) -> Optional[dict]:
    """The W3C trace context headers (traceparent, tracestate) of ``request``, which its
    engine requests' spans are parented to; None when there are none or nothing is traced
    (no --otlp-traces-endpoint: not even looked at)."""
    if server_state(request).engine_args.otlp_traces_endpoint is None:
        return None
    return trace_headers(request.headers)


def refuse_unsupported(body, refused: dict, prefix: str = "") -> None:
    """A 400 naming the first field of ``refused`` (field -> the values that mean "not
    used"; None always does) that ``body`` sets to anything else. ``prefix`` locates the body
    in the request (e.g. ``parameters.``)."""
    for name, ok in refused.items():
        value = getattr(body, name, None)
        if value is not None and value not in ok:
            raise HTTPError(400, f"{prefix}{name}: not supported by this server (got "
                            f"{value!r})", param=prefix + name)


def error_response(status: int, message: str, param: Optional[str] = None,
                   kind: str = "invalid_request_error",
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def anthropic_error_response(status: int, message: str, kind: str = "invalid_request_error",
                             headers: Optional[dict] = None) -> JSONResponse:
    """An error in the shape of Anthropic's Messages API (ANTHROPIC_PATH)."""
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=status, headers=headers)


def translate_error(e: BaseException) -> HTTPError:
    """Engine and validation errors, as the HTTP error a client should get."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, QueueFullError):
        return HTTPError(503, str(e), kind="service_unavailable", headers={"Retry-After": "1"})
    if isinstance(e, (EngineDeadError, ShuttingDownError)):
        return HTTPError(503, str(e), kind="service_unavailable")
    if isinstance(e, (ValueError, TypeError)):
        msg = str(e)
        return HTTPError(400, msg, param=msg.split(" ", 1)[0].rstrip(":.") if msg else None)
    if isinstance(e, LLMServingError):
        return HTTPError(500, str(e), kind="internal_error")
    return HTTPError(500, f"internal error: {type(e).__name__}", kind="internal_error")


def renamed(err: HTTPError, field: Optional[str]) -> HTTPError:
    """``err`` in a route's own name for the field: the engine names its field first in the
    message and in ``param`` (``structured_outputs: ...``); ``field`` None keeps it."""
    if field is not None and err.param:
        err.param, err.message = field, field + err.message[len(err.param):]
    return err


def output_error(message: str) -> HTTPError:
    """The HTTP error of a request the engine ended with ``message``: the request's own fault
    (a grammar the parser could not follow) is a 400, the server's (a failed model process)
    a 503."""
    if message.startswith("structured_outputs:"):
        return HTTPError(400, message, param="structured_outputs")
    return HTTPError(503, message, kind="service_unavailable")


def log_request(rid: str, prompt_tokens: int, completion_tokens: int, t0: float) -> None:
    """The one access-log line of a request (nothing is logged per token)."""
    logger.info("request %s: %d prompt + %d completion tokens in %.3f s", rid, prompt_tokens,
                completion_tokens, time.perf_counter() - t0)


def log_arrival(state: ServerState, rid: str, prompts: list, params) -> None:
    """--enable-log-requests (vLLM's): a request's id and sampling parameters at info as it
    arrives, its prompts (cut to --max-log-len) at debug. Called by the handlers, once per
    request; nothing is logged per step."""
    front = state.frontend
    if not front.enable_log_requests:
        return
    logger.info("Received request %s: params: %s", rid, params)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("Request %s prompt: %r", rid,
                     [_cut(p, front.max_log_len) for p in prompts])


def _cut(prompt, n: Optional[int]):
    """A prompt (text, token ids, or a dict of them) cut to ``n`` characters or ids."""
    if n is None:
        return prompt
    if isinstance(prompt, dict):
        return {k: _cut(v, n) for k, v in prompt.items()}
    return prompt[:n] if isinstance(prompt, (str, list)) else prompt


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


MAX_REQUEST_ID_CHARS = 256


def response_id(request: Request, prefix: str, default: str,
                chosen: Optional[str] = None) -> str:
    """The id a response carries: ``<prefix>-<X-Request-Id>`` when the client sent that header
    (vLLM's, for tracing a request through), else ``<prefix>-<chosen>`` when the body named
    one (vLLM's ``request_id`` field), else ``default``. The engine keeps its own unique id,
    so two requests sent with the same id do not collide."""
    name, given = "X-Request-Id", request.headers.get("x-request-id")
    if not given:
        name, given = "request_id", chosen
    if not given:
        return default
    if len(given) > MAX_REQUEST_ID_CHARS:
        raise HTTPError(400, f"{name}: at most {MAX_REQUEST_ID_CHARS} characters, got "
                        f"{len(given)}", param=name)
    return f"{prefix}-{given}"


def request_ids(request: Request, prefix: str,
                chosen: Optional[str] = None) -> tuple[str, str]:
    """(the engine's request id, the response's): both ``<prefix>-<hex>``; with the client's
    X-Request-Id or ``chosen`` id, the response's is ``response_id``'s and the engine's that
    with a unique suffix, so two requests sent with the same id do not collide and a log line
    naming either id names the client's."""
    own = new_request_id(prefix)
    resp_id = response_id(request, prefix, own, chosen)
    return (own if resp_id == own else engine_request_id(resp_id)), resp_id


def engine_request_id(resp_id: str) -> str:
    """A unique engine request id that starts with the response's id (which a client may
    have chosen, and reused)."""
    return f"{resp_id}-{uuid.uuid4().hex[:8]}"


async def client_gone(request: Request) -> None:
    """Returns once the client has closed the connection (ASGI ``http.disconnect``), read
    after the body. A real wait on ``receive``, not ``request.is_disconnected()``: that poll's
    zero-timeout receive can be cancelled before the message arrives (it never saw the
    disconnect behind the ``BaseHTTPMiddleware`` the app once had), so a non-streaming request
    ran on after its client reset the connection. A receive that fails counts as gone."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:   # noqa: BLE001 - the connection is unusable either way
        pass


def stream_or_disconnect(request: Request, stream: AsyncIterator) -> AsyncIterator:
    """Items of ``stream``; stops (closing it, which aborts the request) once the client
    has gone, even while no output is coming. Call it after the body was read."""
    return _relay(stream, until=lambda: client_gone(request))


async def _relay(stream: AsyncIterator, until=None, idle: Optional[float] = None,
                 idle_item=None) -> AsyncIterator:
    """Items of ``stream`` as they come; stops once ``until()``'s coroutine returns, and
    yields ``idle_item`` after every ``idle`` seconds without an item. The pending read is
    never cancelled by either: only when the relay closes, and then ``stream`` is closed."""
    it = stream.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    stop = asyncio.ensure_future(until()) if until is not None else None
    try:
        while True:
            done, _ = await asyncio.wait({nxt} if stop is None else {nxt, stop}, timeout=idle,
                                         return_when=asyncio.FIRST_COMPLETED)
            if nxt in done:
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
                nxt = asyncio.ensure_future(it.__anext__())
            elif done:
                return
            else:
                yield idle_item
    finally:
        if stop is not None:
            stop.cancel()
        if not nxt.done():
            nxt.cancel()
            # Let the cancelled __anext__ unwind before closing: closing a generator still
            # running in it raises "aclose(): asynchronous generator is already running".
            await asyncio.gather(nxt, return_exceptions=True)
        if hasattr(it, "aclose"):
            await it.aclose()


# ---- each API's words for the engine's results ---------------------------------------------

def openai_finish_reason(reason: Optional[str]) -> Optional[str]:
    """OpenAI knows "stop" and "length", vLLM adds "repetition" (repetition_detection): an
    abort (a client gone, a failed step) is "stop"."""
    if reason is None:
        return None
    return reason if reason in ("length", "repetition") else "stop"


def llm_serving_finish_reason(reason: Optional[str], stop_reason, error: Optional[str]
                              ) -> Optional[str]:
    """llm-serving's (TGI's) words: eos, stop_sequence, length, timeout, error. A stop
    string is a stop_sequence; a token id is one of the model's end-of-sequence ids
    (generation_config's others beside the tokenizer's EOS, as Llama 3's <|eot_id|>): eos,
    since these routes take no stop_token_ids."""
    if error:
        return "timeout" if "queue_timeout" in error else "error"
    if reason == "stop":
        return "stop_sequence" if isinstance(stop_reason, str) else "eos"
    return reason


def sse(obj, end: str = "\n\n") -> bytes:
    """One server-sent event carrying ``obj`` as JSON (``end``: llm-serving's routes end
    theirs with CRLFs)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}{end}".encode()


SSE_DONE = b"data: [DONE]\n\n"
# Anthropic's Messages API (anthropic_routes): its errors and its key header are its own.
ANTHROPIC_PATH = "/v1/messages"
# An SSE comment: clients skip it, proxies with a read timeout see bytes (vLLM's bytes).
SSE_KEEP_ALIVE = b": keep-alive\n\n"


def event_stream(request: Request, events: AsyncIterator[bytes]) -> StreamingResponse:
    """A route's server-sent events; with --sse-keep-alive-interval S, a keep-alive comment
    after every S idle seconds (queued, in prefill, between chunks), so that a reverse proxy
    does not drop the connection."""
    interval = server_state(request).frontend.sse_keep_alive_interval
    if interval > 0:
        events = _relay(events, idle=interval, idle_item=SSE_KEEP_ALIVE)
    return StreamingResponse(events, media_type="text/event-stream")
