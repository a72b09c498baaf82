"""A PEFT LoRA adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors``.

``check_adapter`` reads the config and the safetensors header (no weights) and checks them
against the base model; ``read_adapter`` reads the weights too: the master does this once per
adapter, so that a bad adapter is refused before any request runs with it. ``load_adapter``
reads the weights (a WorkAgent, once per adapter it keeps). What PEFT can express and this engine does not compute is refused
by name: DoRA (``use_dora``), ``modules_to_save``, a ``bias`` other than none, LoRA bias,
``alpha_pattern``, layer replication, and modules other than q/k/v/o and gate/up/down.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from llm_serving.errors import ModelLoadError

# Base models whose layers carry the target modules under PEFT's (Llama's) names.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "InternLMForCausalLM")
# module -> the block holding it in a decoder layer
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                  "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                  "down_proj": "mlp"}
_TENSOR = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(\w+)\.(\w+))"
                     r"\.lora_([AB])\.weight")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its directory, its largest rank, and per module (our name for it,
    e.g. ``model.layers.0.self_attn.q_proj``) the rank and the scale of its product."""
    path: str
    rank: int
    modules: tuple          # ((module, rank, scale), ...)


def module_shape(hf, module: str) -> tuple[int, int]:
    """(in, out) features of a target module of the base model (``hf``: its ModelConfig)."""
    kind = module.rsplit(".", 1)[1]
    return {"q_proj": (hf.hidden_size, hf.q_size), "k_proj": (hf.hidden_size, hf.kv_size),
            "v_proj": (hf.hidden_size, hf.kv_size), "o_proj": (hf.q_size, hf.hidden_size),
            "gate_proj": (hf.hidden_size, hf.intermediate_size),
            "up_proj": (hf.hidden_size, hf.intermediate_size),
            "down_proj": (hf.intermediate_size, hf.hidden_size)}[kind]


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory")
    if not os.path.isfile(file):
        raise ValueError(f"lora_path: {path!r} has no {CONFIG_FILE} (a PEFT LoRA adapter "
                         "directory is expected)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_path: cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path: {file} does not hold a JSON object")
    return config


def _refuse_features(config: dict) -> None:
    """A ValueError naming the first PEFT feature the adapter uses that is not computed."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type: {config['peft_type']!r} adapters are not supported "
                         "(LORA only)")
    refused = (("use_dora", "DoRA adapters are not supported"),
               ("modules_to_save", "adapters that replace whole modules are not supported"),
               ("lora_bias", "LoRA bias is not supported"),
               ("alpha_pattern", "per-module lora_alpha is not supported"),
               ("layer_replication", "layer replication is not supported"))
    for key, why in refused:
        if config.get(key):
            raise ValueError(f"{key}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias: {config['bias']!r}: adapter bias is not supported (none only)")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        bad = sorted(t for t in targets if t not in TARGET_MODULES)
        if bad:
            raise ValueError(f"target_modules: {bad[0]!r} is not supported (supported: "
                             f"{', '.join(TARGET_MODULES)})")


def check_adapter(path: str, hf, max_lora_rank: int) -> AdapterSpec:
    """The adapter at ``path``, checked against the base model ``hf`` (its ModelConfig) and
    ``max_lora_rank``; a ValueError naming what is wrong."""
    from llm_serving.model_executor.loader import read_safetensors_header
    config = _read_config(path)
    _refuse_features(config)
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r: the LoRA rank must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_alpha: expected a number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"lora_path: {path!r} has no {WEIGHTS_FILE}")
    try:
        header, _ = read_safetensors_header(file)
    except ModelLoadError as e:
        raise ValueError(f"lora_path: {e}") from None
    shapes: dict[str, dict] = {}
    for name, info in header.items():
        m = _TENSOR.fullmatch(name)
        if m is None or TARGET_MODULES.get(m.group(4)) != m.group(3):
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} is not the LoRA A or B weight "
                             f"of a supported module ({', '.join(TARGET_MODULES)})")
        module, layer = m.group(1), int(m.group(2))
        if layer >= hf.num_layers:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} is for layer {layer}; the base "
                             f"model has {hf.num_layers}")
        if m.group(3) == "mlp" and hf.is_moe_layer(layer):
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r}: layer {layer}'s MLP is a "
                             "mixture of experts, whose experts adapters cannot target here")
        shapes.setdefault(module, {})[m.group(5)] = tuple(info.get("shape", ()))
    if not shapes:
        raise ValueError(f"{WEIGHTS_FILE}: no LoRA weights in it")
    modules, top = [], 0
    for module, ab in sorted(shapes.items()):
        missing = sorted({"A", "B"} - set(ab))
        if missing:
            raise ValueError(f"{WEIGHTS_FILE}: {module} has no lora_{missing[0]} weight")
        n_in, n_out = module_shape(hf, module)
        rank = ab["A"][0] if len(ab["A"]) == 2 else -1
        if ab["A"] != (rank, n_in) or ab["B"] != (n_out, rank):
            raise ValueError(f"{WEIGHTS_FILE}: {module}'s lora_A {list(ab['A'])} and lora_B "
                             f"{list(ab['B'])} do not fit the base model's [{n_out}, {n_in}] "
                             "weight (an adapter of another model?)")
        if rank > max_lora_rank:
            raise ValueError(f"r: LoRA rank {rank} is greater than max_lora_rank "
                             f"{max_lora_rank} (raise --max-lora-rank)")
        top = max(top, rank)
        modules.append((module, rank, alpha / math.sqrt(rank) if rslora else alpha / rank))
    return AdapterSpec(os.path.abspath(path), top, tuple(modules))


def read_adapter(path: str, hf, max_lora_rank: int) -> AdapterSpec:
    """``check_adapter``, then the weights read as a WorkAgent will read them, so that a file
    that cannot be read (e.g. truncated) is refused when the adapter is given, not at its
    first step; a ValueError naming what is wrong."""
    spec = check_adapter(path, hf, max_lora_rank)
    try:
        load_adapter(spec)
    except (OSError, ModelLoadError) as e:
        raise ValueError(f"lora_path: cannot read the adapter's weights: {e}") from None
    return spec


def load_adapter(spec: AdapterSpec) -> dict:
    """The adapter's weights: module -> (A float32 [r, in], scale * B float32 [out, r])."""
    from llm_serving.model_executor.loader import read_safetensors
    scales = {module: scale for module, _, scale in spec.modules}
    found: dict = {}
    for name, arr in read_safetensors(os.path.join(spec.path, WEIGHTS_FILE)):
        m = _TENSOR.fullmatch(name)
        if m is None or m.group(1) not in scales:
            raise ModelLoadError(f"{spec.path}: {name!r} changed since the adapter was checked")
        found.setdefault(m.group(1), {})[m.group(5)] = np.asarray(arr, np.float32)
    return {module: (np.ascontiguousarray(ab["A"]),
                     np.ascontiguousarray(ab["B"] * np.float32(scales[module])))
            for module, ab in found.items()}
