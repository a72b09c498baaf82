"""vLLM's command-line conventions, applied to the arguments before they are parsed, so that a
``vllm serve`` command line or launch script runs unchanged (vLLM's ``FlexibleArgumentParser``
does the same):

- a flag's name may use underscores: ``--max_num_seqs 8`` is ``--max-num-seqs 8``;
- a dict flag may be given key by key: ``--speculative-config.method ngram
  --speculative-config.num_speculative_tokens 3`` is ``--speculative-config
  '{"method": "ngram", "num_speculative_tokens": 3}'`` (each value read as JSON, else as a
  number with a k/m/g suffix, else as text; ``--x.y+ a,b`` is the list ``["a", "b"]``);
- ``--config FILE.yaml`` may be vLLM's kind of file, flags as keys (``port: 8000``,
  ``max-num-seqs: 8``, ``enable-prefix-caching: false``, a nested mapping for a dict flag):
  its flags go in after the subcommand (and the model), so the command line's own win. A file
  whose keys include an llm-serving section (``serving_config``, ``model_config``,
  ``llm_serving``, ...) is llm-serving's config and stays ``--config``.
"""
from __future__ import annotations

import json
import re
from argparse import ArgumentParser, ArgumentTypeError
from pathlib import Path

import yaml

from llm_serving.cli_args import human_readable_int
from llm_serving.errors import ConfigError

_NAME = re.compile(r"(?<=^--)[^.=]*")     # a flag's name: after --, up to a '.' or '='


def vllm_argv(argv: list[str], parser: ArgumentParser, sections: frozenset) -> list[str]:
    """``argv`` (subcommand first) with vLLM's forms turned into this parser's; ``sections``:
    the top-level keys of an llm-serving config file (each a mapping there)."""
    argv = [_NAME.sub(lambda m: m.group(0).replace("_", "-"), a, count=1)
            if a.startswith("--") else a for a in argv]
    argv = _expand_config(argv, parser, sections)
    return _merge_dotted(argv)


def _expand_config(argv: list[str], parser: ArgumentParser, sections: frozenset) -> list[str]:
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if len(at) != 1:
        return argv       # none, or several: argparse takes the last, as it always did
    i = at[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            return argv   # argparse names the missing value
        path, end = argv[i + 1], i + 2
    else:
        path, end = argv[i].split("=", 1)[1], i + 1
    data = _read_yaml(path)
    if (not isinstance(data, dict) or not data
            or any(isinstance(v, dict) and k in sections for k, v in data.items())):
        return argv       # llm-serving's config (or not YAML): --config as it was
    flags = _config_flags(data, _subparser(parser, argv[0]))
    # after the subcommand and a model given first; before the rest, which wins
    first = 2 if len(argv) > 1 and not argv[1].startswith("-") else 1
    return argv[:first] + flags + argv[first:i] + argv[end:]


def _read_yaml(path: str):
    p = Path(path)
    if p.suffix not in (".yaml", ".yml") or not p.is_file():
        return None
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError("--config", f"{path} is not valid YAML: {e}") from None


def _subparser(parser: ArgumentParser, command: str) -> ArgumentParser:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction" and command in action.choices:
            return action.choices[command]
    return parser


def _config_flags(data: dict, parser: ArgumentParser) -> list[str]:
    """vLLM's reading of a --config file: ``key: true`` is the switch, ``false`` its --no-
    form (nothing when it has none), a list the flag's values, a mapping its JSON."""
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            no = "--no-" + flag[2:]
            if value:
                flags.append(flag)
            elif no in parser._option_string_actions:
                flags.append(no)
        elif isinstance(value, list):
            if value:
                flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _merge_dotted(argv: list[str]) -> list[str]:
    """``--x.a.b v`` flags merged into one ``--x '{"a": {"b": v}}'`` per x, placed last."""
    out: list[str] = []
    merged: dict[str, dict] = {}
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if not (arg.startswith("--") and "." in name):
            out.append(arg)
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            value, skip = argv[i + 1], True
        else:
            raise ConfigError(name, "expected a value")
        if name.endswith("+"):
            name, parsed = name[:-1], value.split(",")
        else:
            parsed = _value(value)
        flag, *keys = name.split(".")
        if not all(keys):
            raise ConfigError(name, "expected --flag.key[.key...] (vLLM's dotted form)")
        node = merged.setdefault(flag, {})
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(name, f"{key} is given both as a value and as keys")
        node[keys[-1]] = parsed
    for flag, value in merged.items():
        out += [flag, json.dumps(value)]
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return human_readable_int(text)
    except (ValueError, ArgumentTypeError):
        return text
