"""Command line: ``llm-serving serve --config FILE`` (also what ``start.py`` runs), and
``llm-serving tune`` (``llm_serving/tune/``)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from llm_serving.cli_args import (DEFAULT_CONFIG, STOP_WITH_PARENT_ENV,  # noqa: F401
                                  REQUEST_READ_TIMEOUT_S, RESPONSE_WRITE_TIMEOUT_S,
                                  SHUTDOWN_TIMEOUT_S,
                                  add_engine_arguments,
                                  cli_engine_overrides, json_object, resolve_model,
                                  serve_config)
from llm_serving.errors import ConfigError, LLMServingError, ModelLoadError
from llm_serving.logging_config import configure_logging
from llm_serving import vllm_env
from llm_serving.cli_argv import vllm_argv
from llm_serving.serving_config import CONFIG_FILE_SECTIONS, load_config

def server_settings(args) -> tuple:
    """(EngineArgs, served model name, host, port) from the config file and the flags."""
    return _settings(args)[1:]


def _settings(args) -> tuple:
    """(the loaded config file, EngineArgs, served model name, host, port)."""
    from llm_serving.config import EngineArgs
    tag = getattr(args, "model_tag", None)      # vLLM's `vllm serve MODEL` form
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ConfigError("--model", f"two models given: {tag!r} and --model "
                              f"{args.model!r}")
        args.model = tag
    cfg = load_config(serve_config(args), cli_engine_overrides(args))
    warning = cfg.ignored_warning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.model_source:    # llm-serving's model_cfg_path, served from a directory written for it
        logging.getLogger("llm_serving.server").info(cfg.model_source)
    kw = dict(cfg.engine_kwargs)
    # The model runs in WorkAgent processes (tensor_parallel_size of them, one per
    # serving_config.agent_ports entry unless given), as llm-serving's agents did.
    kw.setdefault("distributed_executor_backend", "mp")
    kw["model"] = resolve_model(kw["model"])
    with cfg.named_as_in_file():
        engine_args = EngineArgs(**kw)
    # As vLLM, a --model is served under the name it was given (a path, or an HF-style id);
    # a config file's model under its model_config.model_name.
    name = (args.served_model_name or getattr(args, "model", None) or cfg.served_model_name
            or Path(kw["model"]).name)
    host = args.host or cfg.host
    port = args.port if args.port is not None else cfg.port
    return cfg, engine_args, name, host, port


def serve(args) -> None:
    from llm_serving.entrypoints.api_server import run_server
    from llm_serving.entrypoints.frontend_args import FrontendArgs
    cfg, engine_args, name, host, port = _settings(args)
    frontend = FrontendArgs.from_args(args)     # a bad TLS file or root path: before loading
    if frontend.enable_per_request_metrics and args.disable_log_stats:    # vLLM's check
        raise ConfigError("--enable-per-request-metrics", "requires engine statistics "
                          "logging; remove --disable-log-stats to enable per-request metrics")
    # Resolved once here (the model's config.json read, the KV pool sized), so a missing
    # model or an impossible setting fails before anything starts. The engine resolves them
    # again: give it the sizes decided here (the same values, and no second warning).
    with cfg.named_as_in_file():
        resolved = engine_args.create_engine_config()
    engine_args = dataclasses.replace(engine_args, num_blocks=resolved.cache.num_blocks,
                                      max_model_len=resolved.model.max_model_len)
    from llm_serving.config import describe_kv_cache
    if args.dry_run:    # what would be launched (devices, environment, commands), then exit
        from llm_serving.executor.launch_plan import print_plan
        print(describe_kv_cache(resolved))
        print(f"model: {engine_args.model}" + (f"; checkpoint: {engine_args.checkpoint}"
                                               if engine_args.checkpoint else ""))
        return print_plan(resolved)
    logging.getLogger("llm_serving.server").info(describe_kv_cache(resolved))
    # SIGTERM, like Ctrl-C, drains and stops the server (--shutdown-timeout), then exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    stop_with = os.environ.get(STOP_WITH_PARENT_ENV)
    if stop_with:       # a process that started us in a session of our own (llm-serving tune)
        from llm_serving.executor.worker import watch_parent
        watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM), int(stop_with))
    if args.log_stats_interval is None:
        args.log_stats_interval = vllm_env.log_stats_interval()
    if args.log_stats_interval <= 0:
        raise ConfigError("--log-stats-interval", f"expected seconds > 0, got "
                          f"{args.log_stats_interval} (--disable-log-stats turns the line off)")
    if args.shutdown_timeout < 0:
        raise ConfigError("--shutdown-timeout", f"expected seconds >= 0, got "
                          f"{args.shutdown_timeout}")
    _check_client_bounds(args)
    try:
        run_server(engine_args, name, host, port, api_key=args.api_key,
                   chat_template=engine_args.chat_template,
                   log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
                   shutdown_timeout=args.shutdown_timeout,
                   request_read_timeout=args.request_read_timeout,
                   response_write_timeout=args.response_write_timeout,
                   frontend=frontend)
    except KeyboardInterrupt:     # Ctrl-C, raised again once the server stopped
        code = 0
    except SystemExit as e:       # SIGTERM's handler (0); uvicorn's when it cannot listen
        code = e.code
    else:
        code = 0
    _exit_stopped_server(code)


def _exit_stopped_server(code) -> None:
    """Exit with ``code`` (as ``sys.exit``) once the server has stopped (the WorkAgents
    gone, the shared memory and the socket freed): the exit handlers run, but not the
    interpreter's teardown, which takes 1-3 s with MindSpore's modules loaded, time a service
    manager's stop (docker stop: 10 s in all) does not have."""
    import atexit
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()       # finalizers of anything left, logging's flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model from a config file")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model directory, as --model (vLLM's `vllm serve MODEL` form)")
    s.add_argument("--config", default=None,
                   help="llm-serving YAML (a path, or a name under configs/); default: none "
                        f"with --model (the engine's defaults), else {DEFAULT_CONFIG}")
    s.add_argument("--host", default=None,
                   help="address to listen on (default: the config's server_ip, 127.0.0.1)")
    s.add_argument("--port", type=int, default=None,
                   help="port (default: the config's server_port, 8835)")
    s.add_argument("--api-key", default=None, nargs="+", metavar="KEY",
                   help="require 'Authorization: Bearer KEY', one of these keys (also "
                        "$LLM_SERVING_API_KEY, or vLLM's $VLLM_API_KEY)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: --model as given, as vLLM; "
                        "else the config's model_config.model_name)")
    s.add_argument("--log-level", default=None,
                   choices=["debug", "info", "warning", "error"],
                   help="log level (default info); debug also prints the traceback of a "
                        "start-up error")
    s.add_argument("--logging-config", type=json_object, default=None, metavar="JSON",
                   help="vLLM's logging settings: log_level (--log-level wins), formatter "
                        "(text or json: a JSON object a line), configure_logging (false: "
                        "leave Python's logging as it is), pylogging_config_file (a "
                        "dictConfig JSON file)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (prompt and generation tok/s, running and "
                        "waiting requests, KV cache usage), as vLLM's flag")
    s.add_argument("--log-stats-interval", type=float, default=None,
                   help="seconds between stats lines (default: $VLLM_LOG_STATS_INTERVAL, "
                        "else 10)")
    s.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C, seconds the requests in flight may take to "
                        "finish (vLLM's flag); then they end with a 503 or a stream error "
                        "event 'the server is shutting down'; 0: at once (default "
                        f"{SHUTDOWN_TIMEOUT_S:g}). The whole stop takes at most this + 7 s "
                        "(usually + under 1 s): give docker stop -t or "
                        "terminationGracePeriodSeconds at least that")
    _add_client_bounds(s)
    from llm_serving.entrypoints.frontend_args import add_frontend_arguments
    add_frontend_arguments(s)
    s.add_argument("--dry-run", action="store_true",
                   help="print the processes that would be launched (rank -> device, "
                        "environment, command lines) and exit without starting them")
    add_engine_arguments(s)
    add_proxy_parser(sub)
    from llm_serving.tune.cli import add_tune_parser
    add_tune_parser(sub)
    return parser


