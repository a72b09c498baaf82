"""vLLM's LLM.collective_rpc / apply_model and the dev route POST /collective_rpc
(llm_serving/executor/collective_rpc.py): one result per model process in rank order, in
process ("uni", CPU graphs on) and over two tensor-parallel WorkAgents ("mp"); a failing call
raises with the worker's message and the engine goes on; the timeout; the size bounds; new
weights (reload_weights, apply_model) checked against transformers with the same weights;
the dev route's answers and errors."""
from __future__ import annotations

import time

import pytest
import requests

from llm_serving import LLM, SamplingParams
from llm_serving.executor.collective_rpc import MAX_RPC_BYTES, CollectiveRPCError
from conftest import hf_causal_lm
from rpc_helpers import boom
from test_http_server import free_port, serve_model, stop_server

torch = pytest.importorskip("torch")

PROMPT = [5, 77, 300, 12, 901, 44, 8]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _start(model_dir, backend: str, tp: int) -> LLM:
    return LLM(model_dir, distributed_executor_backend=backend, tensor_parallel_size=tp,
               num_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def uni_llm(tiny_model_dir):
    """In process: CPU graphs replay its decode steps."""
    llm = _start(tiny_model_dir, "uni", 1)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tp_llm(tiny_model_dir):
    """Two WorkAgents: ranks 0 and 1 of tensor parallelism."""
    llm = _start(tiny_model_dir, "mp", 2)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(params=["uni_llm", "tp_llm"])
def llm(request):
    return request.getfixturevalue(request.param)


def _greedy(llm) -> list[int]:
    return list(llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0]
                .outputs[0].token_ids)


def test_one_result_per_worker_in_rank_order(llm):
    n = llm.get_world_size()
    assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"] * n
    got = llm.collective_rpc(lambda w, a, b=0: (w.rank, w.tp_size, w.is_driver_worker, a + b),
                             args=(1,), kwargs={"b": 2})
    assert got == [(r, n, r == 0, 3) for r in range(n)]
    assert llm.collective_rpc("check_health") == [None] * n
    # each rank holds its shard of the fused qkv projection (4 query, 2 KV heads)
    c = llm.engine.config.model.hf
    rows = llm.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj.gemm_shape[0])
    assert rows == [(c.num_heads + 2 * c.num_kv_heads) * c.head_dim // n] * n
    with pytest.raises(NotImplementedError, match="'no_such_method' is not implemented"):
        llm.collective_rpc("no_such_method")


def test_a_failing_call_raises_its_message_and_the_engine_goes_on(llm):
    before = _greedy(llm)
    with pytest.raises(CollectiveRPCError, match="ValueError: boom 7 on rank 0") as e:
        llm.collective_rpc(boom, args=(7,))
    assert isinstance(e.value, RuntimeError)        # as vLLM's
    assert _greedy(llm) == before
    assert llm.collective_rpc(lambda w: "still serving") == ["still serving"] * \
        llm.get_world_size()
    # a Worker method named with arguments it does not take: a TypeError before it is sent
    with pytest.raises(TypeError, match=r"collective_rpc\(check_health\): too many"):
        llm.collective_rpc("check_health", args=(1,))


def test_timeout_and_sizes_over_the_workagents(tp_llm):
    """(In process a call runs on the caller's thread, as in vLLM's in-process executor:
    no timeout, nothing pickled.)"""
    llm = tp_llm
    before = _greedy(llm)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
        llm.collective_rpc(lambda w: time.sleep(2) or "late", timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    # the late answer is dropped: the next call gets its own result (vLLM's got the late one)
    assert llm.collective_rpc(lambda w: "mine") == ["mine", "mine"]
    assert _greedy(llm) == before
    with pytest.raises(ValueError, match=f"over the limit of {MAX_RPC_BYTES}"):
        llm.collective_rpc(lambda w, x: len(x), args=(b"x" * (MAX_RPC_BYTES + 1),))
    with pytest.raises(CollectiveRPCError, match=f"the result is .* bytes pickled, over the "
                                                 f"limit of {MAX_RPC_BYTES}"):
        llm.collective_rpc(lambda w: b"y" * (MAX_RPC_BYTES + 1))
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        llm.collective_rpc("check_health", timeout=0)
    assert _greedy(llm) == before


def _hf_check(llm, hf) -> None:
    """Greedy decoding here (decode steps replayed from CPU graphs in process) picks
    transformers' argmax with transformers' logprob, on the weights ``hf`` holds."""
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + ids])).logits[0], -1).numpy()
    for i, (tok, lp) in enumerate(zip(ids, out.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert lp[tok].logprob == pytest.approx(row[tok], abs=2e-4)
        assert row[tok] >= row.max() - 2e-4


def test_reload_weights_serves_the_new_weights_as_transformers(llm, tiny_model_dir, tmp_path):
    hf = hf_causal_lm(tiny_model_dir)
    _hf_check(llm, hf)                  # (in process: the decode steps are captured now)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "mlp" in name or "embed_tokens" in name or name == "model.norm.weight":
                p.mul_(1.5)
    hf.save_pretrained(tmp_path)       # an RLHF trainer's checkpoint of the new weights
    assert llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path)}) == \
        [None] * llm.get_world_size()
    llm.reset_prefix_cache()            # computed with the old weights (as vLLM's examples)
    _hf_check(llm, hf)
    # back to the checkpoint, then only the changed tensors, as torch tensors
    llm.collective_rpc("reload_weights")
    llm.reset_prefix_cache()
    changed = [(k, v) for k, v in hf.state_dict().items()
               if not torch.equal(v, original[k])]
    assert len(changed) > 3
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": changed})
    llm.reset_prefix_cache()
    _hf_check(llm, hf)
    # a fused parameter given in part stores nothing
    with pytest.raises(CollectiveRPCError, match="qkv_proj.weight"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [
            ("model.layers.0.self_attn.q_proj.weight", original[
                "model.layers.0.self_attn.q_proj.weight"] * 2)]})
    _hf_check(llm, hf)
    hf.load_state_dict(original)
    llm.collective_rpc("reload_weights")
    llm.reset_prefix_cache()
    _hf_check(llm, hf)


