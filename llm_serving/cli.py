"""Command line: ``llm-serving serve --config FILE`` (also what ``start.py`` runs), and
``llm-serving tune`` (``llm_serving/tune/``)."""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Optional

from llm_serving.errors import ConfigError, LLMServingError, ModelLoadError
from llm_serving.serving_config import load_config

DEFAULT_CONFIG = "configs/llama/tiny_llama.yaml"


def find_config(name: str) -> Path:
    """A path, or a bare file name looked up under configs/ (as llm-serving users pass it)."""
    root = Path(__file__).resolve().parents[1]
    for candidate in (Path(name), root / name, root / "configs" / name,
                      *sorted((root / "configs").glob(f"*/{name}"))):
        if candidate.is_file():
            return candidate
    raise ConfigError("--config", f"file {name!r} not found (looked in . and configs/)")


def resolve_model(model: str) -> str:
    if model.startswith("builtin:"):
        from llm_serving.model_executor.tiny_model import ensure_tiny_model
        return ensure_tiny_model()
    return model


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per engine argument (``--max-num-seqs``, ``--enable-prefix-caching`` ...),
    generated from EngineArgs so the CLI, the YAML and LLM(...) take the same knobs."""
    import dataclasses
    import typing
    from llm_serving.config import EngineArgs
    group = parser.add_argument_group("engine arguments (override the config file)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        args = typing.get_args(kind)
        base = next((a for a in args if a is not type(None)), kind) if args else kind
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=f.metadata.get("help"))
        elif base is dict:          # a section of knobs, as JSON: '{"min_total_tokens": 64}'
            group.add_argument(flag, dest=f.name, type=_json_object, default=None,
                               metavar="JSON", help=f.metadata.get("help"))
        else:
            group.add_argument(flag, dest=f.name, type=base, default=None,
                               metavar=f.name.upper(), help=f.metadata.get("help"))


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def cli_engine_overrides(args: argparse.Namespace) -> dict:
    import dataclasses
    from llm_serving.config import EngineArgs
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if getattr(args, f.name, None) is not None}


def server_settings(args) -> tuple:
    """(EngineArgs, served model name, host, port) from the config file and the flags."""
    from llm_serving.config import EngineArgs
    cfg = load_config(find_config(args.config), cli_engine_overrides(args))
    warning = cfg.ignored_warning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    kw = dict(cfg.engine_kwargs)
    # The model runs in WorkAgent processes (tensor_parallel_size of them, one per
    # serving_config.agent_ports entry unless given), as llm-serving's agents did.
    kw.setdefault("distributed_executor_backend", "mp")
    kw["model"] = resolve_model(kw["model"])
    engine_args = EngineArgs(**kw)
    name = args.served_model_name or cfg.served_model_name or Path(kw["model"]).name
    host = args.host or cfg.host
    port = args.port if args.port is not None else cfg.port
    return engine_args, name, host, port


def serve(args) -> None:
    from llm_serving.entrypoints.api_server import run_server
    engine_args, name, host, port = server_settings(args)
    # Resolved once here (the model's config.json read, the KV pool sized), so a missing
    # model or an impossible setting fails before anything starts. The engine resolves them
    # again: give it the sizes decided here (the same values, and no second warning).
    resolved = engine_args.create_engine_config()
    engine_args = dataclasses.replace(engine_args, num_blocks=resolved.cache.num_blocks,
                                      max_model_len=resolved.model.max_model_len)
    if args.dry_run:    # what would be launched (devices, environment, commands), then exit
        from llm_serving.executor.launch_plan import print_plan; return print_plan(resolved)  # noqa: E702
    # SIGTERM, like Ctrl-C, drains and stops the server, then exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_server(engine_args, name, host, port, api_key=args.api_key,
               chat_template=engine_args.chat_template)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model from a config file")
    s.add_argument("--config", default=DEFAULT_CONFIG)
    s.add_argument("--host", default=None,
                   help="address to listen on (default: the config's server_ip, 127.0.0.1)")
    s.add_argument("--port", type=int, default=None,
                   help="port (default: the config's server_port, 8835)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (also $LLM_SERVING_API_KEY)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: model_config.model_name)")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="log level; debug also prints the traceback of a start-up error")
    s.add_argument("--dry-run", action="store_true",
                   help="print the processes that would be launched (rank -> device, "
                        "environment, command lines) and exit without starting them")
    add_engine_arguments(s)
    add_proxy_parser(sub)
    from llm_serving.tune.cli import add_tune_parser
    add_tune_parser(sub)
    return parser


def add_proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="PD disaggregation: one endpoint in front of prefill and "
                       "decode instances (docs/pd_disaggregation.md)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill (kv_producer) instances, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode (kv_consumer) instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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
                   help="seconds between /health checks of every instance")
    p.add_argument("--max-connections", type=int, default=256,
                   help="bound on the connections to the instances (all together)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])


def remedy(e: Exception) -> Optional[str]:
    """What the user can do about a known start-up error, or None."""
    if isinstance(e, ModelLoadError) and "does not exist" in str(e):
        return ("set llm_serving.model in the config to an HF model directory, or pass "
                "--model DIR; `python start.py` alone serves the built-in tiny model")
    return None


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import logging
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "proxy":
            from llm_serving.proxy.server import run_proxy
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
        if args.log_level == "debug":
            import traceback
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        hint = remedy(e)
        if hint:
            print(f"  remedy: {hint}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
