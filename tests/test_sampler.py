"""The host sampler: per-request filters, seeds, penalties, min_tokens and logprobs.

Statistical tests draw many samples with fixed seeds, so they are deterministic; each checks
both that nothing forbidden is ever drawn and that the allowed tokens really are drawn.
"""
import numpy as np
import pytest

from llm_serving.executor.protocol import SamplerOutput, SamplingBatch
from llm_serving.sample.sampler import Sampler, _top_k_top_p_threshold, _top_values
from llm_serving.sampling_params import SamplingParams

# 0.999 quantiles of the chi-square distribution (df -> value).
CHI2_999 = {9: 27.877, 19: 43.820, 29: 58.301}


def batch_of(params, prompts=None, outputs=None, eos=()):
    b = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(b)]
    outputs = outputs if outputs is not None else [[] for _ in range(b)]
    return SamplingBatch.from_params(params, prompts, outputs, eos)


def draw(logits_row, params, n, seed=0, prompt=(), output=()):
    """n independent draws of one request: the row repeated n times in one batch."""
    logits = np.tile(np.asarray(logits_row, np.float32), (n, 1))
    batch = batch_of([params] * n, [list(prompt)] * n, [list(output)] * n)
    return Sampler(seed)(logits, batch).token_ids


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def nucleus(probs, top_p):
    """vLLM's top-p set: the smallest set of most likely tokens whose mass reaches top_p."""
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    return set(order[mass_before < top_p].tolist())


def chi_square(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def entropy_of(tokens, v):
    f = np.bincount(tokens, minlength=v) / len(tokens)
    f = f[f > 0]
    return float(-(f * np.log(f)).sum())


# --------------------------------------------------------------------------- greedy

def test_temperature_zero_equals_argmax_with_ties_to_lowest_id():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 1000)).astype(np.float32)
    logits[3, [10, 20]] = 50.0                      # a tie: the lower id wins
    out = Sampler(0)(logits, batch_of([SamplingParams(temperature=0.0)] * 16))
    expected = logits.argmax(axis=1)
    assert expected[3] == 10
    np.testing.assert_array_equal(out.token_ids, expected)
    assert out.token_ids.dtype == np.int64


def test_tiny_temperature_is_greedy_even_with_filters():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((8, 500)).astype(np.float32)
    params = SamplingParams(temperature=1e-6, top_k=5, top_p=0.5, seed=3)
    out = Sampler(0)(logits, batch_of([params] * 8))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))


# --------------------------------------------------------------------------- filters

@pytest.mark.parametrize("v, k", [(1000, 1), (1000, 2), (1000, 7), (2000, 50), (32000, 20),
                                  (32000, 300), (8192, 3000), (50257, 40)])
def test_top_k_never_emits_outside_the_top_k(v, k):
    rng = np.random.default_rng(v + k)
    logits = rng.standard_normal(v).astype(np.float32)
    tokens = draw(logits, SamplingParams(top_k=k), 3000, seed=k)
    allowed = set(np.argsort(-logits)[:k].tolist())
    assert set(tokens.tolist()) <= allowed
    # and it really samples among them (not just the argmax)
    assert len(set(tokens.tolist())) >= min(k, 0.4 * k + 1)


@pytest.mark.parametrize("v, sigma, top_p", [
    (1000, 1.0, 0.5),       # wide nucleus
    (1000, 3.0, 0.9),
    (32000, 3.0, 0.9),      # a few hundred tokens: the upper-set path
    (32000, 6.0, 0.8),      # a handful of tokens
    (32000, 0.5, 0.95),     # flat: the full-sort path
    (50257, 2.5, 0.7),      # vocab not a multiple of the slab width
])
def test_top_p_never_emits_outside_the_nucleus(v, sigma, top_p):
    rng = np.random.default_rng(int(sigma * 100) + v)
    logits = (rng.standard_normal(v) * sigma).astype(np.float32)
    temperature = 0.8
    probs = softmax(logits.astype(np.float64) / temperature)
    allowed = nucleus(probs, top_p)
    tokens = draw(logits, SamplingParams(temperature=temperature, top_p=top_p), 3000, seed=1)
    assert set(tokens.tolist()) <= allowed
    # tokens of the nucleus with >= 1% renormalized mass all show up
    mass = probs[list(allowed)].sum()
    likely = {t for t in allowed if probs[t] / mass >= 0.01}
    assert likely <= set(tokens.tolist())


