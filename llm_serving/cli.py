"""Command line: ``llm-serving serve --config FILE`` (also what ``start.py`` runs)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from llm_serving.errors import ConfigError, LLMServingError

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


def engine_kwargs_from_config(path: Path, overrides: Optional[dict] = None) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "expected a mapping of sections")
    ours = dict(data.get("llm_serving") or {})
    mc = data.get("model_config") or {}
    pa = data.get("pa_config") or {}
    kw = {}
    if "decode_batch_size" in mc:
        dbs = mc["decode_batch_size"]
        kw["max_num_seqs"] = max(dbs) if isinstance(dbs, list) else dbs
    if "max_generate_length" in mc:
        kw["max_model_len"] = mc["max_generate_length"]
    for key in ("num_blocks", "block_size"):
        if key in pa:
            kw[key] = pa[key]
    kw.update(ours)
    kw.update(overrides or {})
    if "model" not in kw:
        raise ConfigError("llm_serving.model", "missing: the model directory to serve "
                          "(or pass --model)")
    return kw


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
    kw = engine_kwargs_from_config(find_config(args.config), cli_engine_overrides(args))
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
