"""A small OTLP/HTTP trace collector for the tests (and for a side-by-side run by hand): it
takes POST /v1/traces bodies, decodes them as opentelemetry-proto's ExportTraceServiceRequest
and keeps every span, its attributes as plain values.

    python tests/otlp_receiver.py PORT     # prints one JSON line per span received
"""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def decode(body: bytes) -> list[dict]:
    """The spans of one ExportTraceServiceRequest, as dicts."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "name": s.name, "kind": s.kind, "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(), "parent_span_id": s.parent_span_id.hex(),
                    "trace_state": s.trace_state,
                    "start": s.start_time_unix_nano / 1e9, "end": s.end_time_unix_nano / 1e9,
                    "status": s.status.code, "status_message": s.status.message,
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "resource": resource, "scope": ss.scope.name})
    return spans


class Receiver:
    """Serves on 127.0.0.1:``port`` (0: a free one) in a thread; ``spans`` grows as they come."""

    def __init__(self, port: int = 0, echo: bool = False):
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                got = decode(body)
                receiver.spans.extend(got)
                if echo:
                    for s in got:
                        print(json.dumps(s), flush=True)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    r = Receiver(int(sys.argv[1]), echo=True)
    try:
        r.thread.join()
    except KeyboardInterrupt:
        r.close()
