"""Command line: ``llm-serving serve --config FILE`` (also what ``start.py`` runs)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


from llm_serving.errors import ConfigError, LLMServingError
from llm_serving.serving_config import load_config

DEFAULT_CONFIG = "configs/llama/tiny_llama.yaml"
DEMO_PROMPTS = ["Give three tips for staying healthy.", "What is the capital of France?",
                "Write a haiku about the sea.", "Explain paged attention in one sentence."]


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
        from llm_serving.tiny_model import ensure_tiny_model
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
        else:
            group.add_argument(flag, dest=f.name, type=base, default=None,
                               metavar=f.name.upper(), help=f.metadata.get("help"))


def cli_engine_overrides(args: argparse.Namespace) -> dict:
    import dataclasses
    from llm_serving.config import EngineArgs
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if getattr(args, f.name, None) is not None}


def serve(args) -> None:
    from llm_serving import LLM, SamplingParams
    cfg = load_config(find_config(args.config), cli_engine_overrides(args))
    warning = cfg.ignored_warning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    kw = dict(cfg.engine_kwargs)
    model = resolve_model(kw.pop("model"))
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(DEMO_PROMPTS, params)
    dt = time.perf_counter() - t0
    for o in outs:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="llm-serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model from a config file")
    s.add_argument("--config", default=DEFAULT_CONFIG)
    s.add_argument("--max-tokens", type=int, default=32)
    add_engine_arguments(s)
    args = parser.parse_args(argv)
    try:
        serve(args)
    except (LLMServingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
