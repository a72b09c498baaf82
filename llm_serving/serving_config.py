"""The config file: llm-serving's YAML schema, accepted unchanged, plus our ``llm_serving:``
section beside it.

llm-serving's knobs that still mean something are mapped to engine arguments:
- ``model_config.decode_batch_size`` -> ``max_num_seqs`` (the largest entry);
- ``model_config.max_generate_length`` (else the largest ``seq_length``) -> ``max_model_len``;
- ``pa_config.num_blocks`` / ``block_size`` -> the KV pool;
- ``model_config.model_name`` -> the served model name;
- ``serving_config.server_ip`` / ``server_port`` -> where the server listens;
- ``serving_config.agent_ports`` -> ``tensor_parallel_size``: one WorkAgent per port (the
  port numbers themselves are unused: agents are local processes). An explicit
  ``tensor_parallel_size`` (``llm_serving:`` or ``--tensor-parallel-size``) wins over a single
  port and must equal the number of ports when there are several;
- ``serving_config.start_device_id`` -> ``start_device_id`` (agent rank r uses device
  start_device_id + r).

With no model (no ``llm_serving.model``, no ``--model``), ``model_config.model_cfg_path`` (a
mindformers model yaml, its ``load_checkpoint`` the weights) and ``tokenizer.vocab_file`` are
served, as llm-serving did: see mindformers_config.py. ``model_config.vocab_size`` must then
equal the mindformers yaml's, and ``model_config.end_token`` is the EOS.

The ``multi_stream:`` section sets multi-stream's knobs (``enabled: true`` is
``--enable-multi-stream``; the other keys are ``MultiStreamConfig``'s).

The ``kv_transfer:`` section is PD disaggregation's ``kv_transfer_config`` (vLLM's keys:
``kv_connector``, ``kv_role``, ``kv_connector_extra_config``; see
distributed/kv_transfer/config.py), the same as ``--kv-transfer-config '{json}'``.

The ``llm_serving:`` section takes every engine argument by its own name (see EngineArgs),
and wins over the legacy keys. The legacy keys that have no effect are named, with the reason,
in one warning line. A wrong type, or a missing key that llm-serving required in a section
that is present, is a ConfigError naming the key's path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llm_serving.config import EngineArgs, drop_no_effect_args
from llm_serving.errors import ConfigError

# Legacy keys we accept and ignore, and why (shown once, in the warning).
IGNORED = {
    "model_config.seq_length": "no padding buckets, batches are ragged; it only bounds "
                               "max_model_len when max_generate_length is absent",
    "model_config.zactivate_len": "no padding buckets, batches are ragged",
    "model_config.prefill_batch_size": "prefills are batched under max_num_batched_tokens",
    "model_config.model_type": "shapes are always dynamic",
    "model_config.seq_type": "shapes are always dynamic",
    "model_config.batch_waiting_time": "continuous batching never waits to fill a batch",
    "model_config.decode_batch_waiting_time": "continuous batching never waits to fill a batch",
    "model_config.batching_strategy": "batching is always continuous",
    "model_config.current_index": "not needed with a paged KV cache",
    "model_config.page_attention": "attention is always paged",
    "model_config.model_dtype": "the dtype is set by llm_serving.dtype: auto is float32, "
                                "bfloat16 stores linear weights in bf16 on CPU",
    "model_config.pad_token_id": "nothing is padded",
    "model_config.backend": "the model always runs kernel by kernel",
    "model_config.model_cfg_path": "llm_serving.model (or --model) is served instead",
    "model_config.end_token": "EOS comes from the model's generation_config.json",
    "model_config.vocab_size": "the vocabulary comes from the model's config.json",
    "serving_config.agent_ip": "agents are local processes",
    "serving_config.prefill_batch_waiting_time": "continuous batching never waits",
    "serving_config.decode_batch_waiting_time": "continuous batching never waits",
    "serving_config.enable_host_post_sampling": "sampling always runs on the host",
    "pa_config.decode_seq_length": "max_model_len bounds each sequence",
    "tokenizer": "the tokenizer comes from the model directory (or llm_serving.tokenizer)",
    "basic_inputs": "model inputs are built by the engine",
    "extra_inputs": "model inputs are built by the engine",
    "warmup_inputs": "model inputs are built by the engine",
    "model_path": "the ge backend's compiled graphs are not used",
}

_IntOrList = Union[int, list[int]]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=False)


_MAY_BE_EMPTY = ("seq_length", "zactivate_len")


class LegacyModelConfig(_Section):
    model_name: str
    max_generate_length: Optional[int] = Field(None, gt=0)
    end_token: _IntOrList
    seq_length: Optional[_IntOrList] = None
    vocab_size: int = Field(gt=0)
    prefill_batch_size: Optional[_IntOrList] = None
    decode_batch_size: Optional[_IntOrList] = None
    zactivate_len: Optional[_IntOrList] = None
    model_type: Optional[str] = None
    seq_type: Optional[str] = None
    batch_waiting_time: Optional[float] = None
    decode_batch_waiting_time: Optional[float] = None
    batching_strategy: Optional[str] = None
    current_index: Optional[bool] = None
    page_attention: Optional[bool] = None
    model_dtype: Optional[str] = None
    pad_token_id: Optional[int] = None
    backend: Optional[str] = None
    model_cfg_path: Optional[str] = None

    @field_validator("seq_length", "prefill_batch_size", "decode_batch_size", "zactivate_len")
    @classmethod
    def _sizes(cls, value, info):
        """A size, or a list of them (llm-serving's buckets; the largest is used). An empty
        seq_length is llm-serving's dynamic sequence length (its check_valid_config), and
        it took an empty zactivate_len too; the batch sizes it required non-empty."""
        sizes = value if isinstance(value, list) else [value]
        if value == [] and info.field_name in _MAY_BE_EMPTY:
            return value
        if value is not None and (not sizes or min(sizes) <= 0):
            raise ValueError("expected a positive integer or a non-empty list of them")
        return value


class LegacyServingConfig(_Section):
    agent_ports: list[int] = Field(min_length=1)
    start_device_id: int = Field(0, ge=0)
    server_ip: str = "127.0.0.1"
    server_port: int = Field(gt=0, lt=65536)
    agent_ip: Optional[str] = None
    prefill_batch_waiting_time: Optional[float] = None
    decode_batch_waiting_time: Optional[float] = None
    enable_host_post_sampling: Optional[bool] = None


class LegacyPAConfig(_Section):
    num_blocks: Optional[int] = Field(None, gt=0)
    block_size: Optional[int] = Field(None, gt=0)
    decode_seq_length: Optional[int] = None


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model_cfg: Optional[LegacyModelConfig] = Field(None, alias="model_config")
    serving_config: Optional[LegacyServingConfig] = None
    pa_config: Optional[LegacyPAConfig] = None
    tokenizer: Optional[dict[str, Any]] = None
    basic_inputs: Optional[dict[str, Any]] = None
    extra_inputs: Optional[dict[str, Any]] = None
    warmup_inputs: Optional[dict[str, Any]] = None
    model_path: Optional[dict[str, Any]] = None
    llm_serving: Optional[dict[str, Any]] = None
    multi_stream: Optional[dict[str, Any]] = None
    kv_transfer: Optional[dict[str, Any]] = None


# A config file's sections, as written in it (each a mapping)
CONFIG_FILE_SECTIONS = frozenset(f.alias or name for name, f in ConfigFile.model_fields.items())

@dataclass
class ServingConfig:
    engine_kwargs: dict                   # EngineArgs keyword arguments (model included)
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8835
    agent_ports: list = field(default_factory=lambda: [16002])
    start_device_id: int = 0
    ignored: dict = field(default_factory=dict)   # legacy key -> why it has no effect
    # Where the model came from, when not from llm_serving.model / --model: one line.
    model_source: Optional[str] = None
    # engine argument -> the legacy key it was read from (when that key's value is used)
    legacy_keys: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def named_as_in_file(self):
        """A ConfigError about an engine argument read from a legacy key names that key, the
        one in the user's file (``model_config.max_generate_length``, not max_model_len)."""
        try:
            yield
        except ConfigError as e:
            legacy = self.legacy_keys.get(e.key)
            if legacy is None:
                raise
            raise ConfigError(legacy, f"{e.problem} (read as {e.key})") from None

    def ignored_warning(self) -> Optional[str]:
        """One line: the ignored keys, grouped by why."""
        if not self.ignored:
            return None
        by_reason: dict[str, list[str]] = {}
        for key, why in self.ignored.items():
            by_reason.setdefault(why, []).append(key)
        return ("config: these llm-serving keys have no effect here: "
                + " | ".join(f"{', '.join(keys)}: {why}" for why, keys in by_reason.items()))


def _biggest(value):
    return max(value) if isinstance(value, list) else value


_TYPE_TAGS = {"int", "str", "float", "bool"}


def _error(e: ValidationError) -> ConfigError:
    err = e.errors()[0]
    # Drop pydantic's union-member tags ("int", "list[int]") from the path.
    parts = [str(p) for p in err["loc"]
             if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    loc = ".".join(parts).replace("model_cfg", "model_config")
    if err["type"] == "missing":
        return ConfigError(loc, "missing (llm-serving requires it in this section)")
    if err["type"] == "extra_forbidden":
        return ConfigError(loc, "unknown key")
    if err["type"] == "value_error":      # a validator's own words
        return ConfigError(loc, f"{err['ctx']['error']}, got {err.get('input')!r}")
    return ConfigError(loc, f"{err['msg'].lower()}, got {err.get('input')!r}")


def load_config(path: Optional[Path], overrides: Optional[dict] = None) -> ServingConfig:
    """Read a config file (none: every setting at its default); ``overrides`` (from CLI
    flags) win over it."""
    try:
        data = (yaml.safe_load(Path(path).read_text()) or {}) if path is not None else {}
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "expected a mapping of sections")
    try:
        cfg = ConfigFile.model_validate(data)
    except ValidationError as e:
        raise _error(e) from None

    kw: dict = {}
    out = ServingConfig(engine_kwargs=kw)
    legacy = out.legacy_keys
    mc, sc, pa = cfg.model_cfg, cfg.serving_config, cfg.pa_config
    if mc is not None:
        out.served_model_name = mc.model_name
        if mc.decode_batch_size is not None:
            kw["max_num_seqs"] = _biggest(mc.decode_batch_size)
            legacy["max_num_seqs"] = "model_config.decode_batch_size"
        if mc.max_generate_length is not None:
            kw["max_model_len"] = mc.max_generate_length
            legacy["max_model_len"] = "model_config.max_generate_length"
        elif mc.seq_length:
            kw["max_model_len"] = _biggest(mc.seq_length)
            legacy["max_model_len"] = "model_config.seq_length"
    if pa is not None:
        for key in ("num_blocks", "block_size"):
            if getattr(pa, key) is not None:
                kw[key] = getattr(pa, key)
                legacy[key] = f"pa_config.{key}"
    if sc is not None:
        out.host, out.port = sc.server_ip, sc.server_port
        out.agent_ports, out.start_device_id = list(sc.agent_ports), sc.start_device_id
        kw["start_device_id"] = sc.start_device_id
        legacy["start_device_id"] = "serving_config.start_device_id"
    if cfg.multi_stream is not None:
        knobs = dict(cfg.multi_stream)
        enabled = knobs.pop("enabled", None)
        if enabled is not None:
            if not isinstance(enabled, bool):
                raise ConfigError("multi_stream.enabled", f"expected true or false, got "
                                  f"{enabled!r}")
            kw["enable_multi_stream"] = enabled
        kw["multi_stream"] = knobs
    if cfg.kv_transfer is not None:
        kw["kv_transfer_config"] = dict(cfg.kv_transfer)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    if cfg.llm_serving:     # vLLM's no-effect arguments: one warning (a bad value refused)
        try:
            cfg.llm_serving = drop_no_effect_args(cfg.llm_serving, "config llm_serving")
        except ConfigError as e:
            raise ConfigError(f"llm_serving.{e.key}", e.problem) from None
    for key in cfg.llm_serving or {}:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"llm_serving.{key}", "unknown key" + (
                f" (did you mean {close[0]}?)" if close else " (python start.py --help lists "
                "the engine arguments, by the same names)"))
    kw.update(cfg.llm_serving or {})
    kw.update(overrides or {})
    for key in {**(cfg.llm_serving or {}), **(overrides or {})}:
        legacy.pop(key, None)           # the legacy key's value is not the one used
    if sc is not None and len(sc.agent_ports) > 1:
        if "tensor_parallel_size" not in kw:
            legacy["tensor_parallel_size"] = "serving_config.agent_ports"
        tp = kw.setdefault("tensor_parallel_size", len(sc.agent_ports))
        if tp != len(sc.agent_ports):
            key = ("--tensor-parallel-size" if "tensor_parallel_size" in (overrides or {})
                   else "llm_serving.tensor_parallel_size")
            raise ConfigError(key, f"{tp!r} conflicts with serving_config.agent_ports, which "
                              f"lists {len(sc.agent_ports)} ports (one WorkAgent each); make "
                              "them agree or give one port")
    used: set = set()       # legacy keys that name the model (model_cfg_path)
    if "model" not in kw:
        if mc is None or not mc.model_cfg_path:
            raise ConfigError("llm_serving.model", "missing: add llm_serving.model: <an HF "
                              "model directory> (or pass --model), or llm-serving's "
                              "model_config.model_cfg_path: <a mindformers model yaml> with "
                              "tokenizer.vocab_file: <its tokenizer.model>")
        from llm_serving.mindformers_config import materialize
        got = materialize(mc.model_cfg_path, model_name=mc.model_name,
                          vocab_size=mc.vocab_size, end_token=mc.end_token,
                          tokenizer=cfg.tokenizer, config_path=path,
                          need_tokenizer="tokenizer" not in kw,
                          need_checkpoint="checkpoint" not in kw)
        kw["model"] = got.model_dir
        if got.checkpoint is not None:
            kw["checkpoint"] = got.checkpoint
        out.model_source = got.describe()
        used = {"model_config.model_cfg_path", "model_config.end_token",
                "model_config.vocab_size"} | ({"tokenizer"} if "tokenizer" not in kw else set())
    for dotted, why in IGNORED.items():
        if dotted in used:
            continue
        section, _, key = dotted.partition(".")
        present = data.get(section)
        if (key and isinstance(present, dict) and key in present) or (not key and present):
            out.ignored[dotted] = why
    return out
