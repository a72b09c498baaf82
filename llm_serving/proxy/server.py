"""``llm-serving proxy``: one endpoint in front of prefill (P) and decode (D) instances.

It serves the OpenAI API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/v1/models``) and
llm-serving's routes (``/models/{model}/generate[_stream]``, ``/serving/...``), and sends each
generation request through PD disaggregation (seed 001 §6.3), in one of two orders:

- ``p-first``: P prefills the prompt (max tokens 1, ``do_remote_decode``) and answers with
  ``kv_transfer_params``; then D gets the client's body with those params, loads the KV and
  decodes; D's answer goes back to the client.
- ``d-first``: D gets the client's body with ``{"do_remote_prefill": true,
  "remote_prefill_url": P}``; D's server asks P itself and loads the KV.

Responses (D's, or an instance's error) are relayed byte for byte, streams as they come.
An upstream 4xx/5xx answer goes to the client unchanged. Errors of the proxy's own are JSON
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad body, 502 when an
instance failed mid-request, 503 when no instance of a role is up, 504 on a timeout.

Failures. An instance whose connection is refused leaves the rotation and the request goes
to another one (nothing was sent). A P that fails after the request reached it: with
``--on-prefill-failure recompute`` (default) D computes the prompt itself, with ``fail`` the
client gets a 502 naming P. When no D takes the request P has prefilled (every D refused the
connection), P is told to decline its offer, so it frees the blocks at once. A D that fails
mid-answer: a 502, or in a stream an error event
(the stream's own error shape). An instance shutting down answers 503 closing the connection
without starting the request: the next instance of its role gets it (a D with P's same
offer). A client that disconnects
closes the upstream request at once, so the instance aborts it; one that leaves once P has
answered is not sent to D, and P is told to decline its offer. Every upstream wait is
bounded (``--timeout``) and ends at once when the health checks find the instance gone.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Optional

import anyio
import httpx2 as httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llm_serving.entrypoints import connections
from llm_serving.entrypoints.http_common import client_gone
from llm_serving.proxy import pd_request as pd
from llm_serving.proxy.pool import Instance, Pool, check_all, keep_checking

logger = logging.getLogger("llm_serving.proxy")
ORDERS = ("p-first", "d-first")
PREFILL_FAILURE = ("recompute", "fail")
MAX_BODY_BYTES = 4 << 20
# Hop-by-hop and framing headers are the proxy's own; the rest of an answer's pass through.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date",
                 "server"}
_FORWARD_HEADERS = ("authorization", "x-request-id")
_SSE_END = b"data: [DONE]\n\n"         # the last event of an OpenAI stream
_RESPONSES_END = b"event: response.completed\n"     # /v1/responses' (no [DONE])


class ProxyError(Exception):
    """``unsent``: no instance got the request (none up, or no connection free)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "bad_gateway", unsent: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.unsent = unsent


class ClientGone(Exception):
    """The client closed its connection; the upstream request was closed."""


def _error(status: int, message: str, param=None, kind="bad_gateway") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _headers(resp: httpx.Response) -> dict:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}


