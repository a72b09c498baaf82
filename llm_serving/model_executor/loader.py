"""Model configuration and weights: Hugging Face ``config.json`` + safetensors, or MindSpore
``.ckpt`` files with mindformers' Llama parameter names (mapped to HF names).

Nothing here imports mindspore except the ``.ckpt`` paths, which import it when called.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import ml_dtypes
import numpy as np

from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.baichuan_config import (baichuan_hf_dict, check_baichuan,
                                                        has_norm_head, uses_alibi)
from llm_serving.model_executor.quantization import W8A8Config, parse_quantization_config
from llm_serving.model_executor.torch_bin import read_torch_bin

__all__ = [
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "iter_weights",
    "find_weight_files",
    "read_safetensors",
    "mindformers_to_hf_name",
    "hf_to_mindformers_name",
    "save_mindformers_ckpt",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "InternLMForCausalLM",
                           "InternLM2ForCausalLM", "GPTBigCodeForCausalLM", "BaichuanForCausalLM",
                           "BaiChuanForCausalLM")
# Hugging Face's base-model classes (``*Model``: the decoder stack, saved without an LM head
# and without the "model." prefix), as embedding checkpoints such as e5-mistral and
# Qwen3-Embedding are: served by a pooling runner on the causal LM's decoder.
BASE_MODEL_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                            "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                            "Qwen3MoeModel": "Qwen3MoeForCausalLM"}
# Hugging Face's sequence classifiers (``*ForSequenceClassification``: the decoder and a
# ``score`` linear head, no LM head), as classification models and cross-encoder rerankers
# are saved: served by a pooling runner (classify, score) on the causal LM's decoder.
SEQ_CLS_ARCHITECTURES = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                         "MistralForSequenceClassification": "MistralForCausalLM",
                         "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                         "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "internlm": "InternLMForCausalLM",
                       "internlm2": "InternLM2ForCausalLM", "gpt_bigcode": "GPTBigCodeForCausalLM",
                       "baichuan": "BaichuanForCausalLM"}
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 32768,
                          "Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768,
                          "Qwen3MoeForCausalLM": 32768, "InternLMForCausalLM": 2048,
                          "InternLM2ForCausalLM": 2048, "GPTBigCodeForCausalLM": 1024,
                          "BaichuanForCausalLM": 4096, "BaiChuanForCausalLM": 4096}
GPT_BIGCODE = "GPTBigCodeForCausalLM"
# transformers' activation_function names GPTBigCode may use -> GELU's approximation
_GELU_APPROXIMATION = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh",
                       "gelu_fast": "tanh"}
# Baichuan2 and Baichuan-13B, and the first Baichuan-7B (its class name spelled differently)
_BAICHUAN = ("BaichuanForCausalLM", "BaiChuanForCausalLM")
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# InternLM's configs say "bias" (true by default in InternLMConfig and InternLM2Config) for the
# q/k/v and o projections' biases.
_INTERNLM = ("InternLMForCausalLM", "InternLM2ForCausalLM")
_MODEL_TYPES = {arch: model_type for model_type, arch in _MODEL_TYPE_TO_ARCH.items()}
_MODEL_TYPES["BaiChuanForCausalLM"] = "baichuan"


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _seq_cls_labels(cfg: Mapping[str, Any], err) -> dict:
    """A sequence classifier's num_labels, as transformers reads it: ``num_labels``, else the
    size of ``id2label``, else 2."""
    raw = cfg.get("id2label") or {}
    if not isinstance(raw, Mapping):
        raise err(f"id2label: expected a mapping of class index to label, got {raw!r}")
    n = cfg.get("num_labels", len(raw) or 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise err(f"num_labels: expected a positive integer, got {n!r}")
    return {"num_labels": n}


@dataclass(frozen=True)
class ModelConfig:
    """The model hyper-parameters the executor needs, from an HF ``config.json``."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: None, or an HF rope-scaling dict that always has "rope_type": "linear", "llama3",
    #: "yarn" (with its original_max_position_embeddings, max_position_embeddings if absent)
    #: or "dynamic" (dynamic NTK: the base is kept within max_position_embeddings).
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    #: q/k/v projections have biases (Qwen2, or Llama/Mistral with attention_bias).
    qkv_bias: bool = False
    #: o_proj has a bias (Llama/Mistral/Qwen3 with attention_bias; never Qwen2).
    o_bias: bool = False
    #: q and k get an RMSNorm over each head (weights [head_dim]) before rotary (Qwen3).
    qk_norm: bool = False
    #: Qwen3-MoE: routed experts (0: every layer has a dense MLP), each token's top
    #: num_experts_per_tok of them, each a SwiGLU of moe_intermediate_size; norm_topk_prob
    #: renormalizes the chosen experts' probabilities to sum to 1. A layer is sparse when
    #: (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (its MLP then has
    #: intermediate_size), as transformers decides.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: Tuple[int, ...] = ()
    #: GPTBigCode (StarCoder, WizardCoder): LayerNorm's epsilon, the MLP's GELU
    #: ("none": erf, or "tanh"), and multi-query attention (one KV head; else one per head).
    layer_norm_epsilon: float = 1e-5
    gelu_approximate: str = "tanh"
    multi_query: bool = False
    #: Baichuan2: the LM head's rows are L2-normalized (its NormHead), once, at load time.
    norm_head: bool = False
    #: ALiBi biases on the attention scores instead of rotary positions (Baichuan2-13B).
    alibi: bool = False
    bos_token_id: Optional[int] = None
    #: an int, or a list of ints
    eos_token_id: Optional[Union[int, List[int]]] = None
    torch_dtype: Optional[str] = None
    model_type: str = ""
    model_dir: Optional[str] = field(default=None, compare=False)
    # config.json names a base model (BASE_MODEL_ARCHITECTURES): no LM head, pooling only
    base_model: bool = False
    # a sequence classifier's (SEQ_CLS_ARCHITECTURES) labels: its score head's rows (0: none)
    num_labels: int = 0
    #: a W8A8 int8 checkpoint's quantization_config (quantization.py); None: float weights
    quantization: Optional[W8A8Config] = None

    def __post_init__(self):
        if isinstance(self.quantization, Mapping):     # rebuilt from JSON (a WorkAgent's)
            object.__setattr__(self, "quantization", W8A8Config.from_dict(self.quantization))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer``'s MLP is the sparse mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> List[int]:
        e = self.eos_token_id
        if e is None:
            return []
        return [int(x) for x in e] if isinstance(e, (list, tuple)) else [int(e)]

    def to_hf_dict(self) -> Dict[str, Any]:
        """This config as an HF ``config.json`` (``from_dict`` of it gives it back)."""
        if self.architecture == GPT_BIGCODE:
            return self._gpt_bigcode_hf_dict()
        qwen = self.architecture in ("Qwen2ForCausalLM",) + _QWEN3
        d: Dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type or _MODEL_TYPES[self.architecture],
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if qwen:
            d["use_sliding_window"] = False
        if self.architecture in _INTERNLM:
            d["bias"] = self.qkv_bias
        elif self.architecture != "Qwen2ForCausalLM":
            d["attention_bias"] = self.qkv_bias
        if self.architecture == "Qwen3MoeForCausalLM":
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
        if self.architecture in _BAICHUAN:
            d = baichuan_hf_dict(d, self.alibi)
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        return d

    def _gpt_bigcode_hf_dict(self) -> Dict[str, Any]:
        act = "gelu_pytorch_tanh" if self.gelu_approximate == "tanh" else "gelu"
        d: Dict[str, Any] = {
            "architectures": [self.architecture], "model_type": "gpt_bigcode",
            "n_embd": self.hidden_size, "n_layer": self.num_layers, "n_head": self.num_heads,
            "n_inner": self.intermediate_size, "n_positions": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "activation_function": act,
            "layer_norm_epsilon": self.layer_norm_epsilon, "multi_query": self.multi_query,
            "scale_attn_weights": True, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        return d

    # --- constructors ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str,
                        overrides: Optional[Mapping[str, Any]] = None) -> "ModelConfig":
        """Parse ``model_dir/config.json``, with the keys of ``overrides`` (--hf-overrides)
        set over the file's, as vLLM sets them; raise ModelLoadError naming what is wrong."""
        d = Path(model_dir).expanduser()
        if not d.exists():
            raise ModelLoadError(f"model directory {str(d)!r} does not exist (expected a directory with "
                                 "config.json and *.safetensors weights)")
        if not d.is_dir():
            raise ModelLoadError(f"model path {str(d)!r} is not a directory (expected a directory with "
                                 "config.json and *.safetensors weights)")
        path = d / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model directory {str(d)!r} (expected a Hugging Face "
                                 "config.json next to the weights)")
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read JSON ({e})") from e
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        source = str(path)
        if overrides:
            cfg = {**cfg, **overrides}
            rope = overrides.get("rope_parameters")
            if isinstance(rope, Mapping):
                # transformers v5's spelling, which vLLM sets over the file's rope settings
                # (standardized into rope_parameters): it replaces the v4 keys the file has
                for key in ("rope_scaling", "rope_theta"):
                    if key not in overrides and (key == "rope_scaling" or key in rope):
                        cfg.pop(key, None)
            source += f" with hf_overrides {json.dumps(overrides, default=str)}"
        return cls.from_dict(cfg, source=source, model_dir=str(d))

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], *, source: str = "config.json",
                  model_dir: Optional[str] = None) -> "ModelConfig":
        def err(msg: str) -> ModelLoadError:
            return ModelLoadError(f"{source}: {msg}")

        archs = cfg.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(str(cfg.get("model_type", "")))
        base_model = arch in BASE_MODEL_ARCHITECTURES
        seq_cls = _seq_cls_labels(cfg, err) if arch in SEQ_CLS_ARCHITECTURES else {}
        arch = BASE_MODEL_ARCHITECTURES.get(arch, SEQ_CLS_ARCHITECTURES.get(arch, arch))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise err(f"unsupported architecture {arch!r}; supported: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES + tuple(BASE_MODEL_ARCHITECTURES) + tuple(SEQ_CLS_ARCHITECTURES))}")
        quantization = parse_quantization_config(cfg, arch, err)
        if arch == GPT_BIGCODE:
            return cls(**_gpt_bigcode_fields(cfg, err), model_dir=model_dir,
                       quantization=quantization)

        def req(key: str) -> Any:
            if cfg.get(key) is None:
                raise err(f"missing required key {key!r}")
            return cfg[key]

        def as_int(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
                raise err(f"{key} must be a positive integer, got {value!r}")
            return int(value)

        hidden = as_int("hidden_size", req("hidden_size"))
        layers = as_int("num_hidden_layers", req("num_hidden_layers"))
        heads = as_int("num_attention_heads", req("num_attention_heads"))
        kv_heads = cfg.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else as_int("num_key_value_heads", kv_heads)
        inter = as_int("intermediate_size", req("intermediate_size"))
        vocab = as_int("vocab_size", req("vocab_size"))
        if heads % kv_heads:
            raise err(f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv_heads})")
        head_dim = cfg.get("head_dim")
        if head_dim is None and arch == "Qwen3ForCausalLM":   # (Qwen3Moe: hidden / heads)
            head_dim = 128                   # transformers' Qwen3Config default
        if head_dim is None:
            if hidden % heads:
                raise err(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads}) "
                          "when head_dim is not given")
            head_dim = hidden // heads
        head_dim = as_int("head_dim", head_dim)
        if head_dim % 2:
            raise err(f"head_dim ({head_dim}) must be even for rotary embeddings")

        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise err(f"unsupported hidden_act {act!r}; supported: silu")
        if cfg.get("mlp_bias"):
            raise err("mlp_bias=true is not supported (MLP projections without biases only)")
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
            sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        elif arch in _QWEN3:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        elif arch in _INTERNLM:
            qkv_bias = o_bias = bool(cfg.get("bias", True))
            sliding = None
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window")

        max_pos = cfg.get("max_position_embeddings")
        if arch in _BAICHUAN:
            check_baichuan(cfg, err)
            if max_pos is None:             # Baichuan2-13B names only its model_max_length
                max_pos = cfg.get("model_max_length")
        max_pos = _DEFAULT_MAX_POSITIONS[arch] if max_pos is None else as_int("max_position_embeddings", max_pos)
        if sliding is not None and int(sliding) < max_pos:
            raise err(f"sliding-window attention (sliding_window={sliding} < max_position_embeddings={max_pos}) "
                      "is not supported")

        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # the transformers v5 spelling
        if isinstance(params, Mapping):
            if rope_theta is None:
                rope_theta = params.get("rope_theta")
            if rope_scaling is None:
                rope_scaling = params
        rotary = cfg.get("rotary")           # InternLM (v1): {"base": ..., "type": ...}
        if arch == "InternLMForCausalLM" and rotary is not None:
            if not isinstance(rotary, Mapping) or rotary.get("type", "origin") not in (
                    "origin", "dynamic"):
                raise err(f"rotary must have type origin or dynamic, got {rotary!r}")
            # dynamic: InternLM's dynamic NTK, which keeps the base within
            # max_position_embeddings (positions end there here)
            if rope_theta is None:
                rope_theta = rotary.get("base")
        rope_theta = 10000.0 if rope_theta is None else float(rope_theta)
        if rope_scaling is not None:
            if not isinstance(rope_scaling, Mapping):
                raise err(f"rope_scaling must be an object or null, got {rope_scaling!r}")
            rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
            rtype = rope_scaling.pop("type", None)
            rope_scaling["rope_type"] = rope_scaling.get("rope_type", rtype) or "default"
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
            elif rope_scaling["rope_type"] == "llama3":
                for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                    if key not in rope_scaling:
                        raise err(f"rope_scaling of type llama3 needs {key!r}")
            elif rope_scaling["rope_type"] in ("linear", "yarn", "dynamic"):
                if not isinstance(rope_scaling.get("factor"), (int, float)):
                    raise err(f"rope_scaling of type {rope_scaling['rope_type']} needs a numeric "
                              "'factor'")
                if rope_scaling["rope_type"] == "yarn":
                    # transformers' default: the context the checkpoint was trained with
                    rope_scaling.setdefault("original_max_position_embeddings", max_pos)
            else:
                raise err(f"rope_scaling type {rope_scaling['rope_type']!r} is not supported; "
                          "supported: default, linear, llama3, yarn, dynamic")
        partial = cfg.get("partial_rotary_factor")
        if partial is None and isinstance(params, Mapping):
            partial = params.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0):
            raise err(f"partial_rotary_factor={partial} is not supported")

        moe = _moe_fields(cfg, arch, err) if arch == "Qwen3MoeForCausalLM" else {}

        eos = cfg.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = [int(x) for x in eos]
        elif eos is not None:
            eos = int(eos)
        bos = cfg.get("bos_token_id")
        if isinstance(bos, (list, tuple)):
            bos = bos[0] if bos else None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch in _QWEN3,
            norm_head=arch in _BAICHUAN and has_norm_head(vocab),
            alibi=arch in _BAICHUAN and uses_alibi(cfg, hidden),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            model_type=str(cfg.get("model_type", "")),
            model_dir=model_dir,
            base_model=base_model,
            quantization=quantization,
            **seq_cls,
            **moe,
        )

    @classmethod
    def from_mindformers_yaml(cls, path: str) -> "ModelConfig":
        """Read a mindformers Llama/Qwen2 yaml (``model.model_config``), as llm-serving's
        ``model_cfg_path`` points to."""
        import yaml

        p = Path(path).expanduser()
        if not p.is_file():
            raise ModelLoadError(f"mindformers config {str(p)!r} does not exist (expected a yaml file with "
                                 "model.model_config)")
        try:
            doc = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as e:
            raise ModelLoadError(f"{p}: cannot read YAML ({e})") from e
        return cls.from_mindformers_doc(doc, p)

    @classmethod
    def from_mindformers_doc(cls, doc: Any, p: Path) -> "ModelConfig":
        """The same, from the yaml's parsed document (read from ``p``)."""
        model = (doc or {}).get("model") if isinstance(doc, Mapping) else None
        mc = model.get("model_config") if isinstance(model, Mapping) else None
        if not isinstance(mc, Mapping):
            raise ModelLoadError(f"{p}: expected a mapping at model.model_config")
        src = f"{p}: model.model_config"

        def req(key: str) -> Any:
            if mc.get(key) is None:
                raise ModelLoadError(f"{src}: missing required key {key!r}")
            return mc[key]

        hidden = int(req("hidden_size"))
        inter = mc.get("intermediate_size")
        if inter is None:
            multiple_of = int(mc.get("multiple_of") or 256)
            inter = int(2 * 4 * hidden / 3)
            if mc.get("ffn_dim_multiplier") is not None:
                inter = int(float(mc["ffn_dim_multiplier"]) * inter)
            inter = multiple_of * ((inter + multiple_of - 1) // multiple_of)
        arch = None
        arch_cfg = model.get("arch")
        if isinstance(arch_cfg, Mapping):
            arch = arch_cfg.get("type")
        qkv_bias = bool(mc.get("qkv_has_bias", False))
        if qkv_bias or arch in (None, "LlamaForCausalLM"):
            arch = "Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"
        rope_scaling = None
        method = str(mc.get("extend_method") or "None").upper()
        factor = mc.get("scaling_factor")
        if method == "LLAMA3" and isinstance(factor, Mapping):
            rope_scaling = {"rope_type": "llama3", **{k: factor[k] for k in factor}}
        elif method == "PI" and factor not in (None, 1, 1.0):
            rope_scaling = {"rope_type": "linear", "factor": float(factor)}
        cfg = {
            "architectures": [arch],
            "hidden_size": hidden,
            "num_hidden_layers": req("num_layers"),
            "num_attention_heads": req("num_heads"),
            "num_key_value_heads": mc.get("n_kv_heads"),
            "intermediate_size": inter,
            "vocab_size": req("vocab_size"),
            "rms_norm_eps": mc.get("rms_norm_eps", 1e-5),
            "rope_theta": mc.get("theta", 10000.0),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": mc.get("max_position_embedding") or mc.get("seq_length"),
            "tie_word_embeddings": mc.get("tie_word_embeddings", False),
            "bos_token_id": mc.get("bos_token_id", 1),
            "eos_token_id": mc.get("eos_token_id", 2),
            "torch_dtype": _mindformers_dtype(mc.get("param_init_type") or mc.get("compute_dtype")),
            "model_type": "qwen2" if arch == "Qwen2ForCausalLM" else "llama",
        }
        if "Qwen2" not in arch:
            cfg["attention_bias"] = False
        return cls.from_dict(cfg, source=src)


def _gpt_bigcode_fields(cfg: Mapping[str, Any], err) -> Dict[str, Any]:
    """ModelConfig's fields from a GPTBigCode ``config.json`` (StarCoder, WizardCoder, SantaCoder),
    as transformers' GPTBigCodeConfig reads it (``n_embd`` or ``hidden_size``, and so on)."""
    def get(key: str, alias: str, default: Any = None) -> Any:
        value = cfg.get(key, cfg.get(alias))
        if value is None and default is None:
            raise err(f"missing required key {key!r}")
        return default if value is None else value

    def as_int(key: str, value: Any) -> int:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or int(value) != value or value <= 0):
            raise err(f"{key} must be a positive integer, got {value!r}")
        return int(value)

    hidden = as_int("n_embd", get("n_embd", "hidden_size"))
    heads = as_int("n_head", get("n_head", "num_attention_heads"))
    if hidden % heads:
        raise err(f"n_embd ({hidden}) must be divisible by n_head ({heads})")
    inner = cfg.get("n_inner")
    act = cfg.get("activation_function", "gelu_pytorch_tanh")
    if act not in _GELU_APPROXIMATION:
        raise err(f"unsupported activation_function {act!r}; supported: "
                  f"{', '.join(_GELU_APPROXIMATION)}")
    if cfg.get("scale_attn_weights") is False:
        raise err("scale_attn_weights=false is not supported (attention scaled by "
                  "1/sqrt(head_dim) only)")
    if cfg.get("add_cross_attention"):
        raise err("add_cross_attention=true is not supported (a decoder-only model only)")
    multi_query = bool(cfg.get("multi_query", True))
    eos = cfg.get("eos_token_id", 50256)
    if eos is not None:
        eos = [int(x) for x in eos] if isinstance(eos, (list, tuple)) else int(eos)
    bos = cfg.get("bos_token_id", 50256)
    return dict(
        architecture=GPT_BIGCODE,
        hidden_size=hidden,
        num_layers=as_int("n_layer", get("n_layer", "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=1 if multi_query else heads,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden if inner is None else as_int("n_inner", inner),
        vocab_size=as_int("vocab_size", get("vocab_size", "vocab_size", 50257)),
        max_position_embeddings=as_int("n_positions",
                                       get("n_positions", "max_position_embeddings", 1024)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        gelu_approximate=_GELU_APPROXIMATION[act],
        multi_query=multi_query,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=eos,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        model_type=str(cfg.get("model_type", "gpt_bigcode")),
    )


def _moe_fields(cfg: Mapping[str, Any], arch: str, err) -> Dict[str, Any]:
    """A Qwen3-MoE config.json's expert settings (transformers' defaults where absent)."""
    def count(key: str, default: int, least: int) -> int:
        value = cfg.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise err(f"{key} must be an integer >= {least}, got {value!r}")
        return value

    experts = count("num_experts", 128, 0)         # 0: every layer dense, as transformers
    top_k = count("num_experts_per_tok", 8, 1)
    if experts and top_k > experts:
        raise err(f"num_experts_per_tok ({top_k}) must not exceed num_experts ({experts})")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise err(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    if cfg.get("shared_expert_intermediate_size"):
        raise err(f"shared experts (shared_expert_intermediate_size) are not part of {arch}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=count("moe_intermediate_size", 768, 1),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=count("decoder_sparse_step", 1, 1),
                mlp_only_layers=tuple(sorted({int(i) for i in only})))


def _mindformers_dtype(value: Any) -> Optional[str]:
    if value is None:
        return None
    return {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}.get(str(value), str(value))


# ---------------------------------------------------------------------------------------------
# Safetensors (read directly: numpy cannot hold bf16, and we want zero-copy memory maps)
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted to float32 below
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bit patterns, rounded to nearest, ties to even (as torch and
    the CPU's vcvtneps2bf16 do); NaN stays a quiet NaN. A checkpoint's bf16 values, widened by
    ``bfloat16_bits_to_float32``, come back as the same bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def read_safetensors_header(path: Union[str, Path]) -> Tuple[Dict[str, Any], int]:
    """(header dict without __metadata__, byte offset where the data starts)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelLoadError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise ModelLoadError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header, 8 + n


def read_safetensors(path: Union[str, Path], keep_bf16: bool = False
                     ) -> Iterator[Tuple[str, np.ndarray]]:
    """Yield (name, array) from one safetensors file, in file order. Arrays are read-only
    memory maps, each tensor its own (its pages leave the process's RSS once the caller drops
    it, as a streaming reader such as llm_serving.quantize wants); bf16 is converted to a new
    float32 array, or with ``keep_bf16`` viewed as ``ml_dtypes.bfloat16``."""
    path = Path(path)
    header, start = read_safetensors_header(path)
    size = path.stat().st_size
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in items:
        st = info.get("dtype")
        dt = _ST_DTYPES.get(st)
        if dt is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {st!r}; "
                                 f"supported: {', '.join(_ST_DTYPES)}")
        shape = tuple(int(s) for s in info["shape"])
        b, e = (int(x) for x in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if e - b != count * dt.itemsize or start + e > size:
            raise ModelLoadError(f"{path}: tensor {name!r} has inconsistent offsets (file truncated?)")
        if count == 0:
            arr = np.zeros(shape, dtype=dt)
        else:
            arr = np.asarray(np.memmap(path, dtype=dt, mode="r", offset=start + b, shape=shape))
        if st == "BF16":
            arr = arr.view(ml_dtypes.bfloat16) if keep_bf16 else bfloat16_bits_to_float32(arr)
        yield name, arr


# ---------------------------------------------------------------------------------------------
# mindformers names
# ---------------------------------------------------------------------------------------------

_MF_TO_HF_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_TO_MF_LAYER = {v: k for k, v in _MF_TO_HF_LAYER.items()}
_MF_TO_HF_GLOBAL = {
    "model.tok_embeddings.embedding_weight": "model.embed_tokens.weight",
    "model.norm_out.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_TO_MF_GLOBAL = {v: k for k, v in _MF_TO_HF_GLOBAL.items()}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF names a .ckpt may also carry as they are (no mindformers Llama name exists for them).
_HF_LAYER_PARTS = set(_HF_TO_MF_LAYER) | {"self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                          "self_attn.W_pack.weight"}
# Qwen3-MoE's router and experts, also kept under their HF names in a .ckpt.
_MOE_PART_RE = re.compile(r"^mlp\.(gate|experts\.\d+\.(gate|up|down)_proj)\.weight$")


def _hf_only_part(rest: str) -> bool:
    return rest in _HF_LAYER_PARTS or _MOE_PART_RE.match(rest) is not None


def mindformers_to_hf_name(name: str) -> Optional[str]:
    """Map a mindformers Llama parameter name (or an HF name) to the HF name; None for names that
    are not model weights (optimizer state, step counters, cached rotary tables, ...)."""
    for prefix in ("network.", "_backbone."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    if name in _MF_TO_HF_GLOBAL:
        return _MF_TO_HF_GLOBAL[name]
    if name in _HF_TO_MF_GLOBAL:  # already an HF name
        return name
    m = _LAYER_RE.match(name)
    if m:
        layer, rest = m.groups()
        if rest in _MF_TO_HF_LAYER:
            return f"model.layers.{layer}.{_MF_TO_HF_LAYER[rest]}"
        if _hf_only_part(rest):
            return name
    return None


def hf_to_mindformers_name(name: str) -> str:
    if name in _HF_TO_MF_GLOBAL:
        return _HF_TO_MF_GLOBAL[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _HF_TO_MF_LAYER:
        return f"model.layers.{m.group(1)}.{_HF_TO_MF_LAYER[m.group(2)]}"
    if m and _hf_only_part(m.group(2)):
        return name                    # Qwen3's q/k norms and MoE weights keep their HF names
    raise ValueError(f"no mindformers name for weight {name!r}")


def _iter_ckpt(path: Path, keep_bf16: bool = False) -> Iterator[Tuple[str, np.ndarray]]:
    import mindspore  # slow to import: only when a .ckpt is actually read

    try:
        params = mindspore.load_checkpoint(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read MindSpore checkpoint ({e})") from e
    found = False
    for name, param in params.items():
        hf = mindformers_to_hf_name(name)
        if hf is None:
            continue
        found = True
        arr = param.asnumpy()
        if arr.dtype.name == "bfloat16":      # MindSpore's own numpy bfloat16
            arr = arr.view(np.uint16).view(ml_dtypes.bfloat16) if keep_bf16 \
                else arr.astype(np.float32)
        yield hf, arr
    if not found:
        raise ModelLoadError(f"{path}: no model weights with mindformers Llama or Hugging Face names "
                             f"(found e.g. {sorted(params)[:5]})")


# ---------------------------------------------------------------------------------------------
# Finding and iterating weights
# ---------------------------------------------------------------------------------------------


def find_weight_files(model_dir: str, checkpoint: Optional[str] = None) -> List[Path]:
    """The weight files to read, in order: an explicit ``checkpoint``; else the shards named by
    ``model.safetensors.index.json``; else ``model.safetensors``; else all ``*.safetensors``;
    else the only ``*.ckpt`` in the directory."""
    d = Path(model_dir).expanduser()
    if checkpoint is not None:
        c = Path(checkpoint).expanduser()
        if not c.is_absolute() and not c.exists() and (d / c).exists():
            c = d / c
        if c.is_dir():
            return find_weight_files(str(c))
        if not c.is_file():
            raise ModelLoadError(f"checkpoint {str(c)!r} does not exist (expected a .ckpt or .safetensors file)")
        if c.suffix not in (".ckpt", ".safetensors", ".bin"):
            raise ModelLoadError(f"checkpoint {str(c)!r}: unsupported file type (expected .ckpt, "
                                 ".safetensors or a PyTorch .bin)")
        return [c]
    if not d.is_dir():
        raise ModelLoadError(f"model directory {str(d)!r} does not exist (expected a directory with "
                             "*.safetensors or a .ckpt)")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_shards(d, index)
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    shards = sorted(d.glob("*.safetensors"))
    if shards:
        return shards
    bins = _torch_bin_files(d)
    if bins:
        return bins
    ckpts = sorted(d.glob("*.ckpt"))
    if len(ckpts) == 1:
        return ckpts
    if len(ckpts) > 1:
        raise ModelLoadError(f"{len(ckpts)} .ckpt files in {str(d)!r} ({', '.join(p.name for p in ckpts)}): "
                             "name the one to load with checkpoint=")
    raise ModelLoadError(f"no weights in {str(d)!r}: expected model.safetensors, sharded "
                         "model-*.safetensors with model.safetensors.index.json, PyTorch "
                         "pytorch_model*.bin, or a MindSpore .ckpt")


def _torch_bin_files(d: Path) -> List[Path]:
    """PyTorch checkpoints (Baichuan2 ships only these): the shards named by
    pytorch_model.bin.index.json, else pytorch_model*.bin."""
    index = d / "pytorch_model.bin.index.json"
    if index.is_file():
        return _indexed_shards(d, index)
    return sorted(d.glob("pytorch_model*.bin"))


def _indexed_shards(d: Path, index: Path) -> List[Path]:
    """The shard files a ``*.index.json`` (safetensors' or PyTorch's) names, each present."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index}: cannot read the shard index ({e})") from e
    files = [d / f for f in sorted(set(weight_map.values()))]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{index} names shard {missing[0]!r}, which is missing from "
                             f"{str(d)!r}")
    return files


def iter_weights(model_dir: str, checkpoint: Optional[str] = None, keep_bf16: bool = False
                 ) -> Iterator[Tuple[str, np.ndarray]]:
    """Yield (HF parameter name, numpy array) for every weight of the model.

    Safetensors arrays keep their dtype (read-only memory maps), except bf16 which becomes float32;
    ``.ckpt`` parameters with mindformers names are renamed to HF names, and bf16 becomes float32;
    PyTorch ``.bin`` tensors are read as safetensors ones are (``torch_bin.py``). With
    ``keep_bf16`` bf16 stays bf16 (``ml_dtypes.bfloat16``, a view where the file is mapped).
    """
    for path in find_weight_files(model_dir, checkpoint):
        if path.suffix == ".ckpt":
            yield from _iter_ckpt(path, keep_bf16)
        elif path.suffix == ".bin":
            yield from read_torch_bin(path, keep_bf16)
        else:
            yield from read_safetensors(path, keep_bf16)


def save_mindformers_ckpt(model_dir: str, out_path: str, checkpoint: Optional[str] = None) -> str:
    """Write the model's weights as a MindSpore ``.ckpt`` with mindformers Llama names."""
    import mindspore

    params = []
    for name, arr in iter_weights(model_dir, checkpoint):
        params.append({"name": hf_to_mindformers_name(name), "data": mindspore.Tensor(np.array(arr))})
    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    mindspore.save_checkpoint(params, str(out))
    return str(out)
