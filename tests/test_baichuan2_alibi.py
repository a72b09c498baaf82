"""BaichuanForCausalLM in Baichuan2-13B's layout (ALiBi instead of rotary, W_pack, NormHead)
against a torch implementation of Baichuan2-13B's forward pass written here from its remote
code (modeling_baichuan.py: _get_interleave's slopes, the alibi mask slope * key position
added to q.k / sqrt(d), RMSNorm, SwiGLU, the normalized head), on the built-in tiny
Baichuan2-13B (6 heads, not a power of two). Prefill logits within 5e-3 for one prompt and a
ragged batch; greedy tokens and their logprobs after chunked prefills (a 40-token budget)
mixed with decodes, many decode steps, replayed ones included; two tensor-parallel ranks (3
heads and their slopes each); a real server answering llm-serving's /models/llama2/generate.
The slopes are checked against BLOOM's in transformers."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.errors import ConfigError
from llm_serving.executor.shm_channel import segments_of
from llm_serving.model_executor.attention.alibi import alibi_slopes
from llm_serving.model_executor.loader import ModelConfig
from test_model_parity import _prefill_logits, _prompts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 1024
NEW_TOKENS = 32


def get_interleave(n):
    """Baichuan2-13B's modeling_baichuan.py, as it is."""
    def get_interleave_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_interleave_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_interleave_power_of_2(closest_power_of_2)
            + get_interleave(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


class Baichuan13B:
    """Baichuan2-13B's forward pass over one whole sequence, float32."""

    def __init__(self, model_dir):
        self.cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.w = safetensors_torch.load_file(str(Path(model_dir) / "model.safetensors"))
        self.head = torch.nn.functional.normalize(self.w["lm_head.weight"], dim=-1)
        self.slopes = torch.tensor(get_interleave(self.cfg["num_attention_heads"]))

    def rms(self, x, name):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(var + self.cfg["rms_norm_eps"]))

    @torch.no_grad()
    def logits(self, ids):
        c, w = self.cfg, self.w
        n, heads = len(ids), c["num_attention_heads"]
        d = c["hidden_size"] // heads
        h = w["model.embed_tokens.weight"][torch.tensor(ids)]
        # the alibi mask: slope * key position (the same for every query row), future -inf
        mask = torch.full((n, n), float("-inf")).triu(1)
        bias = self.slopes[:, None, None] * torch.arange(n)[None, None, :] + mask
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            q, k, v = (x @ w[p + "self_attn.W_pack.weight"].T).view(n, 3, heads, d).unbind(1)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            s = q @ k.transpose(1, 2) / math.sqrt(d) + bias
            a = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(n, -1)
            h = h + a @ w[p + "self_attn.o_proj.weight"].T
            x = self.rms(h, p + "post_attention_layernorm.weight")
            g = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
            h = h + (g * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return (self.rms(h, "model.norm.weight") @ self.head.T).numpy()

    def greedy(self, prompt, new_tokens=NEW_TOKENS):
        """Greedy tokens (the model's stop tokens ignored) and their logprobs."""
        ids, logprobs = list(prompt), []
        for _ in range(new_tokens):
            lp = torch.log_softmax(torch.from_numpy(self.logits(ids)[-1]), -1)
            ids.append(int(lp.argmax()))
            logprobs.append(float(lp[ids[-1]]))
        return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def alibi_dir(tmp_path_factory):
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("b13") / "tiny-baichuan2-alibi"),
                           **PRESETS["tiny-baichuan2-alibi"])


@pytest.fixture(scope="module")
def reference(alibi_dir):
    model = Baichuan13B(alibi_dir)
    prompts = _prompts(VOCAB)
    return prompts, [model.logits(p) for p in prompts], [model.greedy(p) for p in prompts]


@pytest.fixture(scope="module")
def alibi_llm(alibi_dir):
    return LLM(alibi_dir, block_size=16, num_blocks=256)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("n", [1, 4, 6, 8, 12, 40, 64])
def test_slopes_are_baichuans_and_blooms(n):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    ours = alibi_slopes(n)
    np.testing.assert_allclose(ours, get_interleave(n), rtol=1e-6)
    bloom = build_alibi_tensor(torch.ones(1, 2), n, torch.float32)[:, 0, 1]   # slope * 1
    np.testing.assert_allclose(ours, bloom.numpy(), rtol=1e-6)