def test_top_k_then_top_p_uses_the_top_k_renormalized_mass():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(4000) * 1.5).astype(np.float32)
    k, top_p = 30, 0.6
    top = np.argsort(-logits)[:k]
    probs = np.zeros(4000)
    probs[top] = softmax(logits[top])
    allowed = nucleus(probs, top_p)
    assert 1 < len(allowed) < k
    tokens = draw(logits, SamplingParams(top_k=k, top_p=top_p), 4000, seed=2)
    assert set(tokens.tolist()) == allowed


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_drops_tokens_below_min_p_times_the_max(min_p):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(3000) * 2).astype(np.float32)
    probs = softmax(logits)
    allowed = set(np.flatnonzero(probs >= min_p * probs.max()).tolist())
    tokens = draw(logits, SamplingParams(min_p=min_p), 3000, seed=3)
    assert set(tokens.tolist()) <= allowed
    mass = probs[list(allowed)].sum()
    assert {t for t in allowed if probs[t] / mass >= 0.01} <= set(tokens.tolist())


def test_filter_thresholds_match_a_sorting_reference():
    """The chunked top-k/top-p thresholds equal a plain full sort, on many shapes, incl. ties."""
    rng = np.random.default_rng(11)
    for trial in range(120):
        w = int(rng.choice([128, 1024, 8192, 32256]))
        n = int(rng.integers(1, 5))
        z = rng.standard_normal((n, w)) * float(rng.choice([0.3, 1, 3, 6, 10]))
        z[:, rng.integers(0, w, w // 10)] = -np.inf
        if trial % 5 == 0:
            z = np.round(z)
        p = np.exp(z - z.max(axis=1, keepdims=True)).astype(np.float32)
        k = np.minimum(rng.integers(0, 2000, n) * (rng.random(n) < 0.5), w - 1).astype(np.int32)
        tp = np.where(rng.random(n) < 0.7, rng.uniform(0.05, 0.999, n), 1.0).astype(np.float32)
        got, _ = _top_k_top_p_threshold(p, k, tp, k > 0, tp < 1)
        for i in range(n):
            srt = np.sort(p[i].astype(np.float64))[::-1]
            want = 0.0
            if k[i] > 0:
                want, srt = srt[k[i] - 1], srt[:k[i]]
            if tp[i] < 1:
                cum = np.cumsum(srt)
                want = max(want, srt[int(np.argmax(cum >= tp[i] * cum[-1]))])
            assert np.count_nonzero(p[i] >= got[i]) == np.count_nonzero(p[i] >= np.float32(want))


def test_top_values_is_exact():
    rng = np.random.default_rng(12)
    for v in [100, 1000, 32000, 32001, 50257]:
        for k in [1, 5, 20, 300]:
            a = rng.standard_normal((4, v)).astype(np.float32)
            a[0, :40] = a[0, 0]                       # ties
            vals, ids = _top_values(a, k, with_ids=True)
            np.testing.assert_array_equal(vals, np.sort(a, axis=1)[:, ::-1][:, :min(k, v)])
            np.testing.assert_array_equal(np.take_along_axis(a, ids, axis=1), vals)
            assert all(len(set(row)) == len(row) for row in ids.tolist())


# --------------------------------------------------------------------------- distribution

def test_temperature_one_matches_softmax():
    rng = np.random.default_rng(20)
    logits = rng.standard_normal(20).astype(np.float32)
    tokens = draw(logits, SamplingParams(temperature=1.0), 100_000, seed=4)
    assert chi_square(tokens, softmax(logits)) < CHI2_999[19]


def test_a_wrong_distribution_fails_the_chi_square_check():
    """The check above can fail: samples at temperature 0.8 are rejected as temperature 1."""
    rng = np.random.default_rng(20)
    logits = rng.standard_normal(20).astype(np.float32)
    tokens = draw(logits, SamplingParams(temperature=0.8), 100_000, seed=4)
    assert chi_square(tokens, softmax(logits)) > CHI2_999[19]


def test_large_vocab_matches_softmax_on_its_likely_tokens():
    """Two-level inverse CDF over 32000 entries: the 9 most likely tokens + the rest."""
    rng = np.random.default_rng(21)
    logits = (rng.standard_normal(32000) * 0.5).astype(np.float32)
    logits[rng.choice(32000, 9, replace=False)] += 8.0
    probs = softmax(logits)
    top = np.argsort(-probs)[:9]
    tokens = draw(logits, SamplingParams(), 6000, seed=5)
    bucket = np.full(32000, 9)
    bucket[top] = np.arange(9)
    grouped = np.append(probs[top], 1 - probs[top].sum())
    assert chi_square(bucket[tokens], grouped) < CHI2_999[9]


def test_temperature_below_one_sharpens_above_one_flattens():
    rng = np.random.default_rng(22)
    logits = (rng.standard_normal(30) * 1.5).astype(np.float32)
    h = {}
    for t in (0.5, 1.0, 2.0):
        tokens = draw(logits, SamplingParams(temperature=t), 50_000, seed=6)
        p = softmax(logits.astype(np.float64) / t)
        h[t] = entropy_of(tokens, 30)
        assert abs(h[t] - float(-(p * np.log(p)).sum())) < 0.03
        assert chi_square(tokens, p) < CHI2_999[29]
    assert h[0.5] < h[1.0] < h[2.0]


# --------------------------------------------------------------------------- seeds

def seeded_tokens(batch_params, logits, steps):
    """Tokens of every row over `steps` steps; row i's output length at step s is s."""
    b = len(batch_params)
    out = []
    sampler = Sampler(123)
    for s in range(steps):
        outputs = [[0] * s for _ in range(b)]
        out.append(sampler(logits[s], batch_of(batch_params, outputs=outputs)).token_ids)
    return np.array(out)


def test_seeded_request_reproduces_whatever_its_batch_position_and_companions():
    rng = np.random.default_rng(30)
    v, steps = 5000, 12
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    row_logits = (rng.standard_normal((steps, v)) * 1.0).astype(np.float32)

    alone = seeded_tokens([mine], row_logits[:, None, :], steps)[:, 0]

    companions = [SamplingParams(temperature=0.0), SamplingParams(top_k=5),
                  SamplingParams(temperature=1.3, seed=7),
                  SamplingParams(repetition_penalty=1.3, presence_penalty=1.0),
                  SamplingParams(min_p=0.1, logprobs=3), SamplingParams(), SamplingParams(top_p=0.3)]
    for pos in (0, 4, 7):
        params = companions[:pos] + [mine] + companions[pos:]
        logits = (rng.standard_normal((steps, len(params), v)) * 2).astype(np.float32)
        logits[:, pos] = row_logits
        got = seeded_tokens(params, logits, steps)[:, pos]
        np.testing.assert_array_equal(got, alone)
    # the seeded row really samples: it does not always pick the same rank
    assert len(set(alone.tolist())) > steps // 2


def test_different_seeds_give_different_samples_and_steps_differ():
    rng = np.random.default_rng(31)
    v = 2000
    logits = rng.standard_normal((20, 1, v)).astype(np.float32) * 0.1
    a = seeded_tokens([SamplingParams(seed=1)], logits, 20)[:, 0]
    b = seeded_tokens([SamplingParams(seed=2)], logits, 20)[:, 0]
    assert (a != b).sum() >= 15
    same_logits = np.repeat(logits[:1], 20, axis=0)
    c = seeded_tokens([SamplingParams(seed=1)], same_logits, 20)[:, 0]
    assert len(set(c.tolist())) >= 15                 # the step changes the draw


def test_seeded_draws_across_seeds_follow_the_distribution():
    rng = np.random.default_rng(32)
    logits = rng.standard_normal(10).astype(np.float32)
    n = 50_000
    params = [SamplingParams(seed=s) for s in range(n)]
    tokens = Sampler(0)(np.tile(logits, (n, 1)), batch_of(params)).token_ids
    assert chi_square(tokens, softmax(logits)) < CHI2_999[9]


def test_unseeded_rows_are_reproducible_from_the_sampler_seed():
    rng = np.random.default_rng(33)
    logits = rng.standard_normal((64, 1000)).astype(np.float32)
    batch = batch_of([SamplingParams()] * 64)
    a = Sampler(9)(logits, batch).token_ids
    np.testing.assert_array_equal(a, Sampler(9)(logits, batch).token_ids)
    assert (a != Sampler(10)(logits, batch).token_ids).any()


# --------------------------------------------------------------------------- penalties

def freq_of(tokens, t):
    return float(np.mean(tokens == t))


def test_logit_bias_is_added_before_the_repetition_penalty_as_vllm_does():
    """vLLM V1 adds logit_bias (a built-in logits processor) before the penalties: token 1,
    in the prompt, with logit 2 and bias 3 scores (2 + 3) / 2 = 2.5 under repetition_penalty
    2, below token 0's 3 (the penalty first would give it 4). A greedy row and a top-1 row."""
    params = [SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=1.0, top_k=1, repetition_penalty=2.0)]
    batch = batch_of(params, [[1], [1]])
    batch.bias_rows = np.array([0, 1], np.int32)
    batch.bias_ids = np.array([1, 1], np.int32)
    batch.bias_values = np.array([3.0, 3.0], np.float32)
    logits = np.array([[3.0, 2.0, 0.0, 0.0]] * 2, np.float32)
    assert Sampler(0)(logits, batch).token_ids.tolist() == [0, 0]


def test_repetition_penalty_lowers_seen_tokens_with_either_sign():
    logits = np.zeros(10, np.float32)
    logits[3], logits[7] = 1.0, -1.0
    base = draw(logits, SamplingParams(), 40_000, seed=1, prompt=[3], output=[7])
    pen = draw(logits, SamplingParams(repetition_penalty=2.0), 40_000, seed=1,
               prompt=[3], output=[7])
    processed = logits.copy()
    processed[3], processed[7] = 0.5, -2.0         # positive divided, negative multiplied
    assert chi_square(pen, softmax(processed)) < CHI2_999[9]
    assert freq_of(pen, 3) < freq_of(base, 3) - 0.03
    assert freq_of(pen, 7) < freq_of(base, 7) - 0.01
    # repetition_penalty < 1 favours them instead
    fav = draw(logits, SamplingParams(repetition_penalty=0.5), 40_000, seed=1, prompt=[3], output=[7])
    assert freq_of(fav, 3) > freq_of(base, 3) + 0.03


def test_presence_penalty_counts_output_not_prompt_and_negative_raises():
    logits = np.zeros(10, np.float32)
    base = draw(logits, SamplingParams(), 40_000, seed=2, prompt=[1], output=[2])
    pos = draw(logits, SamplingParams(presence_penalty=1.5), 40_000, seed=2, prompt=[1], output=[2, 2])
    neg = draw(logits, SamplingParams(presence_penalty=-1.5), 40_000, seed=2, prompt=[1], output=[2])
    expected = np.zeros(10)
    expected[2] = -1.5                             # once, however many times it was generated
    assert chi_square(pos, softmax(expected)) < CHI2_999[9]
    assert freq_of(pos, 2) < freq_of(base, 2) - 0.05
    assert freq_of(neg, 2) > freq_of(base, 2) + 0.2
    assert abs(freq_of(pos, 1) - freq_of(base, 1)) < 0.02   # the prompt does not count


def test_frequency_penalty_grows_with_the_count():
    logits = np.zeros(10, np.float32)
    tokens = draw(logits, SamplingParams(frequency_penalty=0.5), 40_000, seed=3,
                  prompt=[4], output=[5, 6, 6, 6])
    expected = np.zeros(10)
    expected[5], expected[6] = -0.5, -1.5
    assert chi_square(tokens, softmax(expected)) < CHI2_999[9]
    assert freq_of(tokens, 6) < freq_of(tokens, 5) < freq_of(tokens, 4)


def test_penalties_change_the_greedy_choice():
    logits = np.array([[0.0, 2.0, 1.9, 0.0, 1.0]] * 4, np.float32)
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.2),
              SamplingParams(temperature=0, presence_penalty=0.2),
              SamplingParams(temperature=0, frequency_penalty=0.05)]
    out = Sampler()(logits, batch_of(params, prompts=[[1]] * 4, outputs=[[1, 1, 1]] * 4))
    # 2.0/1.2 = 1.67 < 1.9; 2.0-0.2 = 1.8; 2.0-3*0.05 = 1.85
    np.testing.assert_array_equal(out.token_ids, [1, 2, 2, 2])


