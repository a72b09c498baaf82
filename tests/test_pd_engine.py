"""PD disaggregation inside one process: a producer engine and a consumer engine joined by the
InProcessConnector (the same engine paths as the Mooncake connectors), against one colocated
engine. Greedy outputs through P then D must be the colocated ones, blocks must come back,
and a transfer that times out, fails or is aborted must never hang or leak."""
from __future__ import annotations

import time

import numpy as np
import pytest

from llm_serving.config import EngineArgs
from llm_serving.engine.llm_engine import LLMEngine
from llm_serving.engine.sequence import SequenceStatus
from llm_serving.sampling_params import SamplingParams

BS = 8


def _engine(model, role=None, eid=None, **kv):
    cfg = None
    if role is not None:
        cfg = {"kv_connector": "InProcessConnector", "kv_role": role, "engine_id": eid, **kv}
    return LLMEngine(EngineArgs(model, num_blocks=96, block_size=BS, kv_transfer_config=cfg))


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def pd(tiny_model_dir):
    return (_engine(tiny_model_dir, "kv_producer", "P", kv_transfer_timeout=5),
            _engine(tiny_model_dir, "kv_consumer", "D", kv_transfer_timeout=5))


def drive(main, others=(), timeout=30.0) -> dict:
    """Step ``main`` until its requests are done (stepping ``others`` with work too); the final
    outputs by request id. Fails on a hang."""
    finals, deadline = {}, time.monotonic() + timeout
    while main.get_num_unfinished_requests():
        for o in main.step():
            if o.finished:
                finals[o.request_id] = o
        for e in others:
            if e.has_unfinished_requests():
                e.step()
        assert time.monotonic() < deadline, "the engines hung"
    return finals


def settle(*engines, timeout=10.0) -> None:
    """Step until no engine has work (transfers included)."""
    deadline = time.monotonic() + timeout
    while any(e.has_unfinished_requests() for e in engines):
        for e in engines:
            if e.has_unfinished_requests():
                e.step()
        assert time.monotonic() < deadline, "transfers never ended"


def greedy(max_tokens, kv=None, logprobs=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs, kv_transfer_params=kv)


def prefill_on_p(P, prompts):
    for i, ids in enumerate(prompts):
        P.add_request({"prompt_token_ids": ids}, greedy(1, {"do_remote_decode": True}),
                      request_id=f"p{i}")
    outs = drive(P)
    return [outs[f"p{i}"].kv_transfer_params for i in range(len(prompts))]


PROMPTS = [list(range(3, 3 + n)) for n in (37, 16, 5, 61)]   # k blocks + r, exact, < 1 block


def test_p_then_d_is_token_identical_to_colocated_with_logprobs_within_1e_5(pd, colocated):
    P, D = pd
    for i, ids in enumerate(PROMPTS):
        colocated.add_request({"prompt_token_ids": ids}, greedy(12, logprobs=3),
                              request_id=f"c{i}")
    ref = drive(colocated)
    params = prefill_on_p(P, PROMPTS)
    # Full blocks only, the last prompt token always left to the consumer.
    assert [len(p["remote_block_ids"]) for p in params] == [4, 1, 0, 7]
    assert P.block_manager.num_free_blocks == 96 - 12      # deferred release: held for D
    before = D.stats.num_prefill_tokens
    for i, ids in enumerate(PROMPTS):
        D.add_request({"prompt_token_ids": ids}, greedy(12, params[i], logprobs=3),
                      request_id=f"d{i}")
    outs = drive(D, [P])
    for i in range(len(PROMPTS)):
        r, d = ref[f"c{i}"].outputs[0], outs[f"d{i}"].outputs[0]
        assert d.token_ids == r.token_ids
        for er, ed in zip(r.logprobs, d.logprobs):
            assert er.keys() == ed.keys()
            np.testing.assert_allclose([v.logprob for v in ed.values()],
                                       [v.logprob for v in er.values()], atol=1e-5)
    st = D.get_stats()
    assert st.kv_transfers == {"done": 3}         # the short prompt had nothing to move
    assert st.kv_remote_prefill_tokens == 8 * (4 + 1 + 7)
    # D computed only what was not transferred (one token per prompt at least).
    assert D.stats.num_prefill_tokens - before == sum(map(len, PROMPTS)) - 8 * 12
    assert st.kv_transfer_bytes > 0
    settle(P, D)
    assert P.block_manager.usage == 0.0 and D.block_manager.usage == 0.0


