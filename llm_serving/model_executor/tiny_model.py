"""Build small random-weight models in Hugging Face format, for tests and benchmarks.

``python -m llm_serving.model_executor.tiny_model --out DIR [--preset NAME] [flags]`` (NAME: tiny,
tiny-qwen3, tiny-qwen3-moe, tiny-internlm, tiny-internlm2, tiny-gpt-bigcode, tiny-baichuan2,
tiny-baichuan2-alibi, tiny-w8a8, bench or bench-gqa) writes a
directory that ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and llm_serving both
load (InternLM's and Baichuan's architectures are remote code in transformers:
``AutoTokenizer`` only):

* ``config.json`` (LlamaForCausalLM, Qwen2ForCausalLM when the q/k/v projections have biases, or
  Qwen3ForCausalLM with ``--architecture qwen3``, Qwen3MoeForCausalLM with ``qwen3_moe``,
  InternLMForCausalLM with ``internlm``, InternLM2ForCausalLM with ``internlm2``,
  GPTBigCodeForCausalLM (StarCoder / WizardCoder's layout) with ``gpt_bigcode``,
  BaichuanForCausalLM with ``baichuan2``),
* random weights in safetensors (optionally sharded, with ``model.safetensors.index.json``),
* a real byte-level BPE tokenizer trained with the ``tokenizers`` library on the bundled alpaca
  corpus (``clients/data``), plus ``tokenizer_config.json`` (ChatML-style chat template),
  ``special_tokens_map.json`` and ``generation_config.json``.

Everything is deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from llm_serving.errors import ConfigError
from llm_serving.home import home_dir
from llm_serving.model_executor.loader import float32_to_bfloat16_bits

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# Qwen3's tokenizer has its thinking and tool-call markers as single added tokens that are not
# special (they survive skip_special_tokens): the tiny Qwen3 has them too, as its last ids.
QWEN3_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# ChatML, starting with BOS like Llama templates: render, then encode with add_special_tokens=False
# (as transformers' apply_chat_template(tokenize=True) does) to get exactly one BOS.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TINY: Dict[str, object] = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=1024,
)
PRESETS: Dict[str, Dict[str, object]] = {
    "tiny": _TINY,
    # Qwen3's layout: per-head q/k norms, a head_dim that is not hidden_size / num_heads, tied
    # embeddings (as Qwen3-0.6B to 4B have).
    "tiny-qwen3": dict(
        architecture="qwen3",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
    # Qwen3-MoE's layout (Qwen3-30B-A3B's, small): 8 experts of 32, each token's top 2 with
    # their probabilities renormalized; layer 1 of 3 keeps a dense MLP (mlp_only_layers).
    "tiny-qwen3-moe": dict(
        architecture="qwen3_moe",
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=(1,),
    ),
    # InternLM (internlm-7b's layout, small): multi-head attention with biases on the q, k, v
    # and o projections, InternLM's "rotary" config entry.
    "tiny-internlm": dict(
        architecture="internlm",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        vocab_size=1024,
    ),
    # InternLM2 (internlm2-chat-7b's layout, small): GQA with q, k and v packed per KV group in
    # attention.wqkv, InternLM2's weight names, dynamic NTK rope scaling.
    "tiny-internlm2": dict(
        architecture="internlm2",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=1024,
    ),
    # StarCoder / WizardCoder's layout (GPTBigCodeForCausalLM): learned positions, LayerNorm,
    # multi-query attention (one KV head), a GELU MLP of 4 x hidden, biases, tied embeddings.
    "tiny-gpt-bigcode": dict(
        architecture="gpt_bigcode",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=256,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
    # Baichuan2-7B's layout: q, k and v packed in W_pack, a NormHead, rotary positions.
    "tiny-baichuan2": dict(
        architecture="baichuan2",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        vocab_size=1024,
    ),
    # Baichuan2-13B's layout: the same with ALiBi biases instead of rotary positions, and a
    # head count that is not a power of two (as its 40), whose slopes interleave.
    "tiny-baichuan2-alibi": dict(
        architecture="baichuan2",
        alibi=True,
        hidden_size=96,
        num_layers=2,
        num_heads=6,
        num_kv_heads=6,
        intermediate_size=128,
        vocab_size=1024,
    ),
    # the tiny Llama as a W8A8 int8 checkpoint (llm_serving.quantize: compressed-tensors,
    # int8 weights per channel, activations per token), builtin:tiny-llama-w8a8
    "tiny-w8a8": dict(_TINY, w8a8=True),
    # ~97M parameters: the benchmark model.
    "bench": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        intermediate_size=2048,
        vocab_size=8000,
    ),
    # ~287M parameters with grouped-query attention (16 query heads on 4 kv heads, 24 layers):
    # shaped like a small Llama 3 or Qwen2.5, to check on a model 3x the bench model's size,
    # and with GQA, what the bench model shows (bench/bench_w1_served.py --model bench-gqa).
    "bench-gqa": dict(
        hidden_size=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        vocab_size=8000,
    ),
}

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose, so that the scaling changes the frequencies used at test lengths.
    "original_max_position_embeddings": 256,
}

_DTYPES = {
    # name: (safetensors dtype, bytes per element)
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
}

# Used when the alpaca corpus is not found next to the package (e.g. a partial install).
_FALLBACK_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving system keeps many requests in flight at once,
and each request is a prompt followed by the tokens the model writes, one after another.
Give three tips for staying healthy. 1. Eat a balanced diet and make sure to include plenty of fruits
and vegetables. 2. Exercise regularly to keep your body active and strong. 3. Get enough sleep and
maintain a consistent sleep schedule.
What are the three primary colors? The three primary colors are red, blue, and yellow.
Describe the structure of an atom. An atom is made up of a nucleus, which contains protons and
neutrons, surrounded by electrons that travel in orbits around the nucleus.
How can we reduce air pollution? There are a number of ways to reduce air pollution, such as shifting
to renewable energy sources, encouraging the use of public transportation, prohibiting the burning of
fossil fuels, implementing policies to reduce emissions from industrial sources, and implementing
vehicle emissions standards.
Write a short story about a robot who learns to paint. Once upon a time, in a quiet workshop at the
edge of the city, a small robot named Pixel discovered a box of old brushes and a set of bright paints.
Translate the sentence into French: Where is the library? Où est la bibliothèque ?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2024-01-01 12:30.
Code: def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n
Unicode: 你好，世界。こんにちは。안녕하세요. Emoji: 😀 🚀 ✨. Ünïcödé àccents naïve café.
"""


