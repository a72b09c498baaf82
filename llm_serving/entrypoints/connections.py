"""Bounds on the server's HTTP connections (the project's rule: everything is bounded).

uvicorn's HTTP protocol (httptools) bounds none of these: it accepts connections until the
process runs out of file descriptors, keeps a connection that never sends a whole request
open for ever (its ``timeout_keep_alive`` only starts once a response is complete), and
reads headers of any size and number. ``bounded_protocol`` subclasses it; uvicorn still
parses every request and writes every response.

- At most ``max_connections`` open at once (derived from the engine's queue bounds and the
  open-file limit, ``connection_cap``). A connection beyond it closes the oldest one not
  serving a request (idle between requests, or still sending its head); when every one is
  serving a request, the new one gets a 503 at once and is closed.
- A request head (request line and headers) of at most ``MAX_HEAD_BYTES`` bytes and
  ``MAX_HEADERS`` headers: beyond, 431 and the connection is closed.
- A request must arrive whole (head and body) within ``read_timeout`` seconds of the
  connection opening, or of its first byte on a kept-alive connection: else 408 (nothing
  when no byte of a request came) and the connection is closed. uvicorn closes a
  connection idle after a response after ``timeout_keep_alive`` seconds. At shutdown, a
  request still being sent gets a 503.
- A client that stops reading a response (a stream it asked for): once the transport's
  buffer is full, uvicorn's flow control pauses the response; if nothing more can be written
  for ``write_timeout`` seconds, the connection is closed. The handler sees the client gone,
  as on a disconnect, and the engine aborts the request.
- Errors from ``accept()`` (the open-file limit reached) are logged once a minute, not once
  per attempt (``log_accept_errors``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Optional

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from llm_serving.cli_args import REQUEST_READ_TIMEOUT_S, RESPONSE_WRITE_TIMEOUT_S

logger = logging.getLogger("llm_serving.server")

MAX_HEAD_BYTES = 32 << 10      # request line and headers (h11's default is 16 KiB, nginx 32 KiB)
MAX_HEADERS = 100              # as Apache's LimitRequestFields
CONNECTION_HEADROOM = 128      # connections beyond the requests the engine can hold: probes,
                               # /metrics, clients' idle kept-alive connections
FD_RESERVE = 256               # descriptors the master keeps for itself (agents, shm, files)
REFUSING = 64                  # connections being answered 503 at once, beyond the cap
REFUSE_LINGER_S = 1.0          # how long a refused connection may take to send its request
LOG_EVERY_S = 60.0             # a repeated warning (refusals, accept errors): once a minute


def raise_open_file_limit(target: int = 65536) -> int:
    """Raise this process's soft limit on open files toward the hard one (as vLLM does);
    returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def listen_backlog(fd_limit: int) -> int:
    """uvicorn's listen backlog (2048), smaller under a small open-file limit: asyncio accepts
    up to that many connections at once, before any is seen (and capped)."""
    return max(64, min(2048, fd_limit // 8))


def connection_cap(max_requests: int, fd_limit: int) -> int:
    """The connections served at once: a connection for every request the server can hold
    (an engine's running and waiting ones, a proxy's upstream connections; more would only
    be refused with 503), plus headroom; fewer when the open-file limit leaves less room."""
    room = fd_limit - FD_RESERVE - REFUSING - listen_backlog(fd_limit)
    return max(16, min(max_requests + CONNECTION_HEADROOM, room))


def bounded_server(max_requests: int, read_timeout: float,
                   write_timeout: float) -> tuple["ConnectionBounds", dict]:
    """A server's bounds (raising the open-file limit first) and the ``uvicorn.Config``
    arguments that apply them. The server's loop should take ``bounds.log_accept_errors``
    as its exception handler."""
    fd_limit = raise_open_file_limit()
    bounds = ConnectionBounds(connection_cap(max_requests, fd_limit), read_timeout,
                              write_timeout)
    return bounds, {"http": bounded_protocol(bounds), "backlog": listen_backlog(fd_limit)}


class _Every:
    """A warning logged at most once per ``LOG_EVERY_S``, counting the ones left out."""

    def __init__(self):
        self.last, self.skipped = -LOG_EVERY_S, 0

    def __call__(self, log, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last < LOG_EVERY_S:
            self.skipped += 1
            return
        if self.skipped:
            msg += f" ({self.skipped} more in the last {now - self.last:.0f} s)"
        self.last, self.skipped = now, 0
        log(msg, *args)


class ConnectionBounds:
    """One server's bounds, and its rate-limited warnings."""

    def __init__(self, max_connections: int, read_timeout: float = REQUEST_READ_TIMEOUT_S,
                 write_timeout: float = RESPONSE_WRITE_TIMEOUT_S):
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.warn_full = _Every()
        self.warn_stalled = _Every()
        self.warn_invalid = _Every()
        self.warn_accept = _Every()

    def log_accept_errors(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The event loop's exception handler: asyncio reports a failed ``accept()`` (the
        open-file limit) with a traceback for every attempt, thousands a second; once a
        minute here. Anything else goes to the default handler."""
        if context.get("message") == "socket.accept() out of system resource":
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.warn_accept(logger.error, "cannot accept connections: %s (open-file limit "
                             "%d); retrying every second", context.get("exception"), soft)
            return
        loop.default_exception_handler(context)


class _HeadTooLarge(Exception):
    pass


def _error_bytes(status: int, message: str) -> bytes:
    """A whole response in the API's error shape, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "service_unavailable", "param": None,
                                 "code": status}}).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n",
                     body])


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of ``ConnectionBounds``."""

    bounds: ConnectionBounds      # set on the subclass made for a server (bounded_protocol)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_bytes = 0        # bytes of the current request's head read so far
        self._num_headers = 0
        self._in_head = True        # between requests, or reading a head
        self._deadline: Optional[asyncio.TimerHandle] = None  # the read timeout
        self._stalled: Optional[asyncio.TimerHandle] = None   # the write timeout (paused)
        self._idle_since = 0.0
        self._refused = False

    # ---- the connection cap -----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        if len(self.connections) > self.bounds.max_connections and not self._evict_one():
            self._refuse()
            return
        self._arm()

    def _evict_one(self) -> bool:
        """Close the connection idle the longest (not serving a request); False if none."""
        oldest = None
        for p in self.connections:
            if (p is not self and isinstance(p, BoundedHttpToolsProtocol) and not p._refused
                    and not p.pipeline and (p.cycle is None or p.cycle.response_complete)
                    and not p.transport.is_closing()
                    and (oldest is None or p._idle_since < oldest._idle_since)):
                oldest = p
        if oldest is None:
            return False
        oldest.transport.close()
        return True

    def _refuse(self) -> None:
        """Every connection is serving a request: a 503, written at once; the connection is
        closed once its request came (so that closing does not reset it) or after a second."""
        self._refused = True
        cap = self.bounds.max_connections
        self.bounds.warn_full(logger.warning, "%d connections open, all serving requests: "
                              "new connections get 503", cap)
        if len(self.connections) > cap + REFUSING:
            self.transport.abort()
            return
        self.transport.write(_error_bytes(503, f"the server is at its connection limit "
                                               f"({cap}); try again later"))
        self._deadline = self.loop.call_later(REFUSE_LINGER_S, self.transport.abort)

    # ---- the head bounds ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            self.transport.close()
            return
        self._unset_keepalive_if_required()
        while data:
            if self._in_head:       # feed no more than the head may still take
                room = MAX_HEAD_BYTES - self._head_bytes
                if room <= 0:
                    self._too_large()
                    return
                piece, data = data[:room], data[room:]
                self._head_bytes += len(piece)
            else:
                piece, data = data, b""
            if not self._feed(piece) or self.transport.is_closing():
                return

    def _feed(self, data: bytes) -> bool:
        """uvicorn's data_received, for one piece; False once the connection is done."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _HeadTooLarge):
                self._too_large()
            else:
                self.bounds.warn_invalid(self.logger.warning, "Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return False
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        return True

    def handle_websocket_upgrade(self) -> None:
        self._disarm()              # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > MAX_HEADERS:
            raise _HeadTooLarge()
        super().on_header(name, value)

    def _too_large(self) -> None:
        self._answer(431, f"the request head exceeds {MAX_HEAD_BYTES} bytes or "
                          f"{MAX_HEADERS} headers")

    def _answer(self, status: int, message: str) -> None:
        """Answer and close, before any response started; a handler already running (a body
        still coming) sees the client gone."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(_error_bytes(status, message))
        self.transport.close()

    # ---- the read timeout ---------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.bounds.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        self._deadline = _cancelled(self._deadline)

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._head_bytes == 0 or (cycle is not None and cycle.response_started):
            self.transport.close()          # nothing of a request came, or already answered
        else:
            self._answer(408, f"the request did not arrive whole within "
                              f"{self.bounds.read_timeout:g} s")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:      # a request on a kept-alive connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes, self._num_headers = True, 0, 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()

    def shutdown(self) -> None:
        """The server stops: a request still being sent gets a 503 now (uvicorn would wait
        for it, then cancel its handler)."""
        cycle = self.cycle
        if (cycle is not None and cycle.more_body and not cycle.response_started
                and not self.transport.is_closing()):
            self._answer(503, "the server is shutting down")
            return
        super().shutdown()

    # ---- the write timeout -----------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._stalled = self.loop.call_later(self.bounds.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        self._stalled = _cancelled(self._stalled)
        super().resume_writing()

    def _write_timed_out(self) -> None:
        self._stalled = None
        self.bounds.warn_stalled(logger.warning, "a client read nothing of its response for "
                                 "%g s: connection closed, its request aborted",
                                 self.bounds.write_timeout)
        self.transport.abort()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._stalled = _cancelled(self._stalled)
        super().connection_lost(exc)


def _cancelled(timer: Optional[asyncio.TimerHandle]) -> None:
    """Cancel ``timer`` if set; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()


def bounded_protocol(bounds: ConnectionBounds) -> type:
    """The protocol class to give uvicorn (``Config(http=...)``) for a server's bounds."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"bounds": bounds})