def test_penalties_apply_before_temperature():
    logits = np.zeros(10, np.float32)
    tokens = draw(logits, SamplingParams(temperature=0.5, presence_penalty=1.0), 40_000, seed=4,
                  output=[0])
    expected = np.zeros(10)
    expected[0] = -1.0 / 0.5
    assert chi_square(tokens, softmax(expected)) < CHI2_999[9]


# --------------------------------------------------------------------------- min_tokens

def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    v, eos = 50, 2
    logits = np.zeros((6, v), np.float32)
    logits[:, eos] = 30.0
    logits[:, 9] = 29.0                   # a stop token, next most likely
    logits[:, 11] = 28.0
    p = SamplingParams(min_tokens=3, stop_token_ids=[9], temperature=0.0)
    p_ignore = SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    params = [p, p, p, p_ignore, p_ignore, SamplingParams(temperature=0)]
    outputs = [[], [5], [5, 5, 5], [], [5, 5, 5, 5], []]
    out = Sampler(0)(logits, batch_of(params, outputs=outputs, eos={eos}))
    # below min_tokens: neither eos nor 9, even with ignore_eos; reached: eos again
    np.testing.assert_array_equal(out.token_ids, [11, 11, eos, 11, eos, eos])


def test_min_tokens_with_per_row_eos_sets():
    logits = np.zeros((2, 20), np.float32)
    logits[:, 4] = logits[:, 5] = 10.0
    params = [SamplingParams(min_tokens=2, temperature=0)] * 2
    batch = batch_of(params, eos=[{4}, {5}])
    np.testing.assert_array_equal(Sampler()(logits, batch).token_ids, [5, 4])