# ---------------------------------------------------------------------------------------------
# Locations
# ---------------------------------------------------------------------------------------------


# Written into every model made here; a built-in model with another version (or none) is made
# again. Bump it when what a preset generates changes. 2: Qwen3's think and tool-call
# markers as single tokens in tiny-qwen3's tokenizer.
GENERATOR_VERSION = 2
GENERATOR_STAMP = "llm_serving_tiny_model.json"

_PRESET_DIRS = {"tiny": "tiny-llama", "tiny-qwen3": "tiny-qwen3",
                "tiny-qwen3-moe": "tiny-qwen3-moe", "tiny-internlm": "tiny-internlm",
                "tiny-internlm2": "tiny-internlm2", "tiny-gpt-bigcode": "tiny-gpt-bigcode",
                "tiny-baichuan2": "tiny-baichuan2",
                "tiny-baichuan2-alibi": "tiny-baichuan2-alibi", "tiny-w8a8": "tiny-llama-w8a8",
                "bench": "bench-97m", "bench-gqa": "bench-gqa-287m"}
ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "internlm", "internlm2", "gpt_bigcode",
                 "baichuan2")


def default_model_dir(preset: str = "tiny") -> str:
    """Where a built-in model lives: ``$LLM_SERVING_HOME/models/<name>`` if the variable is set,
    else ``~/.cache/llm_serving/models/<name>``: ``_PRESET_DIRS[preset]``."""
    return str(home_dir() / "models" / _PRESET_DIRS[preset])


def _current(target: Path) -> bool:
    """Whether ``target`` holds a built-in model of this version of the generator."""
    try:
        stamp = json.loads((target / GENERATOR_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("generator") == GENERATOR_VERSION


def ensure_tiny_model(path: Optional[str] = None, preset: str = "tiny") -> str:
    """Return ``path`` (default: :func:`default_model_dir`), creating the model of the given
    preset there if absent, or made by an older generator (its files differ: an upgrade
    would otherwise serve the old model, say a tokenizer without Qwen3's marker tokens).

    The model is written to a temporary directory beside ``path`` and renamed into place, so a
    concurrent or interrupted run never leaves a half-written model at ``path``.
    """
    target = Path(path) if path is not None else Path(default_model_dir(preset))
    target = target.expanduser()
    if (target / "config.json").is_file():
        if _current(target):
            return str(target)
        logger.info("the built-in model at %s was made by an older llm_serving: making it "
                    "again", target)
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=str(target.parent)))
        try:
            os.rename(target, stale / target.name)
        except OSError:         # someone else replaced it meanwhile
            pass
        shutil.rmtree(stale, ignore_errors=True)
        if (target / "config.json").is_file():
            return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
    try:
        make_tiny_model(str(tmp), **PRESETS[preset])
        try:
            os.rename(tmp, target)
        except OSError as e:
            # Someone else finished first (target exists and is not empty): use theirs.
            if not (target / "config.json").is_file():
                raise OSError(f"cannot create the tiny model at {str(target)!r}: the directory exists but "
                              f"holds no config.json (remove it and retry) [{e}]") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def builtin_model(name: str) -> str:
    """The directory of ``builtin:<name>`` (``name``: a built-in model's directory name, such as
    tiny-llama or tiny-qwen3, or its preset's), made on first use. Another name is a
    ConfigError naming the known ones (it used to give the tiny Llama, whatever was asked)."""
    presets = {d: p for p, d in _PRESET_DIRS.items()}
    preset = name if name in PRESETS else presets.get(name)
    if preset is None:
        known = ", ".join(f"builtin:{d}" for d in _PRESET_DIRS.values())
        raise ConfigError("model", f"builtin:{name}: no built-in model of that name (known: "
                          f"{known})")
    return ensure_tiny_model(preset=preset)


