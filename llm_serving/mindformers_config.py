"""The model llm-serving's config named, served as it would have been:
``model_config.model_cfg_path`` (a mindformers model yaml: the dimensions in
``model.model_config``, the weights in ``load_checkpoint``) and ``tokenizer.vocab_file`` (a
sentencepiece ``tokenizer.model``, or a ``tokenizer.json``), used when the config names no
model (no ``llm_serving.model``, no ``--model``).

The engine reads HF-layout model directories, so one is written under
``$LLM_SERVING_HOME/models/mindformers/<model_name>-<hash>``: a ``config.json`` from the
mindformers yaml, a ``generation_config.json`` (``model_config.end_token`` as EOS) and links to
the tokenizer file (and the ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it,
if any). The hash is of what is written, so a changed yaml gets a new directory, and the same
one is reused; it is written in a temporary directory and renamed into place, so two starts
never see half of it. The weights are read from the ``.ckpt`` in place (``checkpoint``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import yaml

from llm_serving.errors import ConfigError, ModelLoadError
from llm_serving.home import home_dir

CFG_KEY = "model_config.model_cfg_path"
VOCAB_KEY = "tokenizer.vocab_file"
# Beside a tokenizer file, these describe it (special tokens, BOS/EOS flags, chat template).
_TOKENIZER_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class MindformersModel:
    model_dir: str                 # the HF-layout directory written for the engine
    checkpoint: Optional[str]      # the .ckpt to load (None: the caller gave its own)
    yaml_path: str                 # the mindformers yaml it came from

    def describe(self) -> str:
        return (f"model: {self.model_dir} (from {CFG_KEY} {self.yaml_path}"
                + (f"; checkpoint {self.checkpoint}" if self.checkpoint else "") + ")")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _locate(value: str, bases: Sequence[Path]) -> Path:
    """An absolute path as it is; a relative one under the first base where it exists (else
    under the first base, for the error message)."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p
    for base in bases:
        if (base / p).exists():
            return (base / p).absolute()
    return (bases[0] / p).absolute()


def _read_mindformers_yaml(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise ConfigError(CFG_KEY, f"file {str(path)!r} does not exist (expected a mindformers "
                          "model yaml with model.model_config; or serve an HF directory with "
                          "llm_serving.model or --model)")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(CFG_KEY, f"{path}: not valid YAML ({_one_line(e)})") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("model_config"), dict):
        raise ConfigError(CFG_KEY, f"{path}: not a mindformers model yaml (expected a mapping "
                          "at model.model_config)")
    return doc


def _model_config(doc: Mapping[str, Any], path: Path):
    from llm_serving.model_executor.loader import ModelConfig
    try:
        return ModelConfig.from_mindformers_doc(doc, path)
    except ModelLoadError as e:          # its message starts with the file's path
        raise ConfigError(CFG_KEY, _one_line(e)) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(CFG_KEY, f"{path}: model.model_config: {_one_line(e)}") from None