def _add_client_bounds(parser) -> None:
    """The timeouts of a server's client side (entrypoints/connections.py): serve's and the
    proxy's."""
    parser.add_argument("--request-read-timeout", type=float, default=REQUEST_READ_TIMEOUT_S,
                        help="seconds a client may take to send a whole request (head and "
                             "body) once connected; then the connection is closed (default "
                             f"{REQUEST_READ_TIMEOUT_S:g})")
    parser.add_argument("--response-write-timeout", type=float,
                        default=RESPONSE_WRITE_TIMEOUT_S,
                        help="seconds a client may go without reading a response being sent "
                             "to it (a stream it stopped reading); then the connection is "
                             "closed and the request aborted (default "
                             f"{RESPONSE_WRITE_TIMEOUT_S:g})")


def _check_client_bounds(args) -> None:
    for flag in ("request_read_timeout", "response_write_timeout"):
        if getattr(args, flag) <= 0:
            raise ConfigError("--" + flag.replace("_", "-"), f"expected seconds > 0, got "
                              f"{getattr(args, flag)}")


def add_proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="PD disaggregation: one endpoint in front of prefill and "
                       "decode instances (docs/pd_disaggregation.md)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill (kv_producer) instances, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode (kv_consumer) instances")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    p.add_argument("--order", choices=["p-first", "d-first"], default="p-first",
                   help="p-first: the proxy asks P, then D with P's kv_transfer_params; "
                        "d-first: D asks P itself (remote_prefill_url)")
    p.add_argument("--policy", choices=["round-robin", "least-loaded"], default="round-robin",
                   help="how an instance of each role is chosen (least-loaded: fewest "
                        "requests in flight through this proxy)")
    p.add_argument("--on-prefill-failure", choices=["recompute", "fail"], default="recompute",
                   help="P unreachable or failing mid-request (p-first), or no P up: D "
                        "computes the prompt itself, or the client gets an error")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds an instance may take to send the next bytes of an answer")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between /ready checks of every instance (one loading, "
                        "restarting its model or draining for a shutdown is out of rotation)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="bound on the connections to the instances (all together); the "
                        "proxy takes at most this many + 128 from clients (fewer under a "
                        "low open-file limit)")
    _add_client_bounds(p)
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])