MODEL_HELP = ("a model directory, or a built-in model's preset: "
              + ", ".join(PRESETS) + " (default: bench, the 97M model)")


def model_path(spec: Optional[str], default: str = "bench") -> str:
    """A benchmark's ``--model``: a preset's name (its built-in model, made on first use), a
    model directory, or None for ``default``'s."""
    spec = default if spec is None else spec
    if spec in PRESETS:
        return ensure_tiny_model(preset=spec)
    if not (Path(spec).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"--model {spec!r}: no model directory (with a config.json) "
                                f"there, and no preset of that name ({', '.join(PRESETS)})")
    return spec


def arm_skip_layers(arm: str, model: str) -> Tuple[str, Optional[list]]:
    """A benchmark's arm name and the layers its ``~`` suffix keeps at the model's KV dtype
    (kv_cache_dtype_skip_layers): ``fp8-kv~first+last``, ``~0+5``; first and last name the
    model's (None without a suffix)."""
    name, _, layers = arm.partition("~")
    if not layers:
        return name, None
    last = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"] - 1
    return name, [{"first": "0", "last": str(last)}.get(x, x) for x in layers.split("+")]


# a benchmark's arms that load the model's W8A8 int8 checkpoint (w8a8_copy) instead of it
QUANTIZED_ARMS = ("w8a8", "w8a8-fp8kv")


def w8a8_copy(model: str) -> str:
    """The W8A8 int8 checkpoint of model directory ``model`` (what ``python -m
    llm_serving.quantize`` writes), made on first use under the home directory's models: a
    benchmark's ``w8a8`` arm."""
    from llm_serving.home import home_dir
    from llm_serving.quantize import quantize_model
    out = home_dir() / "models" / (Path(model).resolve().name + "-w8a8")
    if not (out / "config.json").is_file():
        quantize_model(model, str(out), overwrite=True)
    return str(out)