def test_random_rows_never_draw_a_banned_token():
    logits = np.zeros(8, np.float32)
    logits[0] = 5.0
    n = 5000
    batch = batch_of([SamplingParams(min_tokens=1, stop_token_ids=[3])] * n, eos={0})
    tokens = Sampler(1)(np.tile(logits, (n, 1)), batch).token_ids
    assert not np.isin(tokens, [0, 3]).any()
    assert set(tokens.tolist()) == {1, 2, 4, 5, 6, 7}


# --------------------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax_and_sum_to_one():
    rng = np.random.default_rng(40)
    v = 20
    logits = rng.standard_normal((3, v)).astype(np.float32) * 2
    params = [SamplingParams(logprobs=20), SamplingParams(temperature=0, logprobs=20),
              SamplingParams(temperature=0.5, top_k=3, presence_penalty=1.0, logprobs=20)]
    out = Sampler(0)(logits, batch_of(params, outputs=[[1], [1], [1]]))
    for i in range(3):
        ref = log_softmax(logits[i])
        assert abs(np.exp(out.top_logprobs[i].astype(np.float64)).sum() - 1.0) < 1e-5
        np.testing.assert_allclose(out.top_logprobs[i], np.sort(ref)[::-1], atol=1e-5)
        np.testing.assert_array_equal(out.top_token_ids[i], np.argsort(-ref))
        # the chosen token's value is the raw log_softmax, whatever processing chose it
        assert abs(out.logprobs[i] - ref[out.token_ids[i]]) < 1e-5
        assert out.ranks[i] == 1 + np.count_nonzero(ref > ref[out.token_ids[i]])
    assert out.ranks[1] == 1


