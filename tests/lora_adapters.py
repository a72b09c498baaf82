"""Random PEFT LoRA adapters for the tiny test models, and their reference: HF transformers'
model with each adapter merged into its weights by the test itself (W + scale * B @ A)."""
from __future__ import annotations

import json
import math
import os

import numpy as np

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {m: ("self_attn" if m in MODULES[:4] else "mlp") for m in MODULES}


def module_shape(cfg: dict, module: str) -> tuple[int, int]:
    """(in, out) of a target module, from an HF config.json dict."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def make_adapter(out_dir: str, model_dir: str, r: int = 8, alpha: float = 16,
                 targets=MODULES, seed: int = 0, rslora: bool = False,
                 std: float = 0.15, **config) -> str:
    """Write a random PEFT adapter for the model at ``model_dir``; ``config`` adds keys to
    adapter_config.json (e.g. use_dora=True)."""
    from safetensors.numpy import save_file
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            n_in, n_out = module_shape(cfg, m)
            prefix = f"base_model.model.model.layers.{layer}.{_BLOCK[m]}.{m}"
            tensors[prefix + ".lora_A.weight"] = rng.normal(0, std, (r, n_in)).astype(np.float32)
            tensors[prefix + ".lora_B.weight"] = rng.normal(0, std, (n_out, r)).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                   "target_modules": list(targets), "use_rslora": rslora, "bias": "none",
                   "base_model_name_or_path": model_dir, **config}, f)
    return out_dir


def merged_hf_model(model_dir: str, adapter_dir=None):
    """HF's LlamaForCausalLM of ``model_dir`` (fp32, eval) with the adapter merged in."""
    import torch
    import transformers
    from safetensors.numpy import load_file
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    if adapter_dir is None:
        return model
    acfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    r, alpha = acfg["r"], acfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if acfg.get("use_rslora") else alpha / r
    weights = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in weights.items():
            if ".lora_A." not in name:
                continue
            b = weights[name.replace(".lora_A.", ".lora_B.")]
            target = name[len("base_model.model."):].replace(".lora_A.weight", ".weight")
            delta = scale * (b.astype(np.float64) @ a.astype(np.float64))
            params[target] += torch.from_numpy(delta.astype(np.float32))
    return model


def hf_logits_and_greedy(model, prompt: list[int], new_tokens: int):
    import torch
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logits = model(ids).logits[0].numpy()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()