def corpus_texts() -> Tuple[List[str], str]:
    """The tokenizer training corpus and where it came from.

    Uses the bundled alpaca data (``clients/data/alpaca_521.json``, located next to the
    ``llm_serving`` package, which is also where a non-editable install puts the ``clients``
    package data); falls back to a small built-in text when that file is absent.
    """
    candidates = [Path(__file__).resolve().parents[1] / "clients" / "data" / "alpaca_521.json"]
    try:  # the ``clients`` package, wherever it is installed
        import clients  # type: ignore

        for p in getattr(clients, "__path__", []):
            candidates.append(Path(p) / "data" / "alpaca_521.json")
    except Exception:  # pragma: no cover - clients not importable
        pass
    for path in candidates:
        if path.is_file():
            try:
                records = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            texts = []
            for rec in records:
                for key in ("instruction", "input", "output"):
                    value = rec.get(key) if isinstance(rec, dict) else None
                    if value:
                        texts.append(value)
            if texts:
                return texts, str(path)
    return _FALLBACK_TEXT.splitlines(), "builtin"


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(vocab_size: int, texts: Optional[Sequence[str]] = None,
                    markers: Sequence[str] = ()):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens
    (special tokens and ``markers`` included: added tokens that are not special, the last
    ids). Deterministic and fast (well under a second for 8k tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    min_vocab = len(SPECIAL_TOKENS) + 256 + len(markers)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be at least {min_vocab} for a byte-level BPE, got {vocab_size}")
    if texts is None:
        texts, _ = corpus_texts()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(markers),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=0,
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    short = vocab_size - len(markers) - tok.get_vocab_size(with_added_tokens=True)
    if short > 0:
        # The corpus ran out of merges: fill up with reserved tokens so that the size is exact.
        tok.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(short)]
        )
    if markers:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0",
        pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", BOS_ID)],
    )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def _tokenizer_files(tok, max_position_embeddings: int) -> Dict[str, object]:
    added = {}
    for tid in range(tok.get_vocab_size(with_added_tokens=True)):
        content = tok.id_to_token(tid)
        special = tid < len(SPECIAL_TOKENS) or content.startswith("<|reserved_")
        if special or content in QWEN3_MARKERS:
            added[str(tid)] = {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<s>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "model_max_length": max_position_embeddings,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    special_tokens_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map}


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def _param_specs(
    *,
    max_position_embeddings: int = 0,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    qkv_bias: bool,
    o_bias: bool = False,
    qk_norm: bool = False,
    packed_qkv: bool = False,
    norm_head: bool = False,
    num_experts: int = 0,
    moe_intermediate_size: int = 0,
    moe_layers: Sequence[int] = (),
) -> List[Tuple[str, Tuple[int, ...], float, float]]:
    """(name, shape, mean, std) for every parameter, in HF order: values are normal(mean, std)."""
    h, q, kv, i = hidden_size, num_heads * head_dim, num_kv_heads * head_dim, intermediate_size
    # Logits come out ~N(0, 2.5^2) per entry, so the top two logits are typically ~0.5 apart: greedy
    # decoding does not hinge on numerical near-ties. Tied embeddings double as the output
    # projection: there a small embedding scale keeps the current token's own embedding from
    # dominating the logits (which makes greedy decoding repeat one token), and the final norm's
    # larger weight brings the logits back to the same scale.
    # A NormHead (Baichuan2) has rows of norm 1, not ~2.5: the final norm scales the logits
    # back up.
    emb_std = 0.1 if tie_word_embeddings else 1.0
    final_norm = 3.0 if tie_word_embeddings or norm_head else 1.0
    specs: List[Tuple[str, Tuple[int, ...], float, float]] = [
        ("model.embed_tokens.weight", (vocab_size, h), 0.0, emb_std)
    ]
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        specs.append((p + "input_layernorm.weight", (h,), 1.0, 0.05))
        if packed_qkv:                  # Baichuan2's W_pack: [q; k; v]
            specs.append((p + "self_attn.W_pack.weight", (q + 2 * kv, h), 0.0, h**-0.5))
        else:
            specs += [
                (p + "self_attn.q_proj.weight", (q, h), 0.0, h**-0.5),
                (p + "self_attn.k_proj.weight", (kv, h), 0.0, h**-0.5),
                (p + "self_attn.v_proj.weight", (kv, h), 0.0, h**-0.5),
            ]
        if qkv_bias:
            specs += [
                (p + "self_attn.q_proj.bias", (q,), 0.0, 0.2),
                (p + "self_attn.k_proj.bias", (kv,), 0.0, 0.2),
                (p + "self_attn.v_proj.bias", (kv,), 0.0, 0.2),
            ]
        if qk_norm:
            specs += [
                (p + "self_attn.q_norm.weight", (head_dim,), 1.0, 0.2),
                (p + "self_attn.k_norm.weight", (head_dim,), 1.0, 0.2),
            ]
        specs += [
            (p + "self_attn.o_proj.weight", (h, q), 0.0, q**-0.5),
        ]
        if o_bias:
            specs.append((p + "self_attn.o_proj.bias", (h,), 0.0, 0.2))
        specs.append((p + "post_attention_layernorm.weight", (h,), 1.0, 0.05))
        if layer in moe_layers:
            # A router of std 2 / sqrt(h): experts' probabilities well apart, so the top-k
            # does not hinge on rounding.
            mi = moe_intermediate_size
            specs.append((p + "mlp.gate.weight", (num_experts, h), 0.0, 2.0 * h**-0.5))
            for e in range(num_experts):
                specs += [
                    (p + f"mlp.experts.{e}.gate_proj.weight", (mi, h), 0.0, h**-0.5),
                    (p + f"mlp.experts.{e}.up_proj.weight", (mi, h), 0.0, h**-0.5),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, mi), 0.0, mi**-0.5),
                ]
        else:
            specs += [
                (p + "mlp.gate_proj.weight", (i, h), 0.0, h**-0.5),
                (p + "mlp.up_proj.weight", (i, h), 0.0, h**-0.5),
                (p + "mlp.down_proj.weight", (h, i), 0.0, i**-0.5),
            ]
    specs.append(("model.norm.weight", (h,), final_norm, 0.05 * final_norm))
    if not tie_word_embeddings:
        specs.append(("lm_head.weight", (vocab_size, h), 0.0, 2.5 * h**-0.5))
    return specs


