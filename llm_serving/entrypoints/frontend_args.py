"""The HTTP server's options that are vLLM's ``vllm serve`` flags (its FrontendArgs): how
uvicorn listens and logs, TLS, CORS, the root path behind a proxy, the X-Request-Id header,
request logging, header limits, extra middleware and the OpenAI answers' options. One
declaration each (``FrontendArgs``); ``add_frontend_arguments`` makes them ``serve`` flags,
with vLLM's names and meanings."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import ssl
import typing
from dataclasses import dataclass, field
from typing import Optional

from llm_serving.chat_content_format import CONTENT_FORMATS
from llm_serving.cli_args import json_object
from llm_serving.errors import ConfigError

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's defaults for its --h11-max-* flags (it parses with httptools, which ignores them; we
# check them on every request).
MAX_HEADER_COUNT = 256
MAX_HEADER_BYTES = 4 * 1024 * 1024
# Chat template variables a request sets through its own fields, not through kwargs.
CHAT_OWN_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "tools")


def _arg(default, help: str, **flag):
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class FrontendArgs:
    uvicorn_log_level: str = _arg(
        "warning", "uvicorn's log level (vLLM's flag; vLLM's default is info, which with "
        "the access log logs a line per request)", choices=UVICORN_LOG_LEVELS)
    disable_uvicorn_access_log: bool = _arg(
        False, "no uvicorn access log line per request (it shows at --uvicorn-log-level "
        "info or lower)")
    disable_fastapi_docs: bool = _arg(
        False, "no /docs, /redoc and /openapi.json (FastAPI's schema and UIs)")
    root_path: Optional[str] = _arg(
        None, "the path prefix a path-based proxy serves this server under (FastAPI's "
        "root_path, e.g. /llm: /llm/v1/models answers as /v1/models)")
    ssl_keyfile: Optional[str] = _arg(None, "TLS private key file (with --ssl-certfile: "
                                      "serve HTTPS)")
    ssl_certfile: Optional[str] = _arg(None, "TLS certificate file")
    ssl_ca_certs: Optional[str] = _arg(None, "CA certificates to verify clients' "
                                       "certificates with (--ssl-cert-reqs 2 requires one)")
    ssl_ciphers: Optional[str] = _arg(
        None, "TLS cipher suites for TLS 1.2 and below, in OpenSSL's format, e.g. "
        "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305")
    ssl_cert_reqs: int = _arg(
        int(ssl.CERT_NONE), "client certificates: 0 none, 1 optional, 2 required (the ssl "
        "module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)")
    allowed_origins: list = _arg(
        None, "CORS: origins browsers may call from, as JSON, e.g. '[\"http://localhost:3000\"]'"
        " or '[\"*\"]' (default: none, cross-origin calls refused, as vLLM)", json=list)
    allowed_methods: list = _arg(None, "CORS: allowed methods, as JSON (default [\"*\"])",
                                 json=list)
    allowed_headers: list = _arg(None, "CORS: allowed request headers, as JSON (default "
                                 "[\"*\"])", json=list)
    allow_credentials: bool = _arg(False, "CORS: allow cookies and Authorization")
    uds: Optional[str] = _arg(
        None, "listen on this Unix domain socket instead of --host and --port")
    log_config_file: Optional[str] = _arg(
        None, "a logging config file (JSON, dictConfig's schema) for uvicorn's loggers")
    disable_access_log_for_endpoints: Optional[str] = _arg(
        None, "paths with no access log line, comma-separated, e.g. /health,/metrics")
    h11_max_header_count: int = _arg(
        MAX_HEADER_COUNT, "the most headers a request may send (431 beyond)")
    h11_max_incomplete_event_size: int = _arg(
        MAX_HEADER_BYTES, "the most bytes a request's headers may take (431 beyond)")
    middleware: list = _arg(
        None, "an ASGI middleware to add, as an import path (module.name): a class is added "
        "with app.add_middleware, a function as an @app.middleware('http') one; repeatable",
        action="append")
    enable_server_load_tracking: bool = _arg(
        False, "/load's count of the requests in flight: always kept here (vLLM's /load "
        "says 0 without this flag)")
    api_server_count: int = _arg(1, "API server processes: one (vLLM's default without "
                                 "data parallelism)")
    enable_request_id_headers: bool = _arg(
        False, "every answer carries an X-Request-Id header: the request's own, else a new id")
    enable_log_requests: bool = _arg(
        False, "log each generation request as it arrives: its id and sampling parameters "
        "at info, its prompt at debug (--log-level debug), as vLLM")
    enable_tokenizer_info_endpoint: bool = _arg(
        False, "serve GET /tokenizer_info (tokenizer_config.json's settings and the chat "
        "template), as vLLM; off, it answers 404")
    enable_log_outputs: bool = _arg(
        False, "with --enable-log-requests, log each request's generated text as it ends, at "
        "info (its token ids at debug), cut to --max-log-len, as vLLM")
    enable_log_deltas: bool = _arg(
        True, "with --enable-log-outputs, also log each delta of a streamed answer as it is "
        "sent, marked '(streaming delta)', as vLLM (--no-enable-log-deltas: only the whole "
        "answer as it ends)")
    log_error_stack: bool = _arg(
        False, "log the stack trace of each error answered to a request (a 4xx or 5xx), at "
        "error level, as vLLM")
    max_log_len: Optional[int] = _arg(
        None, "with --enable-log-requests, the most prompt characters or token ids logged "
        "(default: all)")
    response_role: str = _arg(
        "assistant", "the role of chat answers to requests with add_generation_prompt (the "
        "default); otherwise the last message's role")
    return_tokens_as_token_ids: bool = _arg(
        False, "logprobs name tokens 'token_id:<id>' (a request's return_tokens_as_token_ids "
        "decides for itself)")
    enable_prompt_tokens_details: bool = _arg(
        False, "usage carries prompt_tokens_details.cached_tokens: the prompt tokens the "
        "prefix cache served")
    enable_per_request_metrics: bool = _arg(
        False, "an answer of /v1/completions or /v1/chat/completions of one prompt and n 1 "
        "carries vLLM's metrics object: time_to_first_token_ms, queue_time_ms, "
        "generation_time_ms, mean_itl_ms and tokens_per_second (a stream: on its final usage "
        "chunk, so with stream_options include_usage)")
    enable_force_include_usage: bool = _arg(
        False, "every stream carries usage, as if each request asked stream_options: "
        "{include_usage: true, continuous_usage_stats: true}")
    sse_keep_alive_interval: int = _arg(
        0, "streams of /v1/completions, /v1/chat/completions and /v1/responses send an SSE "
        "comment "
        "(': keep-alive') after every this many idle seconds, so a reverse proxy's read "
        "timeout does not close them while a request waits or prefills (0: none)")
    default_chat_template_kwargs: dict = _arg(
        None, "chat template variables every chat request gets, as JSON, e.g. "
        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs win", json=dict)
    exclude_tools_when_tool_choice_none: bool = _arg(
        False, "a request with tool_choice \"none\" does not give its tools to the chat "
        "template (by default the template receives them, as on vLLM, and the model may not "
        "call one)")
    chat_template_content_format: str = _arg(
        "auto", "how a message's content is given to the chat template: string (text parts "
        "joined with newlines), openai (a list of {\"type\": \"text\", \"text\": ...} parts, a "
        "string as one), or auto: openai when the template loops over a message's content, "
        "else string (vLLM's detection)", choices=CONTENT_FORMATS)
    anthropic_disabled_thinking_effort: str = _arg(
        "auto", "/v1/messages: the reasoning_effort of thinking {\"type\": \"disabled\"}: "
        "none (the template's enable_thinking false), an effort (low, medium, high, xhigh, "
        "max) for a model that cannot stop thinking, or auto: low when the chat template "
        "cannot render none or renders it as an effort, else none (vLLM's)",
        choices=("auto", "none", "low", "medium", "high", "xhigh", "max"))

    def __post_init__(self):
        self.allowed_origins = [] if self.allowed_origins is None else self.allowed_origins
        self.allowed_methods = ["*"] if self.allowed_methods is None else self.allowed_methods
        self.allowed_headers = ["*"] if self.allowed_headers is None else self.allowed_headers
        self.middleware = [] if self.middleware is None else self.middleware
        self.default_chat_template_kwargs = dict(self.default_chat_template_kwargs or {})
        taken = sorted(set(CHAT_OWN_FIELDS) & self.default_chat_template_kwargs.keys())
        if taken:
            raise ConfigError("--default-chat-template-kwargs", f"{taken[0]!r} is a chat "
                              "request's own field, not a template variable")
        if self.api_server_count != 1:
            raise ConfigError("--api-server-count", f"one API server process is run, got "
                              f"{self.api_server_count}")
        self.middleware_objects()      # a bad import path fails before the model loads
        for flag in ("h11_max_header_count", "h11_max_incomplete_event_size"):
            if getattr(self, flag) < 1:
                raise ConfigError("--" + flag.replace("_", "-"), f"expected an integer >= 1, "
                                  f"got {getattr(self, flag)}")
        if self.sse_keep_alive_interval < 0:
            raise ConfigError("--sse-keep-alive-interval", "expected seconds >= 0 (0: no "
                              f"keep-alive comments), got {self.sse_keep_alive_interval}")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ConfigError("--enable-log-outputs", "needs --enable-log-requests, as in vLLM")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError("--max-log-len", f"expected an integer >= 0, got "
                              f"{self.max_log_len}")
        if self.root_path is not None and self.root_path and (
                not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError("--root-path", f"expected a path like /llm (a leading '/', no "
                              f"trailing one), got {self.root_path!r}")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ConfigError("--ssl-cert-reqs", f"expected 0, 1 or 2, got {self.ssl_cert_reqs}")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ConfigError("--ssl-certfile" if self.ssl_keyfile else "--ssl-keyfile",
                              "HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "log_config_file"):
            path = getattr(self, flag)
            if path and not os.path.isfile(path):
                raise ConfigError("--" + flag.replace("_", "-"), f"{path}: no such file")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ConfigError("--ssl-ca-certs", "needed to verify client certificates "
                              f"(--ssl-cert-reqs {self.ssl_cert_reqs})")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def middleware_objects(self) -> list:
        """--middleware's import paths, imported: ASGI middleware classes, or coroutine
        functions taking (request, call_next)."""
        found = []
        for path in self.middleware:
            module, _, name = path.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module), name) if module else None
            except (ImportError, AttributeError) as e:
                raise ConfigError("--middleware", f"cannot import {path!r}: {e}") from None
            if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
                raise ConfigError("--middleware", f"{path!r} is not an ASGI middleware class "
                                  "or an async function (module.name)")
            found.append(obj)
        return found

    @property
    def quiet_paths(self) -> frozenset:
        """--disable-access-log-for-endpoints as a set of paths."""
        text = self.disable_access_log_for_endpoints or ""
        return frozenset(p.strip() for p in text.split(",") if p.strip())

    def uvicorn_kwargs(self) -> dict:
        """What of these goes to ``uvicorn.Config``."""
        return dict(log_level=self.uvicorn_log_level,
                    access_log=not self.disable_uvicorn_access_log,
                    ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile,
                    ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=self.ssl_cert_reqs,
                    uds=self.uds, **({"ssl_ciphers": self.ssl_ciphers} if self.ssl_ciphers
                                     else {}),
                    **({"log_config": self.log_config_file} if self.log_config_file else {}))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FrontendArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if getattr(args, f.name, None) is not None})


def _json_list(text: str) -> list:
    """vLLM's form, a JSON list ('["*"]'); a bare word is taken as a list of one."""
    try:
        value = json.loads(text)
    except ValueError:
        value = [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (vLLM's flags)")
    hints = typing.get_type_hints(FrontendArgs)
    for f in dataclasses.fields(FrontendArgs):
        flag, extra = "--" + f.name.replace("_", "-"), dict(f.metadata["flag"])
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        if base is bool:     # vLLM's flags on by default take their --no- form
            group.add_argument(flag, dest=f.name, default=None, help=f.metadata["help"],
                               action=argparse.BooleanOptionalAction if f.default
                               else "store_true")
            continue
        if "json" in extra:
            extra["type"] = _json_list if extra.pop("json") is list else json_object
            extra["metavar"] = "JSON"
        elif extra.get("action") == "append":
            extra["type"], extra["metavar"] = str, "IMPORT_PATH"
        else:
            extra.setdefault("type", base)
            if "choices" not in extra:
                extra["metavar"] = f.name.upper()
        help = f.metadata["help"]
        if f.default not in (None, dataclasses.MISSING) and "default" not in help:
            help = f"{help} (default: {f.default})"
        group.add_argument(flag, dest=f.name, default=None, help=help, **extra)
