"""W8A8 int8 checkpoints of GPTBigCode (StarCoder's layout: c_attn packs q, k and v, multi-query
or one KV head per head; every projection with a float bias), written by python -m
llm_serving.quantize (c_attn quantized as one layer, as llm-compressor does) or re-made with
per-tensor static scales, against test_w8a8.py's torch emulation of vLLM's W8A8 math put in
place of transformers' GPTBigCode linear layers: c_attn whole on its packed int8 rows (in
transformers' own layout, so the reference does not cut it as our loader does), its bias in the
epilogue."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM
from llm_serving.errors import ModelLoadError
from llm_serving.quantize import quantize_model
from test_model_parity import _prefill_logits, _prompts
from test_w8a8 import (GREEDY, VOCAB, W8A8Linear, assert_greedy_agrees, assert_logits_agree,
                       assert_two_ranks_agree, per_tensor_static, reference)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

LINEAR = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))
ROW_PARALLEL = ("c_proj",)


def emulated_bigcode(float_dir: str, w8a8_dir: str, splits: int = 1):
    """transformers' GPTBigCode of ``float_dir`` with each linear layer ``w8a8_dir`` quantizes
    computing W8A8 from its tensors; ``splits`` as W8A8Linear's for the row-parallel c_proj."""
    tensors = load_file(str(Path(w8a8_dir) / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir,
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == "GPTBigCodeForCausalLM"
    for i, block in enumerate(model.transformer.h):
        for module, proj in LINEAR:
            name = f"transformer.h.{i}.{module}.{proj}"
            q, scale = tensors[name + ".weight"], tensors[name + ".weight_scale"]
            static = tensors.get(name + ".input_scale")
            setattr(getattr(block, module), proj, W8A8Linear(
                q, np.broadcast_to(scale.reshape(-1, 1), (len(q), 1)),
                None if static is None else float(static.reshape(-1)[0]),
                splits if proj in ROW_PARALLEL else 1, tensors[name + ".bias"]))
    return model


def _multi_head(root: Path) -> str:
    """The tiny GPTBigCode with multi_query false: c_attn packs q, k and v per head."""
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(root / "mha"), **dict(PRESETS["tiny-gpt-bigcode"],
                                                     num_kv_heads=4, seed=3))


@pytest.fixture(scope="module")
def variants(gpt_bigcode_model_dir, tmp_path_factory):
    """{name: (checkpoint, prompts, reference logits, reference greedy tokens)}, with
    name:model the emulated model and name:float its float checkpoint."""
    root = tmp_path_factory.mktemp("w8a8-bigcode")
    mqa = quantize_model(gpt_bigcode_model_dir, str(root / "mqa"))
    mha_float = _multi_head(root)
    prompts = _prompts(VOCAB)[:6]
    out = {}
    for name, float_dir, d in (
            ("multi-query-dynamic-channel", gpt_bigcode_model_dir, mqa),
            ("multi-query-static-tensor", gpt_bigcode_model_dir,
             per_tensor_static(mqa, root / "mqa-static", lambda _: 0.03)),
            ("multi-head-dynamic-channel", mha_float,
             quantize_model(mha_float, str(root / "mha-w8a8")))):
        out[name + ":model"] = model = emulated_bigcode(float_dir, d)
        out[name + ":float"] = float_dir
        out[name] = (d, prompts, *reference(model, prompts))
    return out


@pytest.mark.parametrize("name", ["multi-query-dynamic-channel", "multi-query-static-tensor",
                                  "multi-head-dynamic-channel"])
def test_logits_and_greedy_tokens_match_the_emulated_w8a8_gpt_bigcode(variants, name):
    d, prompts, ref_logits, ref_tokens = variants[name]
    llm = LLM(d, block_size=16, num_blocks=256)
    int8 = sorted(n for n, c in llm.engine.runner.model.cells_and_names()
                  if getattr(c, "int8", 0))
    assert int8 == sorted(f"transformer.h.{i}.{m}.{p}" for i in range(2) for m, p in LINEAR)
    assert_logits_agree(_prefill_logits(llm, prompts), ref_logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_agrees(variants[name + ":model"], prompts,
                         [o.outputs[0].token_ids for o in outs], ref_tokens)


def test_w8a8_is_not_the_float_model(variants):
    d, prompts, ref_logits, _ = variants["multi-query-dynamic-channel"]
    float_model = transformers.AutoModelForCausalLM.from_pretrained(
        variants["multi-query-dynamic-channel:float"], dtype=torch.float32).eval()
    with torch.no_grad():
        fl = float_model(torch.tensor([prompts[-1]])).logits[0].numpy()
    assert np.abs(fl - ref_logits[-1]).max(1).min() > 1e-2


def test_two_tensor_parallel_ranks_match_the_emulation_of_their_slices(variants):
    """Each rank takes its query heads' rows of c_attn (and their scale rows) and the single KV
    head's whole, half of c_fc's rows, and half of each c_proj's columns (quantizing its own
    slice of the activations; the bias added once, after the sum)."""
    name = "multi-query-dynamic-channel"
    d, prompts, _, _ = variants[name]
    assert_two_ranks_agree(d, emulated_bigcode(variants[name + ":float"], d, splits=2),
                           prompts[:4])


def test_quantize_keeps_biases_and_embeddings_float_and_a_quantized_head_is_refused(
        variants, tmp_path):
    d = variants["multi-query-dynamic-channel"][0]
    t = load_file(str(Path(d) / "model.safetensors"))
    c_attn = t["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.dtype == np.int8 and c_attn.shape == (64 + 2 * 16, 64)
    assert t["transformer.h.0.attn.c_attn.weight_scale"].shape == (len(c_attn), 1)
    quantized = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
    assert all(t[n].dtype == np.float32 for n in t if not n.endswith(quantized))
    bad = tmp_path / "head"
    shutil.copytree(d, bad)
    t["lm_head.weight"] = np.zeros(t["transformer.wte.weight"].shape, np.int8)
    t["lm_head.weight_scale"] = np.ones((len(t["lm_head.weight"]), 1), np.float32)
    save_file(t, str(bad / "model.safetensors"))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'lm_head.weight.*quantized LM head"):
        LLM(str(bad), num_blocks=16)