def remedy(e: Exception) -> Optional[str]:
    """What the user can do about a known start-up error, or None."""
    if isinstance(e, ModelLoadError) and "does not exist" in str(e):
        return ("set llm_serving.model in the config to an HF model directory, or pass "
                "--model DIR; `python start.py` alone serves the built-in tiny model")
    return None


def parse_args(argv) -> argparse.Namespace:
    """The command line, vLLM's forms of it included (cli_argv.py)."""
    parser = build_parser()
    return parser.parse_args(vllm_argv(list(argv), parser, CONFIG_FILE_SECTIONS))


def main(argv=None) -> None:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        level = configure_logging(args.log_level, getattr(args, "logging_config", None))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.environ["LLM_SERVING_LOG_LEVEL"] = level    # for the WorkAgents
    try:
        if args.command == "proxy":
            from llm_serving.proxy.server import run_proxy
            _check_client_bounds(args)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            return run_proxy(args)
        if args.command == "tune":
            from llm_serving.tune.cli import run_tune
            sys.exit(run_tune(args))
        serve(args)
    except KeyboardInterrupt:
        pass
    except (LLMServingError, ValueError) as e:
        # A user's error: one line, and what to do about it. The traceback only on request.
        if level == "DEBUG":
            import traceback
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        hint = remedy(e)
        if hint:
            print(f"  remedy: {hint}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