class Metrics:
    def __init__(self, pools: list[Pool]):
        r = self.registry = CollectorRegistry()
        p = "llm_serving_proxy:"
        self.requests = Counter(p + "requests", "Generation requests, by outcome (ok: the "
                                "upstream answered 2xx; upstream_error: it answered 4xx/5xx; "
                                "failed; client_gone)", ["outcome"], registry=r)
        self.prefill_fallbacks = Counter(p + "prefill_fallbacks", "Requests D computed itself "
                                         "after P failed (--on-prefill-failure recompute)",
                                         registry=r)
        self.prefill_time = Histogram(p + "prefill_seconds", "Time of the P request (p-first)",
                                      buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30,
                                               60), registry=r)
        self.up = Gauge(p + "instance_up", "1 when the instance passes its health check",
                        ["role", "url"], registry=r)
        self.inflight = Gauge(p + "instance_requests_in_flight", "Requests in flight through "
                              "the proxy", ["role", "url"], registry=r)
        self.pools = pools

    def render(self) -> tuple[bytes, str]:
        for pool in self.pools:
            for i in pool.instances:
                self.up.labels(pool.role, i.url).set(int(i.healthy))
                self.inflight.labels(pool.role, i.url).set(i.inflight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], order: str = "p-first",
                 policy: str = "round-robin", timeout: float = 600.0,
                 connect_timeout: float = 5.0, health_interval: float = 2.0,
                 max_connections: int = 256, on_prefill_failure: str = "recompute"):
        if order not in ORDERS:
            raise ValueError(f"order: expected one of {', '.join(ORDERS)}, got {order!r}")
        if on_prefill_failure not in PREFILL_FAILURE:
            raise ValueError(f"on_prefill_failure: expected one of "
                             f"{', '.join(PREFILL_FAILURE)}, got {on_prefill_failure!r}")
        self.P = Pool("prefill", prefill, policy)
        self.D = Pool("decode", decode, policy)
        self.order, self.timeout = order, timeout
        self.connect_timeout = connect_timeout
        self.health_interval = health_interval
        self.max_connections = max_connections
        self.on_prefill_failure = on_prefill_failure
        self.client: Optional[httpx.AsyncClient] = None
        self.metrics = Metrics([self.P, self.D])

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout,
                                  pool=self.connect_timeout),
            limits=httpx.Limits(max_connections=self.max_connections,
                                max_keepalive_connections=min(64, self.max_connections)),
            headers={"accept-encoding": "identity"})
        await check_all(self.client, [self.P, self.D], self._check_timeout)
        self._checker = asyncio.ensure_future(keep_checking(
            self.client, [self.P, self.D], self.health_interval, self._check_timeout))

    async def stop(self) -> None:
        self._checker.cancel()
        await self.client.aclose()

    @property
    def _check_timeout(self) -> float:
        return max(2.0, min(5.0, 2 * self.health_interval))

    # ---- waiting on an upstream -----------------------------------------------------------

    async def _wait(self, request: Request, inst: Instance, coro):
        """``coro``'s result; cancelled (closing its connection, which makes the instance
        abort the request) when the client leaves or the instance is found gone."""
        task = asyncio.ensure_future(coro)
        down = asyncio.ensure_future(inst.down.wait())
        gone = asyncio.ensure_future(client_gone(request))
        try:
            done, _ = await asyncio.wait({task, down, gone},
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if down in done:
                raise ProxyError(502, f"{inst.role} instance {inst.url} stopped answering "
                                 f"({inst.reason})")
            raise ClientGone()
        finally:
            down.cancel()
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _send(self, request: Request, pool: Pool, path: str, body: Optional[dict],
                    stream: bool, method: str = "POST"):
        """Sends to one instance of ``pool``, going on to the next while connections are
        refused. Returns (instance, response with its headers read); the caller releases
        the instance (``inflight``) and closes the response."""
        tried: set = set()
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        while True:
            inst = pool.pick(tried)
            if inst is None:
                raise ProxyError(503, f"no {pool.role} instance is up ({pool.describe()})",
                                 kind="service_unavailable", unsent=True)
            tried.add(inst)
            req = self.client.build_request(method, inst.url + path, json=body,
                                            headers=headers)
            inst.inflight += 1
            try:
                resp = await self._wait(request, inst, self.client.send(req, stream=True))
            except httpx.PoolTimeout:
                inst.inflight -= 1
                raise ProxyError(503, f"all {self.max_connections} connections to the "
                                 "instances are busy (--max-connections)",
                                 kind="service_unavailable", unsent=True) from None
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # Refused: the instance is gone (its requests in flight end too). A connect
                # timeout may be a busy host: out of rotation until a check passes.
                inst.inflight -= 1
                inst.mark_unhealthy(f"connection failed ({type(e).__name__})",
                                    gone=isinstance(e, httpx.ConnectError))
                continue
            except httpx.TimeoutException:
                inst.inflight -= 1
                raise ProxyError(504, f"{pool.role} instance {inst.url} did not answer within "
                                 f"{self.timeout:g} s", kind="timeout") from None
            except httpx.HTTPError as e:
                inst.inflight -= 1
                raise ProxyError(502, f"{pool.role} instance {inst.url} failed: "
                                 f"{type(e).__name__}: {e}") from None
            except BaseException:
                inst.inflight -= 1
                raise
            if resp.status_code == 503 and resp.headers.get("connection", "").lower() == "close":
                # shutting down, or at its connection limit: it did not start the request,
                # which the next instance takes as it is (a decode one with the same offer)
                inst.inflight -= 1
                await resp.aclose()
                inst.mark_unhealthy("answered 503 and closed the connection (shutting down?)",
                                    gone=False)
                continue
            return inst, resp

    async def _read(self, request: Request, inst: Instance, resp: httpx.Response) -> bytes:
        try:
            return await self._wait(request, inst, resp.aread())
        except httpx.TimeoutException:
            raise ProxyError(504, f"{inst.role} instance {inst.url} did not answer within "
                             f"{self.timeout:g} s", kind="timeout") from None
        except httpx.HTTPError as e:
            raise ProxyError(502, f"{inst.role} instance {inst.url} failed mid-answer: "
                             f"{type(e).__name__}: {e}") from None
        finally:
            inst.inflight -= 1
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    # ---- a generation request -------------------------------------------------------------

    async def generate(self, request: Request, path: str) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _error(413, f"the body exceeds {MAX_BODY_BYTES} bytes", "body",
                          "invalid_request_error")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _error(400, f"the body is not valid JSON: {e}", "body",
                          "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "body", "invalid_request_error")
        if (pd.generate_model(path) is not None
                and not isinstance(body.get("parameters") or {}, dict)):   # the proxy sets some
            return _error(400, f"parameters: expected a JSON object, got "
                          f"{type(body['parameters']).__name__}", "parameters",
                          "invalid_request_error")
        if pd.kv_params(path, body) is not None:
            return _error(400, "kv_transfer_params: set by the proxy, not accepted from "
                          "clients", pd.KV_FIELD, "invalid_request_error")
        if not pd.is_generation_route(path):
            return _error(404, f"no route {path}", None, "not_found_error")
        try:
            resp = await self._generate(request, path, body)
        except ClientGone:
            self.metrics.requests.labels("client_gone").inc()
            return Response(status_code=499)
        except ProxyError as e:
            self.metrics.requests.labels("failed").inc()
            logger.warning("%s: %s", path, e.message)
            return _error(e.status, e.message, e.param, e.kind)
        if not isinstance(resp, StreamingResponse):      # a stream counts itself as it ends
            self.metrics.requests.labels("ok" if resp.status_code < 400
                                         else "upstream_error").inc()
        return resp

    async def _generate(self, request: Request, path: str, body: dict) -> Response:
        if self.order == "p-first":
            if not self.D.healthy():      # else P would hold the prompt's KV for no reader
                raise ProxyError(503, f"no decode instance is up ({self.D.describe()})",
                                 kind="service_unavailable")
            p_url, kv = await self._prefill(request, path, body)
            if isinstance(kv, Response):            # P's error answer, passed through
                return kv
            if kv is not None and await request.is_disconnected():
                await self._decline(request, p_url, kv)     # left after P answered: D not asked
                raise ClientGone()
            try:
                # a D refusing connections is left for the next one, with the same offer
                return await self._decode(request, path, pd.with_kv_params(path, body, kv),
                                          pd.is_stream(path, body))
            except ProxyError as e:
                if e.unsent and kv is not None:     # no D took it: P need not hold it
                    await self._decline(request, p_url, kv)
                raise
        else:
            p = self.P.pick()
            if p is None:
                if self.on_prefill_failure == "fail":
                    raise ProxyError(503, f"no prefill instance is up ({self.P.describe()})",
                                     kind="service_unavailable")
                self.metrics.prefill_fallbacks.inc()
                kv = None
            else:
                kv = {"do_remote_prefill": True, "remote_prefill_url": p.url}
        return await self._decode(request, path, pd.with_kv_params(path, body, kv),
                                  pd.is_stream(path, body))

    async def _prefill(self, request: Request, path: str, body: dict):
        """(P's URL, what P gave): its kv_transfer_params, its own error answer (a
        Response), or None when P failed and D is to compute the prompt itself."""
        p_path, p_body = pd.prefill_request(path, body)
        t0 = time.perf_counter()
        try:
            inst, resp = await self._send(request, self.P, p_path, p_body, stream=False)
            content = await self._read(request, inst, resp)
        except ProxyError as e:
            if self.on_prefill_failure == "fail":
                raise
            logger.warning("%s; the decode instance computes the prompt", e.message)
            self.metrics.prefill_fallbacks.inc()
            return None, None
        self.metrics.prefill_time.observe(time.perf_counter() - t0)
        if resp.status_code != 200:
            return inst.url, Response(content, status_code=resp.status_code,
                                      headers=_headers(resp))
        try:
            kv = json.loads(content).get(pd.KV_FIELD)
        except (ValueError, AttributeError):
            kv = None
        if not isinstance(kv, dict):
            raise ProxyError(502, f"prefill instance {inst.url} answered without "
                             "kv_transfer_params (is it started with kv_role kv_producer or "
                             "kv_both?)")
        return inst.url, kv

    async def _decline(self, request: Request, url: str, kv: dict) -> None:
        """Tell P that no D will read its offer (``POST /kv_transfer/decline``), so it frees
        the blocks now rather than when the offer expires (which it does if this fails)."""
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        try:
            r = await self.client.post(url + "/kv_transfer/decline", json=kv, headers=headers,
                                       timeout=self.connect_timeout)
            if r.status_code != 200:
                logger.warning("prefill instance %s did not decline its offer (%d: %s)", url,
                               r.status_code, r.text[:200])
        except httpx.HTTPError as e:
            logger.warning("prefill instance %s could not be told to decline its offer: %s: "
                           "%s", url, type(e).__name__, e)

    async def _decode(self, request: Request, path: str, body: dict, stream: bool) -> Response:
        inst, resp = await self._send(request, self.D, path, body, stream=stream)
        if not stream or resp.status_code != 200:
            content = await self._read(request, inst, resp)
            return Response(content, status_code=resp.status_code, headers=_headers(resp))
        return StreamingResponse(self._relay(inst, resp, path, body),
                                 status_code=resp.status_code, headers=_headers(resp))

    async def _relay(self, inst: Instance, resp: httpx.Response, path: str, body: dict):
        """D's stream, chunk by chunk. Ended by the client (Starlette cancels it), by D's
        end, or by D failing (an error event in the stream's own shape). A client that
        leaves once it has the OpenAI stream's last event (``data: [DONE]``) got its whole
        answer: that request is ok, not client_gone."""
        outcome = "client_gone"
        tail = b""
        try:
            chunks = resp.aiter_raw()
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                down = asyncio.ensure_future(inst.down.wait())
                try:
                    done, _ = await asyncio.wait({nxt, down},
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    down.cancel()
                    if not nxt.done():
                        nxt.cancel()
                    elif not nxt.cancelled():
                        nxt.exception()       # retrieved, even when the client left meanwhile
                if nxt not in done:
                    outcome = "failed"
                    yield _stream_error(path, body, f"decode instance {inst.url} stopped "
                                        f"answering ({inst.reason})")
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    outcome = "ok"
                    return
                except httpx.HTTPError as e:
                    outcome = "failed"
                    yield _stream_error(path, body, f"decode instance {inst.url} failed "
                                        f"mid-stream: {type(e).__name__}: {e}")
                    return
                if path == "/v1/responses":
                    if _RESPONSES_END in tail + chunk:
                        outcome = "ok"
                    tail = (tail + chunk)[-len(_RESPONSES_END):]
                else:
                    tail = (tail + chunk)[-len(_SSE_END):]
                    if tail == _SSE_END and path in pd.OPENAI_ROUTES:
                        outcome = "ok"
                yield chunk
        finally:
            self.metrics.requests.labels(outcome).inc()
            inst.inflight -= 1
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    # ---- everything else goes to a decode instance ----------------------------------------

    async def forward(self, request: Request, path: str) -> Response:
        body = None
        if request.method == "POST":
            try:
                body = json.loads(await request.body() or b"null")
            except ValueError as e:
                return _error(400, f"the body is not valid JSON: {e}", "body",
                              "invalid_request_error")
        try:
            inst, resp = await self._send(request, self.D, path, body, stream=False,
                                          method=request.method)
            content = await self._read(request, inst, resp)
        except ClientGone:
            return Response(status_code=499)
        except ProxyError as e:
            return _error(e.status, e.message, e.param, e.kind)
        return Response(content, status_code=resp.status_code, headers=_headers(resp))


def _stream_error(path: str, body: dict, message: str) -> bytes:
    """One error event in the stream's own framing (the instances' own mid-stream errors)."""
    err = {"message": message, "type": "bad_gateway", "param": None, "code": 502}
    if path == "/v1/responses":        # its error event (the proxy does not know its number)
        event = {"type": "error", "sequence_number": None, "error": err}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    if path in pd.OPENAI_ROUTES:
        return f"data: {json.dumps({'error': err})}\n\n".encode()
    line = {"details": None, "generated_text": "", "finish_reason": "error", "error": message}
    params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
    if params.get("return_protocol", "sse") == "sse":
        return (json.dumps({"event": "message", "retry": 30000, "data": [line]}) + "\n").encode()
    return f"data:{json.dumps(line)}\n".encode()


def build_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        yield
        await proxy.stop()

    app = FastAPI(title="llm_serving proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.get("/live")
    async def live():
        return Response(status_code=200)

    async def health():
        """200 when the proxy can serve: a D passes its health check, and a P does or D
        computes prompts itself (``--on-prefill-failure recompute``; the body then says that
        prefill is degraded). Also ``/ready`` and vLLM's ``/ping`` (GET or POST), as on an
        instance, for probes pointed at either."""
        needed = [proxy.D] if proxy.on_prefill_failure == "recompute" else [proxy.P, proxy.D]
        missing = [p for p in needed if not p.healthy()]
        if missing:
            return _error(503, "; ".join(f"no {p.role} instance is up ({p.describe()})"
                                         for p in missing), kind="service_unavailable")
        if not proxy.P.healthy():
            return JSONResponse({"status": "degraded", "prefill": (
                f"no prefill instance is up ({proxy.P.describe()}); the decode instances "
                "compute prompts themselves (--on-prefill-failure recompute)")})
        return Response(status_code=200)

    for route in ("/health", "/ready"):
        app.add_api_route(route, health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/metrics")
    async def metrics():
        body, content_type = proxy.metrics.render()
        return Response(body, media_type=content_type)

    async def generation(request: Request):
        return await proxy.generate(request, request.url.path)

    for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/models/{model}",
                  "/models/{model}/generate", "/models/{model}/generate_stream"):
        app.add_api_route(route, generation, methods=["POST"])

    async def forwarded(request: Request):
        return await proxy.forward(request, request.url.path)

    for route in ("/v1/models", "/version", "/serving/get_bs", "/serving/get_request_numbers",
                  "/serving/get_serverd_model_info"):
        app.add_api_route(route, forwarded, methods=["GET"])
    for route in ("/tokenize", "/detokenize"):
        app.add_api_route(route, forwarded, methods=["POST"])
    return app


def run_proxy(args) -> None:
    """``llm-serving proxy ...`` (cli.py)."""
    import uvicorn
    for name in ("httpx2", "httpcore2"):        # one line per upstream request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    proxy = Proxy(args.prefill, args.decode, order=args.order, policy=args.policy,
                  timeout=args.timeout, health_interval=args.health_interval,
                  max_connections=args.max_connections,
                  on_prefill_failure=args.on_prefill_failure)
    app = build_app(proxy)
    # The client side bounded as an instance's is (entrypoints/connections.py): a connection
    # for each upstream one and headroom, a whole request within the read timeout, a reader
    # that stalls cut off.
    bounds, bounded = connections.bounded_server(
        args.max_connections, args.request_read_timeout, args.response_write_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=10, **bounded)
    server = uvicorn.Server(config)

    async def main():
        async def announce():
            while not server.started:
                await asyncio.sleep(0.05)
            print(f"llm_serving proxy ready: http://{args.host}:{args.port} ({args.order}, "
                  f"{args.policy}; prefill {' '.join(args.prefill)}; decode "
                  f"{' '.join(args.decode)})", flush=True)
        asyncio.get_running_loop().set_exception_handler(bounds.log_accept_errors)
        task = asyncio.ensure_future(announce())
        await server.serve()
        task.cancel()
    asyncio.run(main())
