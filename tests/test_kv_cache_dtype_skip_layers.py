"""--kv-cache-dtype-skip-layers (vLLM 0.32's kv_cache_dtype_skip_layers): the layers it names
keep their KV cache at auto's dtype (float32 on CPU) while the others store kv_cache_dtype.

References are independent of our code: HF transformers with fp32 weights whose keys and
values are rounded by torch to the narrow dtype in the other layers only, and the KV pool's
size counted from the model's shape."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from test_low_precision import TORCH_KV, _rounding_kv_attention
from llm_serving import LLM, SamplingParams
from llm_serving.config import EngineArgs
from llm_serving.errors import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16
SKIP = [0, 2]           # the first and last of qwen2-mqa-tied's three layers


def hf_partly_rounded(path, kv, skip, prompt):
    """HF whose layers outside ``skip`` attend over K/V rounded to ``kv``: each layer's K and V
    over ``prompt`` as its attention saw them ([T, KVH, D]), and its greedy tokens."""
    rounding, seen = _rounding_kv_attention(*TORCH_KV[kv]), {}

    def attention(module, query, key, value, attention_mask, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        fn = sdpa_attention_forward if module.layer_idx in skip else rounding
        seen.setdefault(module.layer_idx, (key[0].transpose(0, 1).numpy().copy(),
                                           value[0].transpose(0, 1).numpy().copy()))
        return fn(module, query, key, value, attention_mask, **kw)
    name = f"{kv}_kv_except_{'_'.join(map(str, skip))}"
    transformers.AttentionInterface.register(name, attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=name).eval()
    with torch.no_grad():
        g = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return seen, g[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.mark.parametrize("kv,storage", [("fp8_e4m3", ml_dtypes.float8_e4m3fn),
                                        ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_skipped_layers_keep_exact_kv_and_the_engine_matches_hf(model_dirs, kv, storage):
    """FP8 KV with the first and last layers skipped: those layers' caches hold HF's fp32 keys
    and values (within fp32 noise), the middle one FP8's rounding of them, and greedy tokens
    (through replayed decode steps) are HF's with only the middle layer's K/V rounded."""
    from llm_serving.engine.input_builder import build_step_input
    path = model_dirs["qwen2-mqa-tied"]
    prompt = np.random.default_rng(11).integers(3, 1024, 40).tolist()
    prefill, want = hf_partly_rounded(path, kv, set(SKIP), prompt)

    llm = LLM(path, kv_cache_dtype=kv, kv_cache_dtype_skip_layers=[str(i) for i in SKIP],
              num_blocks=64)
    eng = llm.engine
    caches = eng.runner.kv_caches
    assert [k.dtype for k, _ in caches] == [np.float32, storage, np.float32]
    rid = eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    step = build_step_input(eng.scheduler.schedule(), eng.config.cache.block_size, set()).step
    eng.runner.forward(step, np.arange(len(step.input_ids)))
    eng.abort_request(rid)
    for layer, (k_cache, v_cache) in enumerate(caches):
        for cache, ref in zip((k_cache, v_cache), prefill[layer]):
            ours = cache.reshape(-1, *cache.shape[2:])[step.slot_mapping].astype(np.float32)
            if layer in SKIP:
                np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)
            else:       # FP8's rounding of fp32 K/V (a value on a rounding boundary may go
                        # either way: ours and HF's fp32 inputs differ by ~1e-7)
                rounded = torch.from_numpy(ref).to(TORCH_KV[kv][0]).float().numpy()
                assert np.mean(ours == rounded) > 0.99
                assert np.abs(ours - ref).max() > 1e-3      # really rounded
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert out.outputs[0].token_ids == want
    eng.shutdown()


def test_the_pool_holds_the_blocks_of_the_mixed_bytes(model_dirs):
    """A block's bytes are each layer's own: with fp8 and the first and last of three layers
    at fp32, 2 x 16 tokens x (4 + 1 + 4) bytes per KV value; the swap pool likewise."""
    path = model_dirs["qwen2-mqa-tied"]
    space, swap = 0.01, 0.005
    cfg = EngineArgs(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=SKIP,
                     kv_cache_space=space, preemption_mode="swap",
                     swap_space=swap).create_engine_config()
    kv_values = 1 * (96 // 6)           # one KV head of head_dim 16
    block = 2 * 16 * kv_values * (4 + 1 + 4)
    assert cfg.cache.num_blocks == int(space * 2**30) // block
    assert cfg.cache.num_cpu_blocks == int(swap * 2**30) // block
    assert cfg.model.kv_layer_dtypes == ("float32", "fp8_e4m3", "float32")
    plain = EngineArgs(path, kv_cache_dtype="fp8", kv_cache_space=space,
                       kv_cache_dtype_skip_layers=["sliding_window"]).create_engine_config()
    assert plain.cache.num_blocks == int(space * 2**30) // (2 * 16 * kv_values * 3)
    assert plain.model.kv_layer_dtypes == ("fp8_e4m3",) * 3     # no sliding-window layer


def test_the_flag_takes_vllms_command_line(model_dirs):
    from llm_serving.cli import build_parser, server_settings
    path = model_dirs["qwen2-mqa-tied"]
    args = build_parser().parse_args(["serve", path, "--kv-cache-dtype", "fp8_e5m2",
                                      "--kv-cache-dtype-skip-layers", "0", "2"])
    engine_args = server_settings(args)[0]
    assert engine_args.create_engine_config().model.kv_layer_dtypes == (
        "float32", "fp8_e5m2", "float32")


@pytest.mark.parametrize("skip,why", [
    (["3"], "out of range"), ([-1], "out of range"), (["0,2"], "neither"),
    (["attention"], "neither"), ("0", "expected a list"), ([True], "neither"),
])
def test_bad_layers_are_refused_naming_the_key(model_dirs, skip, why):
    with pytest.raises(ConfigError) as e:
        EngineArgs(model_dirs["qwen2-mqa-tied"], kv_cache_dtype="fp8",
                   kv_cache_dtype_skip_layers=skip).create_engine_config()
    assert e.value.key == "kv_cache_dtype_skip_layers" and why in str(e.value)


@pytest.mark.parametrize("connector", ["MooncakeConnector", "MooncakeStoreConnector"])
def test_mooncake_connectors_refuse_mixed_dtypes_by_name(model_dirs, connector):
    """Their transfers assume one block size for every layer's arrays."""
    path = model_dirs["qwen2-mqa-tied"]
    cfg = {"kv_connector": connector, "kv_role": "kv_both",
           "kv_connector_extra_config": ({"master_server_address": "127.0.0.1:50051"}
                                         if connector == "MooncakeStoreConnector" else {})}
    with pytest.raises(ConfigError) as e:
        EngineArgs(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=SKIP,
                   kv_transfer_config=cfg).create_engine_config()
    assert e.value.key == "kv_cache_dtype_skip_layers" and connector in str(e.value)
    # one dtype for every layer (skipping changes nothing with auto): taken
    EngineArgs(path, kv_cache_dtype_skip_layers=SKIP,
               kv_transfer_config=cfg).create_engine_config()


def test_tensor_parallel_ranks_keep_the_skipped_layers(tiny_model_dir):
    """Two WorkAgents, each holding its KV heads of layer 1 at fp32 and of layer 0 in FP8,
    give HF's greedy tokens with layer 0's K/V rounded."""
    prompt = np.random.default_rng(12).integers(3, 1024, 30).tolist()
    want = hf_partly_rounded(tiny_model_dir, "fp8_e4m3", {1}, prompt)[1]
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_dtype="fp8",
              kv_cache_dtype_skip_layers=["1"], num_blocks=64)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    llm.engine.shutdown()
    assert out.outputs[0].token_ids == want