def test_apply_model_weight_changes_are_served(uni_llm, tiny_model_dir):
    """A callable writing weights: a Linear through set_weight (the [out, in] float32 of
    this rank's shard), a norm's Parameter replaced; CPU graphs and the LM head's copy are
    made again after it."""
    llm = uni_llm
    hf = hf_causal_lm(tiny_model_dir)
    _hf_check(llm, hf)
    with torch.no_grad():
        down = hf.model.layers[1].mlp.down_proj.weight
        down.mul_(-1.0)
        hf.model.norm.weight.mul_(0.5)
        new_down = down.numpy().copy()
        new_norm = hf.model.norm.weight.numpy().copy()

    def write(model):
        from mindspore import Tensor
        model.model.layers[1].mlp.down_proj.set_weight(new_down, in_place=True)
        model.model.norm.weight.set_data(Tensor(new_norm))
    llm.apply_model(write)
    llm.reset_prefix_cache()
    _hf_check(llm, hf)
    llm.collective_rpc("reload_weights")
    llm.reset_prefix_cache()


@pytest.fixture(scope="module")
def dev_server(tiny_model_dir):
    proc, url = serve_model(tiny_model_dir, port=free_port(), num_blocks=64,
                            env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield url
    finally:
        assert stop_server(proc) == 0


def test_dev_route(dev_server, tmp_path):
    url = dev_server + "/collective_rpc"
    assert requests.post(url, json={"method": "check_health"}).json() == {"results": [None]}
    # a worker's error: a 500 with its message; the server goes on
    r = requests.post(url, json={"method": "reload_weights",
                                 "kwargs": {"weights_path": str(tmp_path / "none")}})
    assert r.status_code == 500 and "failed on the WorkAgent" in r.json()["error"]["message"]
    body = {"model": requests.get(dev_server + "/v1/models").json()["data"][0]["id"],
            "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    first = requests.post(dev_server + "/v1/completions", json=body)
    assert first.status_code == 200
    assert requests.post(url, json={"method": "reload_weights", "args": [],
                                    "timeout": 30}).json() == {"results": [None]}
    assert requests.post(dev_server + "/v1/completions", json=body).json()["choices"][0][
        "text"] == first.json()["choices"][0]["text"]
    # a timeout: vLLM's 500 with the message; the agent finishes the reload, the server goes on
    r = requests.post(url, json={"method": "reload_weights", "timeout": 1e-6})
    assert r.status_code == 500 and "did not finish within" in r.json()["error"]["message"]
    assert requests.post(url, json={"method": "check_health"}).json() == {"results": [None]}
    assert requests.post(dev_server + "/v1/completions", json=body).json()["choices"][0][
        "text"] == first.json()["choices"][0]["text"]
    for bad, field in (({"method": "no_such"}, "method"), ({"method": 3}, "method"),
                       ({"method": "check_health", "code": "x"}, "code"),
                       ({"method": "check_health", "timeout": -1}, "timeout"),
                       ({"args": []}, "method"),
                       # arguments the method does not take: the request's fault, not sent
                       ({"method": "check_health", "args": ["/x"]}, "args"),
                       ({"method": "check_health", "kwargs": {"weights": 1}}, "args"),
                       ({"method": "reload_weights", "kwargs": {"nope": 1}}, "args")):
        r = requests.post(url, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)

