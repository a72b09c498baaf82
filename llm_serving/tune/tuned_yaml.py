"""The file ``llm-serving tune`` writes: the base config file with the chosen engine arguments
put in, in llm-serving's own keys where they exist, and a comment header saying what was
measured, on which CPU and when. ``start.py --config`` takes it unchanged, and
``load_config`` of it gives back the chosen engine arguments.

Where each engine argument goes:
- ``max_num_seqs`` -> ``model_config.decode_batch_size: [N]`` (when the file has model_config);
- ``num_blocks`` / ``block_size`` -> ``pa_config`` (when the file has pa_config);
- everything else -> the ``llm_serving:`` section, by its own name.
A key written to a legacy section is taken out of ``llm_serving:`` (which would win over it).
"""
from __future__ import annotations

import copy
import datetime
import os
from pathlib import Path
from typing import Any

import yaml

from llm_serving.cpu_info import cpu_description  # noqa: F401 (the header names the CPU)
from llm_serving.errors import ConfigError

LEGACY_HOME = {"max_num_seqs": ("model_config", "decode_batch_size"),
               "num_blocks": ("pa_config", "num_blocks"),
               "block_size": ("pa_config", "block_size")}


class _Dumper(yaml.SafeDumper):
    """Sections as blocks, lists inline (``decode_batch_size: [128]``), as llm-serving's
    files are written."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence(
    "tag:yaml.org,2002:seq", v, flow_style=True))


def read_base(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "expected a mapping of sections")
    return data


def apply_engine_kwargs(base: dict, kwargs: dict[str, Any]) -> dict:
    """A copy of ``base`` (a parsed config file) that loads with ``kwargs`` as its engine
    arguments."""
    data = copy.deepcopy(base)
    ours = dict(data.get("llm_serving") or {})
    for key, value in kwargs.items():
        section, legacy = LEGACY_HOME.get(key, (None, None))
        if section is not None and isinstance(data.get(section), dict):
            data[section][legacy] = [value] if legacy == "decode_batch_size" else value
            ours.pop(key, None)
        else:
            ours[key] = value
    data["llm_serving"] = ours
    return data


def write_tuned_yaml(path: Path, base: dict, kwargs: dict[str, Any], header: list[str]) -> None:
    """Write the config file; ``header`` lines become ``#`` comments at its top."""
    data = apply_engine_kwargs(base, kwargs)
    lines = [f"# {h}".rstrip() for h in header]
    text = "\n".join(lines) + "\n" + yaml.dump(data, Dumper=_Dumper, sort_keys=False,
                                                 default_flow_style=False)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)        # never a half-written file, even on a second Ctrl-C


def header_lines(*, base_path, objective, workload: str, best: str, trials: str,
                 interrupted: bool) -> list[str]:
    return [f"Written by `llm-serving tune` on {datetime.date.today().isoformat()} from "
            f"{base_path}.",
            f"CPU: {cpu_description()}.",
            f"Objective: {objective.name} ({objective.direction}, {objective.unit})"
            + (f", SLOs {' '.join(objective.slo)}" if objective.slo else "") + ".",
            f"Workload per trial: {workload}.",
            f"Trials: {trials}" + (" (interrupted by Ctrl-C: the best so far)." if interrupted
                                   else "."),
            f"Best: {best}.",
            "Timings depend on the machine and its load; re-tune on the machine you serve on."]
