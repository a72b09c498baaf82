"""The engine's command-line arguments and config-file lookup, shared by every subcommand
(``serve``, ``tune``, ``proxy``): one flag per EngineArgs field, the overrides they make, where
a ``--config`` name is found, and what ``--model builtin:`` means."""
from __future__ import annotations

import argparse
from pathlib import Path

from llm_serving.errors import ConfigError

DEFAULT_CONFIG = "configs/llama/tiny_llama.yaml"
# The HTTP server's bounds that are flags of `serve` (entrypoints/api_server.py, connections.py)
SHUTDOWN_TIMEOUT_S = 5.0        # --shutdown-timeout: the drain window on SIGTERM / Ctrl-C
REQUEST_READ_TIMEOUT_S = 30.0   # --request-read-timeout: to send a whole request
RESPONSE_WRITE_TIMEOUT_S = 60.0  # --response-write-timeout: to read on, once a response stalls


def find_config(name: str) -> Path:
    """A path, or a bare file name looked up under configs/ (as llm-serving users pass it)."""
    root = Path(__file__).resolve().parents[1]
    for candidate in (Path(name), root / name, root / "configs" / name,
                      *sorted((root / "configs").glob(f"*/{name}"))):
        if candidate.is_file():
            return candidate
    raise ConfigError("--config", f"file {name!r} not found (looked in . and configs/)")


# Set to a pid by a process that starts the server in a session of its own (llm-serving tune's
# trial servers): the server stops (SIGTERM: drains, frees its shared memory) when that process
# dies, which no signal to the starter's process group would tell it.
STOP_WITH_PARENT_ENV = "LLM_SERVING_STOP_WITH_PARENT"


def serve_config(args: argparse.Namespace) -> "Path | None":
    """The config file ``serve`` reads: ``--config``'s; none when only ``--model`` is given
    (the engine's own defaults, as ``vllm serve MODEL`` has; the tiny model's file sizes its
    KV pool and batch for the tiny model); the built-in tiny default when neither is."""
    if args.config is not None:
        return find_config(args.config)
    if getattr(args, "model", None) is not None:
        return None
    return find_config(DEFAULT_CONFIG)


def resolve_model(model: str) -> str:
    if model.startswith("builtin:"):
        from llm_serving.model_executor.tiny_model import builtin_model
        return builtin_model(model[len("builtin:"):])
    return model


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per engine argument (``--max-num-seqs``, ``--enable-prefix-caching`` ...),
    generated from EngineArgs so the CLI, the YAML and LLM(...) take the same knobs."""
    import dataclasses
    import typing
    from llm_serving.config import VLLM_NO_EFFECT_ARGS, EngineArgs
    group = parser.add_argument_group("engine arguments (override the config file)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        args = typing.get_args(kind)
        base = next((a for a in args if a is not type(None)), kind) if args else kind
        # the flag's own default is None (unset: the config file's value stands); the help
        # shows the engine's
        help = f.metadata.get("help")
        if help and "default" not in help and f.default not in (None, dataclasses.MISSING):
            shown = ("on" if f.default else "off") if base is bool else f.default
            help = f"{help} (default: {shown})"
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help)
        elif f.metadata.get("cli_nargs"):    # several values after one flag (vLLM's)
            group.add_argument(flag, dest=f.name, nargs=f.metadata["cli_nargs"], default=None,
                               metavar=f.name.upper(), help=help)
        elif base is dict:          # a section of knobs, as JSON: '{"min_total_tokens": 64}'
            group.add_argument(flag, dest=f.name, type=json_object, default=None,
                               metavar="JSON", help=help)
        else:
            parse = (human_readable_int if f.metadata.get("cli_type") == "human_readable_int"
                    else base)
            group.add_argument(flag, *filter(None, [f.metadata.get("cli_alias")]),
                               dest=f.name, type=parse, default=None,
                               metavar=f.name.upper(), help=help)
    # vLLM's flags that mean nothing here: taken, with a warning (cli_engine_overrides)
    for name, spec in VLLM_NO_EFFECT_ARGS.items():
        kind = json_object if spec.type is dict else spec.type
        group.add_argument("--" + name.replace("_", "-"), *([spec.alias] if spec.alias else []),
                           dest=name, default=None,
                           **({"type": kind, "metavar": name.upper(), "nargs": spec.nargs}
                              if spec.type else {"action": argparse.BooleanOptionalAction}),
                           help=f"vLLM's flag, taken for its command lines; no effect: "
                           f"{spec.why}" + (f" (only {' or '.join(map(str, spec.allowed))})"
                                            if spec.allowed else ""))


def human_readable_int(text: str) -> int:
    """vLLM's: '1k' is 1000, '1K' 1024 (m/M, g/G, t/T alike), '25.6k' 25600; else an int."""
    import re
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if match:
        number, suffix = match.groups()
        power = "kmgt".index(suffix.lower()) + 1
        return int(float(number) * (2 ** (10 * power) if suffix.isupper() else 10 ** (3 * power)))
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, e.g. 4294967296 or 4G, got "
                                         f"{text!r}") from None


def json_object(text: str) -> dict:
    """A flag's JSON object value ('{"min_total_tokens": 64}')."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def cli_engine_overrides(args: argparse.Namespace) -> dict:
    """The engine arguments given on the command line (warning of vLLM's no-effect ones)."""
    import dataclasses
    from llm_serving.config import VLLM_NO_EFFECT_ARGS, EngineArgs, drop_no_effect_args
    drop_no_effect_args({k: getattr(args, k) for k in VLLM_NO_EFFECT_ARGS
                         if getattr(args, k, None) is not None}, "the command line")
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if getattr(args, f.name, None) is not None}
