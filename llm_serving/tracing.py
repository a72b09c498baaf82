"""OpenTelemetry request tracing, vLLM's ``--otlp-traces-endpoint``: one span per request,
``llm_request`` (kind SERVER, from its arrival to its end), with vLLM's ``gen_ai.*`` attributes,
parented to the W3C ``traceparent`` / ``tracestate`` headers of the HTTP request that brought
it. The OpenTelemetry SDK's BatchSpanProcessor exports the spans from a thread of its own to
the OTLP collector, over grpc or http/protobuf as ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says
(grpc by default, as vLLM): its queue is bounded (spans beyond it are dropped), and a collector
that is down costs the requests nothing. The opentelemetry packages are an optional extra
(``pip install 'llm_serving[tracing]'``); without an endpoint nothing of it is imported.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
from typing import Optional

from llm_serving.errors import ConfigError

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"                       # vLLM's
TRACE_HEADERS = ("traceparent", "tracestate")   # W3C trace context, as vLLM reads them
DETAILED_TRACE_MODULES = ("model", "worker", "all")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
# The exporter of each protocol: its module and the package that has it
EXPORTERS = {
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
             "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                      "opentelemetry-exporter-otlp-proto-http"),
}
# How long a shutdown waits for the spans not exported yet (a collector that is down would
# hold it for the exporter's whole retry timeout, 10 s)
FLUSH_AT_SHUTDOWN_S = 2.0

# vLLM's attribute names (vllm/tracing/utils.py's SpanAttributes), and the two OpenTelemetry
# GenAI conventions it has no attribute for
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
MAX_TOKENS = "gen_ai.request.max_tokens"
TOP_P = "gen_ai.request.top_p"
TEMPERATURE = "gen_ai.request.temperature"
N = "gen_ai.request.n"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
PREFILL = "gen_ai.latency.time_in_model_prefill"
DECODE = "gen_ai.latency.time_in_model_decode"
INFERENCE = "gen_ai.latency.time_in_model_inference"


def check_tracing(endpoint, detailed) -> Optional[tuple]:
    """``otlp_traces_endpoint`` and ``collect_detailed_traces`` as vLLM checks them (and the
    OpenTelemetry packages the endpoint needs); the detailed modules as a tuple (None: unset).
    vLLM's ``model,worker`` form (older vLLM's) is taken as ``model worker``. ConfigError
    naming the key otherwise."""
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.strip():
            raise ConfigError("otlp_traces_endpoint", f"expected the OTLP collector's URL, e.g. "
                              f"http://collector:4317, got {endpoint!r}")
        exporter_module()           # the packages are there, the protocol is known
    if detailed is None:
        return None
    items = [detailed] if isinstance(detailed, str) else detailed
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ConfigError("collect_detailed_traces", f"expected a list of "
                          f"{', '.join(DETAILED_TRACE_MODULES)}, got {detailed!r}")
    modules = tuple(m.strip() for i in items for m in i.split(",") if m.strip())
    bad = next((m for m in modules if m not in DETAILED_TRACE_MODULES), None)
    if bad is not None or not modules:
        raise ConfigError("collect_detailed_traces", f"{bad or detailed!r} is not one of "
                          f"{', '.join(DETAILED_TRACE_MODULES)}")
    if endpoint is None:
        raise ConfigError("collect_detailed_traces", "requires otlp_traces_endpoint "
                          "(--otlp-traces-endpoint) to be set")
    return modules


def exporter_module():
    """The OTLP span exporter module of ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``'s protocol;
    ConfigError naming the variable for another protocol, or naming the missing package."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    if protocol not in EXPORTERS:
        raise ConfigError(PROTOCOL_ENV, f"unsupported OTLP protocol {protocol!r} (expected "
                          f"{' or '.join(EXPORTERS)})")
    module, package = EXPORTERS[protocol]
    for name, pkg in (("opentelemetry.sdk.trace", "opentelemetry-sdk"), (module, package)):
        try:
            found = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError("otlp_traces_endpoint", f"OpenTelemetry is not available "
                              f"({e}): install {pkg} (pip install 'llm_serving[tracing]')"
                              ) from None
    return found


def trace_headers(headers) -> Optional[dict]:
    """The W3C trace context headers among ``headers`` (a mapping with lower-case keys, as
    Starlette's), None when there are none."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


class RequestTracer:
    """Ends one span per request into the SDK's BatchSpanProcessor (on the caller's thread:
    the span is built and queued; the export runs on the processor's thread)."""

    def __init__(self, endpoint: str, model: str):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        exporter = exporter_module().OTLPSpanExporter
        kind = os.environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
        self.model = model              # gen_ai.response.model: the served name
        self._provider = TracerProvider(
            resource=Resource.create({"llm_serving.process_id": str(os.getpid())}),
            shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter(endpoint=endpoint, insecure=True) if kind == "grpc"
            else exporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer(__name__)
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._error = SpanKind.SERVER, (Status, StatusCode.ERROR)
        self._closed = False
        atexit.register(self.shutdown)
        logger.info("tracing requests to %s (OTLP over %s)", endpoint, kind)

    def record(self, new, headers: Optional[dict], request_id: str, out=None,
               error: Optional[str] = None) -> None:
        """The span of a request that ended: ``new`` the request as queued (NewRequest),
        ``headers`` the trace context it came with, ``request_id`` the id the span names,
        ``out`` its last RequestOutput (None when it failed without one, ``error`` saying
        why)."""
        attributes = {REQUEST_ID: request_id,
                      RESPONSE_MODEL: new.lora.lora_name if new.lora else self.model}
        if new.pooling is None:     # as vLLM: a temperature of 0 is left out
            p = new.params
            for key, value in ((TOP_P, p.top_p), (MAX_TOKENS, new.max_tokens),
                               (TEMPERATURE, p.temperature), (N, p.n)):
                if value:
                    attributes[key] = value
        attributes[PROMPT_TOKENS] = len(new.prompt_token_ids)
        if out is not None:
            error = error or out.error
            m = out.metrics
            if m is not None:
                attributes[FINISH_REASONS] = m.finish_reasons
                attributes[COMPLETION_TOKENS] = m.num_output_tokens
                for key, value in ((TIME_TO_FIRST_TOKEN, m.ttft), (E2E, m.e2e_latency),
                                   (TIME_IN_QUEUE, m.time_in_queue), (PREFILL, m.prefill_time),
                                   (DECODE, m.decode_time), (INFERENCE, m.inference_time)):
                    if value is not None:
                        attributes[key] = value
        parent = self._propagator.extract(headers) if headers else None
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind,
                                       attributes=attributes,
                                       start_time=int(new.arrival_time * 1e9))
        if error:
            status, code = self._error
            span.set_status(status(code, error))
        span.end()

    def shutdown(self, timeout: float = FLUSH_AT_SHUTDOWN_S) -> None:
        """Export what is queued, waiting ``timeout`` seconds at most (the rest is dropped:
        a collector that is down must not hold up a shutdown). Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        flush = threading.Thread(target=self._provider.shutdown, name="otlp-flush",
                                 daemon=True)
        flush.start()
        flush.join(timeout)
        if flush.is_alive():
            logger.warning("tracing: the OTLP collector took more than %g s; the spans not "
                           "exported yet are dropped", timeout)