def test_logprobs_zero_gives_the_chosen_token_only_and_every_row_gets_its_logprob():
    rng = np.random.default_rng(41)
    logits = rng.standard_normal((5, 300)).astype(np.float32)
    params = [SamplingParams(logprobs=0), SamplingParams(logprobs=3), SamplingParams(),
              SamplingParams(temperature=0), SamplingParams(logprobs=1, top_k=4)]
    for always in (True, False):
        out = Sampler(0, always_chosen_logprob=always)(logits, batch_of(params))
        assert out.top_token_ids.shape == (5, 3) and out.top_logprobs.shape == (5, 3)
        for i in range(5):
            ref = log_softmax(logits[i])
            if always or params[i].logprobs is not None:
                assert abs(out.logprobs[i] - ref[out.token_ids[i]]) < 1e-5
            else:   # not asked and not computed: marked so
                assert np.isnan(out.logprobs[i])
            if params[i].logprobs is not None:
                assert out.ranks[i] == 1 + np.count_nonzero(ref > ref[out.token_ids[i]])
        np.testing.assert_array_equal(out.top_token_ids[1], np.argsort(-logits[1])[:3])
        np.testing.assert_array_equal(out.top_token_ids[4, :1], np.argsort(-logits[4])[:1])
        assert np.all(np.diff(out.top_logprobs[1]) <= 0)
        # rows that did not ask for logprobs get no rank and no alternatives
        assert (out.ranks[2:4] == 0).all() and (out.top_token_ids[2:4] == -1).all()