_INTERNLM2_NAMES = {
    "model.embed_tokens.weight": "model.tok_embeddings.weight",
    "lm_head.weight": "output.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _internlm2_tensors(tensors, num_heads: int, num_kv_heads: int, head_dim: int):
    """Llama-named (name, shape, make) -> InternLM2's names, each layer's q, k and v packed into
    attention.wqkv: for each KV head, its num_heads / num_kv_heads query heads, its key, its
    value."""
    groups = num_heads // num_kv_heads
    by_name = {name: (shape, make) for name, shape, make in tensors}

    def pack(prefix: str):
        q, k, v = (by_name[f"{prefix}self_attn.{p}_proj.weight"][1]() for p in "qkv")
        h = q.shape[1]
        rows = np.concatenate([q.reshape(num_kv_heads, groups, head_dim, h),
                               k.reshape(num_kv_heads, 1, head_dim, h),
                               v.reshape(num_kv_heads, 1, head_dim, h)], axis=1)
        return rows.reshape(-1, h)

    out = []
    for name, shape, make in tensors:
        layer_part = name.split(".", 3)[3] if name.startswith("model.layers.") else None
        if layer_part in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            continue
        if layer_part == "self_attn.q_proj.weight":
            prefix = name[:-len(layer_part)]
            out.append((prefix + "attention.wqkv.weight",
                        ((num_heads + 2 * num_kv_heads) * head_dim, shape[1]),
                        functools.partial(pack, prefix)))
        elif layer_part is not None:
            out.append((name[:-len(layer_part)] + _INTERNLM2_NAMES[layer_part], shape, make))
        else:
            out.append((_INTERNLM2_NAMES.get(name, name), shape, make))
    return out


def _gpt_bigcode_param_specs(*, hidden_size: int, num_layers: int, num_heads: int,
                             num_kv_heads: int, intermediate_size: int, vocab_size: int,
                             max_position_embeddings: int, tie_word_embeddings: bool,
                             **_) -> List[Tuple[str, Tuple[int, ...], float, float]]:
    """(name, shape, mean, std) of a GPTBigCodeForCausalLM's parameters, in HF order."""
    h, i = hidden_size, intermediate_size
    qkv = h + 2 * num_kv_heads * (h // num_heads)
    # As _param_specs: tied embeddings small, the final norm's weight large (logits ~N(0, 2.5^2)).
    emb_std = 0.1 if tie_word_embeddings else 1.0
    final_norm = 3.0 if tie_word_embeddings else 1.0
    specs = [("transformer.wte.weight", (vocab_size, h), 0.0, emb_std),
             ("transformer.wpe.weight", (max_position_embeddings, h), 0.0, emb_std)]
    for layer in range(num_layers):
        p = f"transformer.h.{layer}."
        specs += [
            (p + "ln_1.weight", (h,), 1.0, 0.05),
            (p + "ln_1.bias", (h,), 0.0, 0.05),
            (p + "attn.c_attn.weight", (qkv, h), 0.0, h**-0.5),
            (p + "attn.c_attn.bias", (qkv,), 0.0, 0.2),
            (p + "attn.c_proj.weight", (h, h), 0.0, h**-0.5),
            (p + "attn.c_proj.bias", (h,), 0.0, 0.05),
            (p + "ln_2.weight", (h,), 1.0, 0.05),
            (p + "ln_2.bias", (h,), 0.0, 0.05),
            (p + "mlp.c_fc.weight", (i, h), 0.0, h**-0.5),
            (p + "mlp.c_fc.bias", (i,), 0.0, 0.2),
            (p + "mlp.c_proj.weight", (h, i), 0.0, i**-0.5),
            (p + "mlp.c_proj.bias", (h,), 0.0, 0.05),
        ]
    specs += [("transformer.ln_f.weight", (h,), final_norm, 0.05 * final_norm),
              ("transformer.ln_f.bias", (h,), 0.0, 0.05)]
    if not tie_word_embeddings:
        specs.append(("lm_head.weight", (vocab_size, h), 0.0, 2.5 * h**-0.5))
    return specs


def _gpt_bigcode_config(*, hidden_size: int, num_layers: int, num_heads: int,
                        num_kv_heads: int, intermediate_size: int, vocab_size: int,
                        max_position_embeddings: int, tie_word_embeddings: bool,
                        dtype: str) -> Dict[str, object]:
    """A GPTBigCodeForCausalLM ``config.json`` (its keys as StarCoder's has them)."""
    if num_kv_heads not in (1, num_heads):
        raise ValueError(f"gpt_bigcode has one KV head (multi-query) or one per head "
                         f"({num_heads}), not {num_kv_heads}")
    return {
        "architectures": ["GPTBigCodeForCausalLM"],
        "model_type": "gpt_bigcode",
        "activation_function": "gelu_pytorch_tanh",
        "attention_softmax_in_fp32": True,
        "scale_attention_softmax_in_fp32": True,
        "scale_attn_weights": True,
        "multi_query": num_kv_heads == 1,
        "n_embd": hidden_size,
        "n_head": num_heads,
        "n_inner": intermediate_size,
        "n_layer": num_layers,
        "n_positions": max_position_embeddings,
        "layer_norm_epsilon": 1e-05,
        "initializer_range": 0.02,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _make_tensor(name: str, shape: Tuple[int, ...], mean: float, std: float, seed: int) -> np.ndarray:
    # One generator per tensor, seeded from (seed, name): independent of order and sharding.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])
    arr = rng.standard_normal(shape, dtype=np.float32)
    arr *= np.float32(std)
    if mean:
        arr += np.float32(mean)
    return arr


def _to_dtype_bytes(arr: np.ndarray, dtype: str) -> bytes:
    if dtype == "float32":
        return np.ascontiguousarray(arr, dtype="<f4").tobytes()
    if dtype == "float16":
        return np.ascontiguousarray(arr, dtype="<f2").tobytes()
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(arr).astype("<u2").tobytes()
    raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")


def _safetensors_header(entries: List[Tuple[str, Tuple[int, ...], str, int]]) -> bytes:
    """entries: (name, shape, st_dtype, nbytes) in file order. Returns the 8-byte length + JSON."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, st_dtype, nbytes in entries:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(blob)) + blob


def _split_shards(sizes: List[int], num_shards: int) -> List[List[int]]:
    """Split tensor indices (in order) into ``num_shards`` contiguous non-empty groups of ~equal bytes."""
    n = len(sizes)
    num_shards = max(1, min(num_shards, n))
    total = sum(sizes)
    groups: List[List[int]] = []
    start = 0
    acc = 0
    for s in range(num_shards):
        remaining_shards = num_shards - s
        if remaining_shards == 1:
            groups.append(list(range(start, n)))
            break
        target = total * (s + 1) / num_shards
        end = start + 1  # at least one tensor per shard
        acc += sizes[start]
        # leave at least one tensor for each remaining shard
        while end < n - (remaining_shards - 1) and acc + sizes[end] / 2 <= target:
            acc += sizes[end]
            end += 1
        groups.append(list(range(start, end)))
        start = end
    return groups


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def make_tiny_model(
    out_dir: str,
    *,
    architecture: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: Optional[int] = None,
    intermediate_size: int = 128,
    vocab_size: int = 1024,
    tie_word_embeddings: bool = False,
    qkv_bias: bool = False,
    rope_scaling: Optional[str] = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    num_shards: int = 1,
    seed: int = 0,
    dtype: str = "float32",
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: Sequence[int] = (),
    alibi: bool = False,
    w8a8: bool = False,
) -> str:
    """Write a random-weight model with a trained tokenizer to ``out_dir``; return ``out_dir``.

    ``architecture``: ``"llama"`` (a LlamaForCausalLM, or with ``qkv_bias=True`` a
    Qwen2ForCausalLM), ``"qwen3"`` (a Qwen3ForCausalLM: per-head q/k norms, no biases),
    ``"internlm"`` (an InternLMForCausalLM: Llama with biases on the q, k, v and o projections,
    multi-head attention, its config as internlm-7b's), ``"internlm2"`` (an InternLM2ForCausalLM:
    Llama under InternLM2's weight names, q, k and v packed per KV group in one wqkv, dynamic NTK
    rope scaling as internlm2-chat-7b's) or ``"qwen3_moe"`` (a
    Qwen3MoeForCausalLM: Qwen3's attention, and on the layers transformers makes sparse
    (``decoder_sparse_step``, ``mlp_only_layers``) ``num_experts`` SwiGLU experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token; the MoE arguments are
    read for this architecture only); or
    ``"gpt_bigcode"`` (a GPTBigCodeForCausalLM: ``num_kv_heads`` 1 is multi-query, or equal to
    ``num_heads``; no rotary, so the rope arguments do not apply).
    ``"baichuan2"`` is a BaichuanForCausalLM as Baichuan2-7B's config.json and weights have it
    (model_type baichuan, q/k/v packed in ``self_attn.W_pack``, an ``lm_head`` that the model
    normalizes, as many kv heads as heads); with ``alibi`` as Baichuan2-13B's (no
    max_position_embeddings in config.json: ALiBi instead of rotary positions).
    ``head_dim``: default ``hidden_size // num_heads``. ``rope_scaling``: None or ``"llama3"``.
    ``dtype``: float32, float16 or bfloat16 (weights are drawn in float32 and converted).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; expected one of "
                         f"{', '.join(ARCHITECTURES)}")
    qwen3 = architecture in ("qwen3", "qwen3_moe")
    moe = architecture == "qwen3_moe"
    baichuan = architecture == "baichuan2"
    if alibi and not baichuan:
        raise ValueError("alibi is Baichuan2-13B's (architecture baichuan2)")
    if baichuan and (num_kv_heads != num_heads or qkv_bias or tie_word_embeddings):
        raise ValueError("baichuan2 packs q, k and v of the same size without biases "
                         "(num_kv_heads = num_heads) and has an untied NormHead")
    moe_layers = [i for i in range(num_layers) if moe and i not in mlp_only_layers
                  and (i + 1) % decoder_sparse_step == 0]
    if moe and not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok {num_experts_per_tok} must be in 1..num_experts "
                         f"({num_experts})")
    internlm = architecture == "internlm"
    internlm2 = architecture == "internlm2"
    if (qwen3 or internlm or internlm2) and qkv_bias:
        raise ValueError("qkv_bias is Qwen2's (architecture llama); Qwen3 has no q/k/v biases "
                         "and InternLM always has them")
    if internlm and num_kv_heads != num_heads:
        raise ValueError("InternLM has multi-head attention: num_kv_heads must be num_heads")
    if (internlm or internlm2) and rope_scaling == "llama3":
        raise ValueError("InternLM's rope scaling is dynamic NTK, not llama3")
    bigcode = architecture == "gpt_bigcode"
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        head_dim = hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for rotary embeddings")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    if rope_scaling not in (None, "none", "llama3"):
        raise ValueError(f"unsupported rope_scaling {rope_scaling!r}; expected None or 'llama3'")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # --- config.json -------------------------------------------------------------------------
    arch, model_type = (("Qwen3MoeForCausalLM", "qwen3_moe") if moe
                        else ("Qwen3ForCausalLM", "qwen3") if qwen3
                        else ("InternLMForCausalLM", "internlm") if internlm
                        else ("InternLM2ForCausalLM", "internlm2") if internlm2
                        else ("Qwen2ForCausalLM", "qwen2") if qkv_bias
                        else ("LlamaForCausalLM", "llama"))
    config: Dict[str, object] = {
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "model_type": model_type,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING) if rope_scaling == "llama3" else None,
        "rope_theta": float(rope_theta),
        "tie_word_embeddings": bool(tie_word_embeddings),
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if qwen3:
        config.update({"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": num_layers})
    if baichuan:                    # Baichuan2-7B's config.json keys
        config = {k: config[k] for k in (
            "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
            "intermediate_size", "max_position_embeddings", "num_attention_heads",
            "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "torch_dtype",
            "use_cache", "vocab_size")}
        config.update({"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan",
                       "model_max_length": max_position_embeddings, "pad_token_id": 0,
                       "z_loss_weight": 0})
        if alibi:                   # Baichuan2-13B's config.json names no position limit
            del config["max_position_embeddings"]
    elif moe:
        config.update({"num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                       "moe_intermediate_size": moe_intermediate_size,
                       "norm_topk_prob": bool(norm_topk_prob),
                       "decoder_sparse_step": decoder_sparse_step,
                       "mlp_only_layers": sorted(mlp_only_layers)})
    elif internlm:
        # internlm-7b's config.json: no num_key_value_heads, head_dim or rope_theta; "bias"
        # for the attention's projections and "rotary" for the rotary base.
        for key in ("num_key_value_heads", "head_dim", "rope_theta", "rope_scaling"):
            del config[key]
        config.update({"bias": True, "rotary": {"base": float(rope_theta), "type": "dynamic"}})
    elif internlm2:
        # internlm2-chat-7b's config.json: no head_dim; no biases; dynamic NTK rope scaling
        del config["head_dim"]
        config.update({"bias": False, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    elif qkv_bias:
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers})
    else:
        config.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    if bigcode:
        config = _gpt_bigcode_config(
            hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
            vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings, dtype=dtype)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "do_sample": False},
    )

    # --- tokenizer ---------------------------------------------------------------------------
    tok = train_tokenizer(vocab_size, markers=QWEN3_MARKERS if qwen3 else ())
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    for fname, content in _tokenizer_files(tok, max_position_embeddings).items():
        _write_json(out / fname, content)

    # --- weights -----------------------------------------------------------------------------
    specs = (_gpt_bigcode_param_specs if bigcode else _param_specs)(
        max_position_embeddings=max_position_embeddings,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=qkv_bias or internlm,
        o_bias=internlm,
        qk_norm=qwen3,
        packed_qkv=baichuan,
        norm_head=baichuan,
        num_experts=num_experts,
        moe_intermediate_size=moe_intermediate_size,
        moe_layers=moe_layers,
    )
    tensors = [(name, shape, functools.partial(_make_tensor, name, shape, mean, std, seed))
               for name, shape, mean, std in specs]
    if internlm2:
        tensors = _internlm2_tensors(tensors, num_heads, num_kv_heads, head_dim)
    st_dtype, itemsize = _DTYPES[dtype]
    sizes = [int(np.prod(shape)) * itemsize for _, shape, _ in tensors]
    groups = _split_shards(sizes, num_shards)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    if len(groups) == 1:
        filenames = ["model.safetensors"]
    else:
        filenames = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map: Dict[str, str] = {}
    for fname, group in zip(filenames, groups):
        entries = [(tensors[k][0], tensors[k][1], st_dtype, sizes[k]) for k in group]
        with open(out / fname, "wb") as f:
            f.write(_safetensors_header(entries))
            for k in group:
                name, _, make = tensors[k]
                f.write(_to_dtype_bytes(make(), dtype))
                weight_map[name] = fname
    if len(groups) > 1:
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
        )
    _write_json(out / GENERATOR_STAMP, {"generator": GENERATOR_VERSION})
    if w8a8:        # the same model as a W8A8 int8 checkpoint
        from llm_serving.quantize import quantize_model
        with tempfile.TemporaryDirectory(dir=str(out.parent)) as tmp:
            shutil.copytree(out, Path(tmp) / "float")
            quantize_model(str(Path(tmp) / "float"), str(out), overwrite=True)
    return str(out)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _bool_flag(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llm_serving.model_executor.tiny_model",
        description="Write a random-weight Llama/Qwen2/Qwen3/InternLM(2) model with a trained BPE "
        "tokenizer (HF format).",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny: 64 hidden, 2 layers, vocab 1024 (default); tiny-qwen3: the "
                        "same size as a Qwen3ForCausalLM (head_dim 32, tied embeddings); "
                        "tiny-qwen3-moe: a Qwen3MoeForCausalLM (3 layers, 8 experts, top 2, "
                        "layer 1 dense); tiny-internlm: an InternLMForCausalLM (q/k/v/o "
                        "biases); tiny-internlm2: an InternLM2ForCausalLM (GQA, packed wqkv); "
                        "tiny-gpt-bigcode: a GPTBigCodeForCausalLM (StarCoder's layout: "
                        "multi-query, learned positions); tiny-baichuan2: a BaichuanForCausalLM "
                        "as Baichuan2-7B (W_pack, NormHead, rotary); tiny-baichuan2-alibi: as "
                        "Baichuan2-13B (ALiBi, 6 heads); tiny-w8a8: tiny as a W8A8 int8 "
                        "checkpoint (compressed-tensors, llm_serving.quantize); bench: "
                        "the ~97M model; bench-gqa: ~287M, 16 query heads on 4 kv heads")
    parser.add_argument("--architecture", choices=ARCHITECTURES,
                        help="llama (default; Qwen2 with --qkv-bias), qwen3, qwen3_moe, "
                        "internlm, internlm2, gpt_bigcode or baichuan2")
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--num-kv-heads", type=int)
    parser.add_argument("--head-dim", type=int, help="default: hidden size / heads")
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--tie-word-embeddings", type=_bool_flag, nargs="?", const=True, default=None)
    parser.add_argument("--qkv-bias", type=_bool_flag, nargs="?", const=True, default=None,
                        help="add q/k/v biases (makes a Qwen2ForCausalLM)")
    parser.add_argument("--rope-scaling", choices=["none", "llama3"], default=None)
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--alibi", type=_bool_flag, nargs="?", const=True, default=None,
                        help="baichuan2: ALiBi instead of rotary (Baichuan2-13B's layout)")
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument("--num-shards", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dtype", choices=sorted(_DTYPES))
    args = parser.parse_args(argv)

    kwargs: Dict[str, object] = dict(PRESETS[args.preset])
    for key in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "qkv_bias",
                "rope_theta", "max_position_embeddings", "num_shards", "seed", "dtype",
                "alibi"):
        value = getattr(args, key)
        if value is not None:
            kwargs[key] = value
    if args.rope_scaling is not None:
        kwargs["rope_scaling"] = None if args.rope_scaling == "none" else args.rope_scaling
    t0 = time.perf_counter()
    out = make_tiny_model(args.out, **kwargs)  # type: ignore[arg-type]
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