def _single_ckpt(d: Path, key: str, yaml_path: Path) -> Path:
    """The one .ckpt in ``d`` or in its ``rank_*`` subdirectories (how mindformers lays out a
    checkpoint directory)."""
    found = sorted(d.glob("*.ckpt")) + sorted(d.glob("rank_*/*.ckpt"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(key, f"directory {str(d)!r} (in {yaml_path}) holds no .ckpt file, nor "
                          "do its rank_*/ subdirectories; name the model's .ckpt file")
    names = ", ".join(str(p.relative_to(d)) for p in found[:4]) + (", ..." if len(found) > 4
                                                                  else "")
    raise ConfigError(key, f"directory {str(d)!r} (in {yaml_path}) holds {len(found)} .ckpt "
                      f"files ({names}); name the one to load (a checkpoint sharded over ranks "
                      "must be merged into one first, e.g. with mindformers' transform_ckpt)")


def _checkpoint(doc: Mapping[str, Any], yaml_path: Path) -> Path:
    key, value = "load_checkpoint", doc.get("load_checkpoint")
    if not value:
        key = "model.model_config.checkpoint_name_or_path"
        value = doc["model"]["model_config"].get("checkpoint_name_or_path")
    if not value:
        raise ConfigError("load_checkpoint", f"missing in {yaml_path} (and no "
                          "model.model_config.checkpoint_name_or_path): the model's .ckpt file "
                          "(or set llm_serving.checkpoint)")
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a path in {yaml_path}, got {value!r}")
    p = _locate(value, [yaml_path.parent, Path.cwd()])
    if p.is_dir():
        return _single_ckpt(p, key, yaml_path)
    if not p.is_file():
        raise ConfigError(key, f"{value!r} (in {yaml_path}) does not exist: expected the "
                          f"model's .ckpt file (looked at {str(p)!r}; a relative path is read "
                          "from that yaml's directory)")
    if p.suffix not in (".ckpt", ".safetensors"):
        raise ConfigError(key, f"{str(p)!r} (in {yaml_path}): expected a .ckpt file")
    return p


def _tokenizer_links(tokenizer: Optional[Mapping[str, Any]], bases: Sequence[Path]
                     ) -> Dict[str, str]:
    value = (tokenizer or {}).get("vocab_file")
    if not value:
        raise ConfigError(VOCAB_KEY, f"missing: the tokenizer (tokenizer.model, or a "
                          f"tokenizer.json) of the model {CFG_KEY} names (or set "
                          "llm_serving.tokenizer to a tokenizer directory)")
    if not isinstance(value, str):
        raise ConfigError(VOCAB_KEY, f"expected a file path, got {value!r}")
    p = _locate(value, bases)
    if not p.is_file():
        raise ConfigError(VOCAB_KEY, f"file {str(p)!r} does not exist (expected a sentencepiece "
                          "tokenizer.model, or a Hugging Face tokenizer.json)")
    p = p.resolve()
    if p.suffix == ".json":
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(VOCAB_KEY, f"{p}: not valid JSON ({_one_line(e)})") from None
        if not isinstance(doc, dict) or "model" not in doc:
            raise ConfigError(VOCAB_KEY, f"{p}: not a Hugging Face tokenizer.json (no 'model'); "
                              "a BPE vocab.json alone cannot be served")
        links = {"tokenizer.json": str(p)}
    else:
        links = {"tokenizer.model": str(p)}
    for name in _TOKENIZER_SIBLINGS:
        if (p.parent / name).is_file():
            links[name] = str(p.parent / name)
    return links


def _end_tokens(end_token: Union[int, List[int]], vocab_size: int) -> Union[int, List[int]]:
    for t in end_token if isinstance(end_token, list) else [end_token]:
        if not 0 <= t < vocab_size:
            raise ConfigError("model_config.end_token", f"{t} is not a token id of the model "
                              f"(its vocab_size is {vocab_size})")
    return end_token


def _write_model_dir(target: Path, files: Mapping[str, Any], links: Mapping[str, str]) -> None:
    if (target / "config.json").is_file():
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
    except OSError as e:
        raise ModelLoadError(f"{CFG_KEY}: cannot write the model directory under "
                             f"{str(target.parent)!r} ({e}); set LLM_SERVING_HOME to a writable "
                             "directory") from None
    try:
        for name, target_path in links.items():
            os.symlink(target_path, tmp / name)
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n",
                                    encoding="utf-8")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():   # not just another start's copy
                raise
    except OSError as e:
        raise ModelLoadError(f"{CFG_KEY}: cannot write the model directory {str(target)!r} "
                             f"({e})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def materialize(model_cfg_path: str, *, model_name: str, vocab_size: int,
                end_token: Union[int, List[int]], tokenizer: Optional[Mapping[str, Any]],
                config_path: Optional[Path], need_tokenizer: bool = True,
                need_checkpoint: bool = True) -> MindformersModel:
    """The model directory and checkpoint for llm-serving's ``model_config`` / ``tokenizer``
    sections. A relative ``model_cfg_path`` or ``vocab_file`` is read from the current
    directory (as llm-serving did), else from the config file's; a relative checkpoint from the
    mindformers yaml's directory. ``need_tokenizer`` / ``need_checkpoint`` False: the caller
    has its own (``llm_serving.tokenizer`` / ``checkpoint``). Every failure is a ConfigError
    naming the key and the file."""
    bases = [Path.cwd()] + ([Path(config_path).absolute().parent] if config_path else [])
    yaml_path = _locate(model_cfg_path, bases)
    doc = _read_mindformers_yaml(yaml_path)
    mc = _model_config(doc, yaml_path)
    yaml_path = yaml_path.resolve()
    if vocab_size != mc.vocab_size:
        raise ConfigError("model_config.vocab_size", f"{vocab_size} differs from the mindformers "
                          f"yaml's model.model_config.vocab_size {mc.vocab_size} ({yaml_path})")
    eos = _end_tokens(end_token, mc.vocab_size)
    checkpoint = str(_checkpoint(doc, yaml_path).resolve()) if need_checkpoint else None
    links = _tokenizer_links(tokenizer, bases) if need_tokenizer else {}

    config = mc.to_hf_dict()
    config["eos_token_id"] = eos
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": mc.bos_token_id, "eos_token_id": eos},
        "mindformers_source.json": {CFG_KEY: str(yaml_path), "checkpoint": checkpoint,
                                    "tokenizer": links},
    }
    digest = hashlib.sha256(json.dumps([files, links], sort_keys=True).encode()).hexdigest()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("._") or "model"
    target = home_dir() / "models" / "mindformers" / f"{safe}-{digest[:12]}"
    _write_model_dir(target, files, links)
    return MindformersModel(str(target), checkpoint, str(yaml_path))