def test_no_logprobs_requested_returns_no_tables_but_the_chosen_logprob():
    logits = np.zeros((2, 10), np.float32)
    out = Sampler(0)(logits, batch_of([SamplingParams()] * 2))
    assert out.top_token_ids is None and out.top_logprobs is None and out.ranks is None
    np.testing.assert_allclose(out.logprobs, np.log(0.1), atol=1e-6)
    out = Sampler(0, always_chosen_logprob=False)(logits, batch_of([SamplingParams()] * 2))
    assert np.isnan(out.logprobs).all()


def test_top_logprobs_exact_on_a_large_vocab():
    rng = np.random.default_rng(42)
    logits = rng.standard_normal((5, 32001)).astype(np.float32)
    out = Sampler(0)(logits, batch_of([SamplingParams(logprobs=20)] * 5))
    for i in range(5):
        ref = log_softmax(logits[i])
        np.testing.assert_array_equal(out.top_token_ids[i], np.argsort(-ref)[:20])
        np.testing.assert_allclose(out.top_logprobs[i], np.sort(ref)[::-1][:20], atol=1e-4)
        assert abs(out.logprobs[i] - ref[out.token_ids[i]]) < 1e-4


# --------------------------------------------------------------------------- robustness

def test_everything_banned_or_minus_inf_does_not_crash_or_nan():
    v = 6
    logits = np.full((3, v), -np.inf, np.float32)
    logits[0, 2] = 1.0
    logits[1] = 0.0
    logits[2] = 0.0
    params = [SamplingParams(logprobs=2), SamplingParams(min_tokens=1, stop_token_ids=[0, 1, 3, 4, 5]),
              SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[0, 1, 3, 4, 5])]
    batch = batch_of(params, eos={2})
    out = Sampler(0)(logits, batch)
    assert out.token_ids[0] == 2 and abs(out.logprobs[0]) < 1e-6
    assert ((0 <= out.token_ids) & (out.token_ids < v)).all()