@pytest.mark.parametrize("kv,skip,other,other_skip", [
    ("bfloat16", None, "float32", None), ("float16", None, "bfloat16", None),
    ("fp8", None, "fp8_e5m2", None), ("fp8", ["1"], "fp8", None)])
def test_narrow_kv_moves_fewer_bytes_and_a_dtype_mismatch_is_computed(tiny_model_dir, kv, skip,
                                                                      other, other_skip):
    """--kv-cache-dtype bfloat16, float16 or fp8 (or fp8 with layer 1 at fp32:
    kv_cache_dtype_skip_layers) on both sides: P then D gives the tokens of a colocated engine
    of those dtypes and moves its blocks (each layer's bytes); a consumer with another cache
    dtype in any layer (float32, or another of the same width: the same bytes, other values)
    does not load them (it would read garbage) but computes the prompt under the recompute
    policy."""
    from llm_serving.config import kv_bytes_per_block

    def engine(role=None, eid=None, kv_dtype=kv, kv_skip=skip):
        cfg = None if role is None else {"kv_connector": "InProcessConnector", "kv_role": role,
                                         "engine_id": eid, "kv_transfer_timeout": 5}
        return LLMEngine(EngineArgs(tiny_model_dir, num_blocks=96, block_size=BS,
                                    kv_cache_dtype=kv_dtype, kv_cache_dtype_skip_layers=kv_skip,
                                    kv_transfer_config=cfg))
    tag = f"{kv}-{skip}"
    colo, P, D = engine(), engine("kv_producer", f"P-{tag}"), engine("kv_consumer", f"D-{tag}")
    for i, ids in enumerate(PROMPTS):
        colo.add_request({"prompt_token_ids": ids}, greedy(12), request_id=f"c{i}")
    ref = drive(colo)
    params = prefill_on_p(P, PROMPTS)
    for i, ids in enumerate(PROMPTS):
        D.add_request({"prompt_token_ids": ids}, greedy(12, params[i]), request_id=f"d{i}")
    outs = drive(D, [P])
    assert [outs[f"d{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
        [ref[f"c{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]
    st = D.get_stats()
    assert st.kv_transfers == {"done": 3}
    hf = D.model_config
    assert st.kv_transfer_bytes == 12 * kv_bytes_per_block(hf, BS, 1, D.config.model
                                                           .kv_layer_dtypes)
    settle(P, D)

    D_other = engine("kv_consumer", f"D-{other}-{other_skip}", kv_dtype=other,
                     kv_skip=other_skip)
    params = prefill_on_p(P, PROMPTS[:1])
    D_other.add_request({"prompt_token_ids": PROMPTS[0]}, greedy(12, params[0]), request_id="x")
    out = drive(D_other, [P])["x"]
    assert len(out.outputs[0].token_ids) == 12
    assert D_other.get_stats().kv_transfers.get("done", 0) == 0
    settle(P, D_other)


def test_an_unread_offer_is_released_after_the_timeout(tiny_model_dir):
    P = _engine(tiny_model_dir, "kv_producer", "P-expire", kv_transfer_timeout=0.5)
    (params,) = prefill_on_p(P, [list(range(40))])
    assert P.block_manager.usage > 0 and P.has_unfinished_requests()
    t0 = time.monotonic()
    settle(P)
    assert 0.3 < time.monotonic() - t0 < 5
    assert P.block_manager.usage == 0.0
    assert P.get_stats().kv_blocks_held == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_transfer_forced_to_time_out_follows_the_policy(tiny_model_dir, colocated, policy):
    P = _engine(tiny_model_dir, "kv_producer", f"P-{policy}", kv_transfer_timeout=5)
    D = _engine(tiny_model_dir, "kv_consumer", f"D-{policy}", kv_transfer_timeout=0.3,
                kv_failure_policy=policy, kv_connector_extra_config={"load_delay": 2.0})
    ids = list(range(7, 50))
    colocated.add_request({"prompt_token_ids": ids}, greedy(6), request_id="ref")
    ref = drive(colocated)["ref"].outputs[0].token_ids
    (params,) = prefill_on_p(P, [ids])
    # A second request with no transfer is not held up by the one waiting for its KV.
    D.add_request({"prompt_token_ids": ids}, greedy(6, params), request_id="slow")
    D.add_request({"prompt_token_ids": [5, 6, 7]}, greedy(3), request_id="other")
    t0 = time.monotonic()
    outs = drive(D, [P])
    assert time.monotonic() - t0 < 2.0                 # the timeout, not the 2 s delay
    assert outs["other"].outputs[0].finish_reason == "length"
    st = D.get_stats()
    assert st.kv_transfers == {"timeout": 1}
    if policy == "recompute":
        assert outs["slow"].outputs[0].token_ids == ref and outs["slow"].error is None
        assert st.kv_transfer_recomputes == 1
    else:
        assert outs["slow"].outputs[0].finish_reason == "abort"
        assert "KV transfer failed" in outs["slow"].error and "timed out" in outs["slow"].error
        assert st.kv_transfer_recomputes == 0
    # /metrics' prompt tokens by source: none loaded; the aborted one never had a first token
    computed = len(ids) + 3 if policy == "recompute" else 3
    assert st.prompt_tokens_by_source == {"local_compute": computed, "local_cache_hit": 0,
                                          "external_kv_transfer": 0}
    settle(P, D)             # P's offer expires unread; D's failed read ended
    assert P.block_manager.usage == 0.0 and D.block_manager.usage == 0.0


def test_abort_during_the_transfer_frees_blocks_on_both_sides(tiny_model_dir):
    P = _engine(tiny_model_dir, "kv_producer", "P-abort", kv_transfer_timeout=1.0)
    D = _engine(tiny_model_dir, "kv_consumer", "D-abort", kv_transfer_timeout=1.0,
                kv_connector_extra_config={"load_delay": 0.3})
    (params,) = prefill_on_p(P, [list(range(50))])
    D.add_request({"prompt_token_ids": list(range(50))}, greedy(4, params), request_id="d")
    D.step()
    D.step()
    seq = D.requests["d"].seqs[0]
    assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert D.scheduler.running == [] and D.scheduler.waiting == []   # no slot, no queue
    held = D.block_manager.usage
    assert held > 0
    out = D.abort_request("d")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert D.block_manager.usage == held         # the read may still write: kept
    settle(P, D)
    assert P.block_manager.usage == 0.0 and D.block_manager.usage == 0.0


def test_a_different_prompt_is_not_loaded_but_computed(pd, colocated):
    P, D = pd
    (params,) = prefill_on_p(P, [list(range(10, 60))])
    other = list(range(11, 61))
    colocated.add_request({"prompt_token_ids": other}, greedy(5), request_id="ref2")
    ref = drive(colocated)["ref2"].outputs[0].token_ids
    before = D.get_stats()
    D.add_request({"prompt_token_ids": other}, greedy(5, params), request_id="mismatch")
    out = drive(D, [P])["mismatch"]
    assert out.outputs[0].token_ids == ref
    after = D.get_stats()
    assert after.kv_transfer_recomputes == before.kv_transfer_recomputes + 1
    assert after.kv_remote_prefill_tokens == before.kv_remote_prefill_tokens
    settle(P, D)


def test_n_completions_on_the_consumer_fork_from_the_loaded_prompt(pd, colocated):
    """n > 1 through P then D (a proxy sends P n = 1): D loads the prompt once and its n
    sequences are the colocated engine's, logprobs within 1e-5; no block stays held."""
    P, D = pd
    ids = list(range(300, 337))         # a prompt D's prefix cache has not seen
    params = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    colocated.add_request({"prompt_token_ids": ids}, params, request_id="cn")
    ref = drive(colocated)["cn"]
    kv = prefill_on_p(P, [ids])[0]
    before = D.get_stats().kv_transfers.get("done", 0)
    D.add_request({"prompt_token_ids": ids},
                  SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True,
                                 logprobs=2, kv_transfer_params=kv), request_id="dn")
    out = drive(D, [P])["dn"]
    assert len(out.outputs) == 3
    for r, d in zip(ref.outputs, out.outputs):
        assert d.token_ids == r.token_ids
        for er, ed in zip(r.logprobs, d.logprobs):
            np.testing.assert_allclose([v.logprob for v in ed.values()],
                                       [v.logprob for v in er.values()], atol=1e-5)
    assert D.get_stats().kv_transfers.get("done", 0) == before + 1
    settle(P, D)
    assert P.block_manager.usage == 0.0 and D.block_manager.usage == 0.0


def test_kv_transfer_params_are_refused_by_name_where_they_cannot_work(pd, colocated):
    P, D = pd
    with pytest.raises(ValueError, match="^kv_transfer_params: this instance has no KV"):
        colocated.add_request("hi", greedy(2, {"do_remote_decode": True}))
    with pytest.raises(ValueError, match="^kv_transfer_params: do_remote_decode needs"):
        D.add_request("hi", greedy(2, {"do_remote_decode": True}))
    with pytest.raises(ValueError, match="^kv_transfer_params: do_remote_prefill needs"):
        P.add_request("hi", greedy(2, {"do_remote_prefill": True}))
    with pytest.raises(ValueError, match="kv_transfer_params: do_remote_decode needs n = 1"):
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="kv_transfer_params must be a JSON object"):
        SamplingParams(kv_transfer_params=[1])


def test_a_load_the_workers_never_report_is_given_up_by_the_scheduler(tiny_model_dir,
                                                                      colocated, monkeypatch):
    """The backstop: should a worker never answer for a load, the request still recomputes
    (kv_transfer_timeout + a grace), and an offer nobody reports is freed after expiry."""
    from llm_serving.engine import remote_kv
    monkeypatch.setattr(remote_kv, "BACKSTOP_GRACE_S", 0.2)
    P = _engine(tiny_model_dir, "kv_producer", "P-silent", kv_transfer_timeout=0.5)
    D = _engine(tiny_model_dir, "kv_consumer", "D-silent", kv_transfer_timeout=0.5)
    D.runner.kv_connector._poll_reads = lambda now: None      # a read that never ends
    P.runner.kv_connector._poll_sent = lambda now: None       # an offer never reported
    ids = list(range(9, 44))
    colocated.add_request({"prompt_token_ids": ids}, greedy(5), request_id="ref3")
    ref = drive(colocated)["ref3"].outputs[0].token_ids
    (params,) = prefill_on_p(P, [ids])
    D.add_request({"prompt_token_ids": ids}, greedy(5, params), request_id="d")
    t0 = time.monotonic()
    out = drive(D, [P], timeout=10)["d"]
    assert 0.6 < time.monotonic() - t0 < 5
    assert out.outputs[0].token_ids == ref
    assert D.get_stats().kv_transfer_recomputes == 1
    deadline = time.monotonic() + 5
    while P.block_manager.usage > 0:
        P.step()
        assert time.monotonic() < deadline
    assert D.get_stats().kv_blocks_held > 0       # the never-ended read keeps its blocks


def test_a_request_scoring_its_prompt_computes_it_instead_of_loading(pd, colocated):
    """Prompt logprobs need every prompt row's logits: such a request never loads KV."""
    P, D = pd
    ids = list(range(20, 60))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    colocated.add_request({"prompt_token_ids": ids}, params, request_id="ref-plp")
    ref = drive(colocated)["ref-plp"]
    (kv,) = prefill_on_p(P, [ids])
    loaded = D.get_stats().kv_remote_prefill_tokens
    D.add_request({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2,
        kv_transfer_params=kv), request_id="d-plp")
    out = drive(D, [P])["d-plp"]
    assert D.get_stats().kv_remote_prefill_tokens == loaded
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(out.prompt_logprobs) == len(ids)
    for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([v.logprob for v in a.values()],
                                   [v.logprob for v in b.values()], atol=1e-5)
    settle(P, D)


def test_the_offer_is_relative_so_the_hosts_clocks_need_not_agree(tiny_model_dir):
    """P's kv_transfer_params carry the time the offer is held (``ttl``), no absolute time;
    D counts it from the request's arrival on its own clock (here an hour ahead of P's),
    less a margin for the way from P."""
    from types import SimpleNamespace

    from llm_serving.distributed.kv_transfer.base import KVConnectorRole
    from llm_serving.distributed.kv_transfer.config import KVTransferConfig
    from llm_serving.distributed.kv_transfer.in_process import InProcessConnector
    cfg = KVTransferConfig.from_dict({"kv_connector": "InProcessConnector", "kv_role": "kv_both",
                                      "kv_transfer_timeout": 5})
    P = InProcessConnector(cfg, KVConnectorRole.SCHEDULER, BS)
    D = InProcessConnector(cfg, KVConnectorRole.SCHEDULER, BS)
    ids = PROMPTS[0]
    keep, params = P.request_finished(SimpleNamespace(
        request_id="p", prompt_token_ids=ids, kv_transfer_params={"do_remote_decode": True}),
        list(range(10)))
    assert keep and "expires_at" not in params and 4.9 <= params["ttl"] <= 5
    arrival = time.time() + 3600                          # D's clock, an hour ahead
    seq = SimpleNamespace(request_id="d", prompt_token_ids=ids, kv_transfer_params=params,
                          arrival_time=arrival)
    n, is_async = D.get_num_new_matched_tokens(seq, 0)
    assert (n, is_async) == (4 * BS, True)
    D.update_state_after_alloc(seq, list(range(20, 25)), n)
    load = D.build_connector_meta().loads[D.load_key(seq)]
    assert load["params"]["expires_at"] == pytest.approx(arrival + params["ttl"] - 0.5)


def test_an_offer_the_consumer_will_not_read_is_freed_at_once(tiny_model_dir):
    """D tells P when it will not read an offer, so P's blocks come back at once rather than
    when the offer expires (60 s here): D's own prefix cache holds the prompt, the offer is
    for another prompt, the request scores its prompt, or it is aborted before its load."""
    P = _engine(tiny_model_dir, "kv_producer", "P-decline", kv_transfer_timeout=60)
    D = _engine(tiny_model_dir, "kv_consumer", "D-decline", kv_transfer_timeout=60)
    seen = list(range(30, 70))
    D.add_request({"prompt_token_ids": seen}, greedy(3), request_id="warm")
    ref = drive(D)["warm"].outputs[0].token_ids

    def offer(ids):
        (params,) = prefill_on_p(P, [ids])
        assert params["remote_block_ids"] and P.get_stats().kv_blocks_held > 0
        return params

    def released_at_once():
        settle(P, D, timeout=3)
        assert P.get_stats().kv_blocks_held == 0 and P.block_manager.usage == 0.0

    D.add_request({"prompt_token_ids": seen}, greedy(3, offer(seen)), request_id="hit")
    assert drive(D, [P])["hit"].outputs[0].token_ids == ref
    assert D.get_stats().kv_transfers == {}                 # nothing was read
    released_at_once()

    D.add_request({"prompt_token_ids": list(range(31, 71))},
                  greedy(3, offer(list(range(80, 120)))), request_id="other")
    drive(D, [P])
    released_at_once()

    D.add_request({"prompt_token_ids": seen}, SamplingParams(
        temperature=0.0, max_tokens=2, prompt_logprobs=1,
        kv_transfer_params=offer(list(range(130, 170)))), request_id="plp")
    drive(D, [P])
    released_at_once()

    D.add_request({"prompt_token_ids": list(range(200, 240))},
                  greedy(3, offer(list(range(200, 240)))), request_id="gone")
    D.abort_request("gone")
    released_at_once()
    assert D.get_stats().kv_transfers == {"failed": 1}      # only the mismatched offer