def test_baichuan2_13b_config_json_is_read_as_alibi():
    # Baichuan2-13B-Chat's config.json (auto_map left out): no max_position_embeddings, no
    # rope_theta
    cfg = {"architectures": ["BaichuanForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
           "gradient_checkpointing": False, "hidden_act": "silu", "hidden_size": 5120,
           "initializer_range": 0.02, "intermediate_size": 13696, "model_max_length": 4096,
           "model_type": "baichuan", "num_attention_heads": 40, "num_hidden_layers": 40,
           "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.29.2", "use_cache": True,
           "vocab_size": 125696}
    c = ModelConfig.from_dict(cfg)
    assert c.alibi and c.norm_head and (c.head_dim, c.max_position_embeddings) == (128, 4096)
    assert ModelConfig.from_dict(c.to_hf_dict()) == c
    assert "max_position_embeddings" not in c.to_hf_dict()
    # Baichuan2-7B's size is rotary whatever the file names, as in vLLM
    assert not ModelConfig.from_dict(dict(cfg, hidden_size=4096, num_attention_heads=32)).alibi


@pytest.mark.parametrize("native_ops", [False, True], ids=["cpu-kernels", "mindspore-ops"])
def test_prefill_logits_match_single_and_batched(alibi_dir, alibi_llm, reference, native_ops,
                                                 monkeypatch):
    prompts, ref_logits, _ = reference
    llm = alibi_llm
    if native_ops:                  # the layers' MindSpore ops; attention stays the backend's
        monkeypatch.setenv("LLM_SERVING_NATIVE_OPS", "1")
        llm = LLM(alibi_dir, block_size=16, num_blocks=256)
    single = _prefill_logits(llm, [prompts[-1]])[0]
    np.testing.assert_allclose(single, ref_logits[-1], atol=5e-3, rtol=0)
    for ours, ref in zip(_prefill_logits(llm, prompts), ref_logits):
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)


def _check_greedy(outs, ref_greedy):
    for out, (tokens, logprobs) in zip(outs, ref_greedy):
        o = out.outputs[0]
        assert o.token_ids == tokens
        ours = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
        np.testing.assert_allclose(ours, logprobs, atol=5e-3, rtol=0)


def test_greedy_after_chunked_prefill_and_many_decode_steps(alibi_dir, reference):
    """A 40-token budget splits the long prompts into chunks that share steps with the others'
    decodes; 32 decode steps each, most of them replayed."""
    prompts, _, ref_greedy = reference
    llm = LLM(alibi_dir, block_size=16, num_blocks=256, max_num_batched_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _check_greedy(outs, ref_greedy)
    stats = llm.engine.runner.graphs.stats
    assert stats.replayed_steps > 10 and not stats.failed


def test_two_tensor_parallel_ranks(alibi_dir, reference):
    """Each rank holds 3 of the 6 heads and their slopes (heads 0-2: the power-of-two part;
    3-5: the interleaved ones)."""
    prompts, _, ref_greedy = reference
    pin = "0|1" if len(os.sched_getaffinity(0)) >= 2 else None
    before = segments_of()
    llm = LLM(alibi_dir, tensor_parallel_size=2, cpu_affinity=pin, block_size=16,
              num_blocks=256)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], GREEDY)
    finally:
        llm.engine.shutdown()
    _check_greedy(outs, ref_greedy[:6])
    assert not segments_of() - before, "shared memory left behind"


def test_ascend_backend_refuses_alibi_by_name():
    from llm_serving.model_executor.attention.ascend import AscendAttentionBackend
    with pytest.raises(ConfigError, match="ALiBi"):
        AscendAttentionBackend(6, 6, 16, alibi_slopes=alibi_slopes(6))


def test_server_answers_llm_serving_generate(tmp_path, alibi_dir, alibi_llm):
    import requests

    from test_http_server import free_port, start_server, stop_server
    proc, url, _ = start_server(tmp_path, alibi_dir, agent_ports=(free_port(),))
    try:
        body = {"inputs": "Give three tips", "parameters": {"max_new_tokens": 12,
                                                            "ignore_eos": True}}
        r = requests.post(url + "/models/llama2/generate", json=body, timeout=120)
    finally:
        assert stop_server(proc) == 0
    assert r.status_code == 200, r.text
    offline = alibi_llm.generate("Give three tips", SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert r.json()["generated_text"] == offline.text and offline.text