def test_inf_logits_in_padding_and_float16_input():
    rng = np.random.default_rng(50)
    logits = rng.standard_normal((4, 1000)).astype(np.float16)
    logits[:, 900:] = -np.inf                         # padded vocabulary
    params = [SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(top_k=10, logprobs=5),
              SamplingParams(temperature=0)]
    for seed in range(20):
        out = Sampler(seed)(logits, batch_of(params))
        assert (out.token_ids < 900).all()
        assert np.isfinite(out.logprobs[2]) and np.isfinite(out.top_logprobs[2]).all()


def test_mixed_batch_shapes_and_dtypes():
    rng = np.random.default_rng(51)
    v = 8000
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.9, seed=1),
              SamplingParams(top_k=40, repetition_penalty=1.1, logprobs=2),
              SamplingParams(min_p=0.2, frequency_penalty=0.3, min_tokens=4, logprobs=0),
              SamplingParams(temperature=1.5, presence_penalty=-0.5)]
    logits = rng.standard_normal((5, v)).astype(np.float32)
    batch = batch_of(params, prompts=[[1, 2, 3]] * 5, outputs=[[4, 5]] * 5, eos={2})
    out = Sampler(0)(logits, batch)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.shape == (5,) and out.token_ids.dtype == np.int64
    assert out.logprobs.shape == (5,) and out.logprobs.dtype == np.float32
    assert out.top_token_ids.shape == (5, 2) and out.top_token_ids.dtype == np.int64
    assert out.top_logprobs.dtype == np.float32 and out.ranks.dtype == np.int64
    assert out.token_ids[3] != 2                      # min_tokens bans eos
    assert np.isfinite(out.logprobs).all()


def test_from_params_builds_per_row_arrays():
    params = [SamplingParams(temperature=0.5, top_k=-1, seed=-3, logprobs=4, min_tokens=2,
                             stop_token_ids=[9]),
              SamplingParams(repetition_penalty=1.2)]
    b = batch_of(params, prompts=[[1], [2, 3]], outputs=[[7], []], eos={0})
    assert b.temperature.dtype == np.float32 and b.top_k.dtype == np.int32
    assert b.top_k.tolist() == [0, 0] and b.num_logprobs.tolist() == [4, -1]
    assert b.seeds[0] >= 0 and b.seeds[1] == -1 and b.output_lens.tolist() == [1, 0]
    assert b.banned_token_ids[0].tolist() == [0, 9] and len(b.banned_token_ids[1]) == 0
    assert b.has_penalties and b.prompt_token_ids[1].tolist() == [2, 3]
    assert not batch_of([SamplingParams()]).has_penalties
    assert batch_of([SamplingParams()]).prompt_token_ids is None


def test_rows_with_huge_ties_next_to_normal_rows():
    """A row whose top-k boundary is tied across most of the vocab takes the full-row path;
    its neighbours in the same block keep the candidate path and stay exact."""
    rng = np.random.default_rng(60)
    v = 4096
    tied = np.zeros(v, np.float32)
    tied[:3] = 5.0                                   # 3 clear winners, then 4093 ties
    normal = rng.standard_normal(v).astype(np.float32)
    logits = np.stack([tied, normal] * 400)
    out = Sampler(0)(logits, batch_of([SamplingParams(top_k=5)] * 800)).token_ids
    assert set(out[1::2].tolist()) == set(np.argsort(-normal)[:5].tolist())
    # ties at the boundary are all kept (documented): some draws fall beyond the 3 winners
    assert set(out[0::2].tolist()) >= {0, 1, 2} and (out[0::2] >= 3).any()


def test_top_k_draws_follow_the_renormalized_distribution():
    rng = np.random.default_rng(61)
    logits = rng.standard_normal(8192).astype(np.float32)
    top = np.argsort(-logits)[:10]
    tokens = draw(logits, SamplingParams(top_k=10, temperature=0.7), 10_000, seed=7)
    rank = np.full(8192, -1)
    rank[top] = np.arange(10)
    assert (rank[tokens] >= 0).all()
    assert chi_square(rank[tokens], softmax(logits[top] / 0.7)) < CHI2_999[9]
