"""Tests for the jitted batch sampler (deepinfer.serve.engine.sampler)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from deepinfer.serve.engine.sampler import (
    apply_penalties_and_bias,
    build_sampling_tensors,
    sample,
)


def P(**kw):
    """A request's sampling parameters; absent fields take vLLM defaults."""
    return types.SimpleNamespace(**kw)


def log_softmax_np(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def softmax_np(x):
    return np.exp(log_softmax_np(x))


def sample_rows(logits_row, params, n, *, position=0, seed0=0, key=0):
    """`n` draws of one distribution: n seeded rows (seeds seed0..) in a single batch."""
    logits_row = np.asarray(logits_row, np.float32)
    plist = [P(seed=seed0 + i, **params) for i in range(n)]
    t = build_sampling_tensors(plist, [position] * n, vocab_size=logits_row.size)
    logits = np.broadcast_to(logits_row, (n, logits_row.size))
    return np.asarray(sample(logits, t, jax.random.key(key)).tokens)


# ------------------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax():
    logits = np.asarray(jax.random.normal(jax.random.key(0), (6, 97)), np.float32)
    # All-greedy batch (the compiled path skips the noise), with padding rows.
    t = build_sampling_tensors([P(temperature=0.0)] * 4 + [P(temperature=1e-7)] * 2,
                               list(range(6)), vocab_size=97, batch_size=8)
    assert t.all_greedy
    out = sample(np.concatenate([logits, logits[:2]]), t, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(out.tokens)[:6], logits.argmax(-1))
    # Greedy rows mixed with random rows that carry truncation settings.
    plist = [P(temperature=0.0, top_k=3, top_p=0.5, seed=5),
             P(temperature=1.3, top_k=4, min_p=0.1)] * 3
    t = build_sampling_tensors(plist, list(range(6)), vocab_size=97)
    assert not t.all_greedy
    out = sample(logits, t, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(out.tokens)[0::2], logits[0::2].argmax(-1))


# -------------------------------------------------------------------------------- temperature


def chi2_stat(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [True, False])
def test_temperature_matches_softmax_distribution(seeded):
    V, N, T = 8, 4000, 0.5
    logits = np.array([1.0, 0.2, -0.5, 0.8, -1.2, 0.0, 0.5, -0.3], np.float32)
    if seeded:
        tokens = sample_rows(logits, {"temperature": T}, N, position=11)
    else:
        t = build_sampling_tensors([P(temperature=T)] * N, [11] * N, vocab_size=V)
        tokens = np.asarray(sample(np.broadcast_to(logits, (N, V)), t, jax.random.key(7)).tokens)
    counts = np.bincount(tokens, minlength=V).astype(np.float64)
    critical = stats.chi2.ppf(1 - 1e-3, df=V - 1)
    assert chi2_stat(counts, softmax_np(logits / T)) < critical
    # The test has the power to reject the usual mistakes: 1/T instead of T, and T ignored.
    assert chi2_stat(counts, softmax_np(logits * T)) > 10 * critical
    assert chi2_stat(counts, softmax_np(logits)) > 10 * critical


# ------------------------------------------------------------------------------- truncation


def test_top_k_never_outside_top_k():
    V, B, k = 100, 256, 5
    logits = np.asarray(jax.random.normal(jax.random.key(3), (B, V)), np.float32)
    t = build_sampling_tensors([P(temperature=3.0, top_k=k, seed=i) for i in range(B)],
                               [9] * B, vocab_size=V)
    tokens = np.asarray(sample(logits, t, jax.random.key(0)).tokens)
    top = np.argsort(-logits, axis=1)[:, :k]
    assert all(tok in row for tok, row in zip(tokens, top))
    ranks = np.array([list(row).index(tok) for tok, row in zip(tokens, top)])
    assert len(set(ranks.tolist())) == k  # every one of the k survivors gets drawn


NUCLEUS_PROBS = np.array([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"top_p": 0.79}, {0, 1}),
        ({"top_p": 0.81}, {0, 1, 2}),
        ({"top_p": 0.45}, {0}),
        ({"top_p": 0.99}, {0, 1, 2, 3}),
        ({"top_p": 1e-6}, {0}),  # at least one token survives
        # top-p applies to the probabilities renormalised after top-k: {0.625, 0.375}
        ({"top_k": 2, "top_p": 0.6}, {0}),
        ({"top_k": 2, "top_p": 0.7}, {0, 1}),
        # min-p: keep p >= min_p * p_max
        ({"min_p": 0.2}, {0, 1, 2}),
        ({"min_p": 0.5}, {0, 1}),
        ({"min_p": 0.9}, {0}),
        # min-p sees temperature-scaled probabilities: at T = 0.5 they are ~[.685, .247, .062, .007]
        ({"min_p": 0.2, "temperature": 0.5}, {0, 1}),
    ],
)
def test_truncation_keeps_exactly_the_expected_set(params, expected):
    tokens = sample_rows(np.log(NUCLEUS_PROBS), params, 2000, position=3)
    assert set(tokens.tolist()) == expected


# -------------------------------------------------------------------------------- penalties


def test_penalties_match_hand_computation():
    V = 10
    raw = np.array([1.5, -2.0, 3.0, 0.5, -0.4, 2.2, 0.0, -1.0, 0.7, 1.1], np.float32)
    logits = np.stack([raw, raw, raw])
    prompt = [[1, 2, 7, 7], [1, 2], [1, 2, 3]]
    output = [[2, 3, 3, 4, 9], [3, 5, 5], [3, 4]]
    plist = [
        P(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
        P(temperature=0.0, presence_penalty=-0.3, frequency_penalty=0.4),
        P(temperature=0.0),
    ]
    t = build_sampling_tensors(plist, [4, 3, 5], prompt, output, vocab_size=V)
    got = np.asarray(apply_penalties_and_bias(logits, t))

    expected = logits.astype(np.float64).copy()
    for b, p in enumerate(plist):
        rep = getattr(p, "repetition_penalty", 1.0)
        pres = getattr(p, "presence_penalty", 0.0)
        freq = getattr(p, "frequency_penalty", 0.0)
        for tok in set(prompt[b]) | set(output[b]):  # repetition: prompt and output
            x = expected[b, tok]
            expected[b, tok] = x / rep if x > 0 else x * rep
        for tok in set(output[b]):  # presence / frequency: output only
            expected[b, tok] -= freq * output[b].count(tok) + pres
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # Spot checks written out by hand.
    assert got[0, 2] == pytest.approx(3.0 / 2 - 0.25 - 0.5)  # prompt+output, positive
    assert got[0, 1] == pytest.approx(-2.0 * 2)  # prompt only, negative: multiplied
    assert got[0, 7] == pytest.approx(-1.0 * 2)
    assert got[0, 3] == pytest.approx(0.5 / 2 - 0.5 - 0.5)
    assert got[1, 1] == pytest.approx(-2.0) and got[1, 2] == pytest.approx(3.0)  # prompt untouched
    assert got[1, 5] == pytest.approx(2.2 - 0.8 + 0.3)
    np.testing.assert_array_equal(got[2], raw)  # no penalties: unchanged

    # Greedy decoding picks the argmax of the penalised logits.
    tokens = np.asarray(sample(logits, t, jax.random.key(0)).tokens)
    np.testing.assert_array_equal(tokens, expected.argmax(-1))
    assert tokens[0] != raw.argmax()


def test_penalty_history_is_sparse_and_deduplicated():
    t = build_sampling_tensors(
        [P(repetition_penalty=1.3), P(frequency_penalty=0.1), P()], [0, 0, 0],
        [[4, 4, 9, -1], [1, 1, 1], [2]], [[9, 9, 5], [7, 7], [3]], vocab_size=12, batch_size=4)
    assert t.seen_ids.shape == (4, 8)
    np.testing.assert_array_equal(t.seen_ids[0, :3], [4, 5, 9])
    np.testing.assert_array_equal(t.seen_output_counts[0, :3], [0, 1, 2])
    np.testing.assert_array_equal(t.seen_ids[1, :1], [7])  # no repetition penalty: prompt unused
    np.testing.assert_array_equal(t.seen_output_counts[1, :1], [2])
    assert (t.seen_ids[1, 1:] == -1).all() and (t.seen_ids[2:] == -1).all()
    none = build_sampling_tensors([P(), P()], [0, 0], [[1]] * 2, [[2]] * 2, vocab_size=12)
    assert not none.do_penalties and none.seen_ids.shape == (2, 0)


# ------------------------------------------------------------------------------- logit bias


def test_logit_bias_forces_token():
    V = 64
    logits = np.asarray(jax.random.normal(jax.random.key(4), (4, V)), np.float32)
    low = int(logits[0].argmin())
    plist = [
        P(temperature=0.0, logit_bias={low: 100.0}),
        P(temperature=1.0, seed=3, logit_bias={low: 100.0, 5: -3.0}),
        P(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
        P(temperature=0.0),
    ]
    t = build_sampling_tensors(plist, [1, 2, 3, 4], vocab_size=V)
    out = sample(logits, t, jax.random.key(0))
    assert out.top_ids is None and out.top_logprobs is None  # num_logprobs = 0
    tokens = np.asarray(out.tokens)
    assert tokens[0] == low and tokens[1] == low
    assert tokens[2] == np.argsort(-logits[2])[1]
    assert tokens[3] == logits[3].argmax()
    # Reported log-probabilities stay those of the raw model distribution.
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], log_softmax_np(logits[0])[low],
                               rtol=1e-5)
    assert np.asarray(out.ranks)[0] == V
    with pytest.raises(ValueError):
        build_sampling_tensors([P(logit_bias={V: 1.0})], [0], vocab_size=V)


# --------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    V, n = 200, 5
    logits = np.asarray(3 * jax.random.normal(jax.random.key(5), (4, V)), np.float32)
    plist = [
        P(temperature=0.0),
        P(temperature=0.8, top_k=20, seed=1, presence_penalty=1.0, repetition_penalty=1.5),
        P(temperature=1.5, top_p=0.9, min_p=0.05, logit_bias={7: 4.0}),
        P(temperature=1.0, frequency_penalty=2.0),
    ]
    t = build_sampling_tensors(plist, [10, 11, 12, 13], [[1, 2], [3], [], [7]],
                               [[4], [5, 6], [7], [8, 8]], vocab_size=V)
    out = sample(logits, t, jax.random.key(9), num_logprobs=n)
    ref = log_softmax_np(logits)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(4), tokens], atol=1e-5)
    sampled_ref = ref[np.arange(4), tokens]
    np.testing.assert_array_equal(np.asarray(out.ranks), 1 + (ref > sampled_ref[:, None]).sum(-1))
    order = np.argsort(-ref, axis=1)[:, :n]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, order, 1),
                               atol=1e-5)
    assert out.top_ids.shape == (4, n) and out.top_ids.dtype == jnp.int32

    full = sample(logits, t, jax.random.key(9), num_logprobs=-1)
    np.testing.assert_allclose(np.asarray(full.top_logprobs), np.sort(ref, axis=1)[:, ::-1],
                               atol=1e-5)


# ------------------------------------------------------------------------------ determinism


TARGET_V = 1000
TARGET_PARAMS = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}


def target_logits(position):
    noise = jax.random.normal(jax.random.key(100 + position), (TARGET_V,))
    return np.asarray(2 * noise, np.float32)


def seeded_sequence(seed, rng=None, batch=1, row_of=lambda pos: 0, params=None):
    """The target request's tokens over 20 positions, placed in a batch of other requests."""
    rng = rng or np.random.default_rng(0)
    params = dict(TARGET_PARAMS, seed=seed, **(params or {}))
    tokens = []
    for pos in range(20):
        row = row_of(pos)
        # Other requests with random settings; the first one always carries a penalty and min-p,
        # so each batch size compiles once (a different program from the batch of one).
        others = [
            P(temperature=float(rng.uniform(0.3, 2.0)), top_k=int(rng.integers(0, 50)),
              min_p=0.02 if i == 0 else float(rng.choice([0.0, 0.02])),
              presence_penalty=0.5 if i == 0 else float(rng.choice([0.0, 0.5])),
              seed=int(rng.integers(1 << 31)) if rng.random() < 0.5 else None)
            for i in range(batch - 1)
        ]
        plist = others[:row] + [P(**params)] + others[row:]
        positions = [int(x) for x in rng.integers(0, 5000, batch)]
        positions[row] = pos
        histories = [[int(x) for x in rng.integers(0, TARGET_V, 6)] for _ in range(batch)]
        t = build_sampling_tensors(plist, positions, histories, histories, vocab_size=TARGET_V,
                                   batch_size=batch + (batch > 1))
        logits = np.asarray(rng.normal(size=(t.batch_size, TARGET_V)) * 2, np.float32)
        logits[row] = target_logits(pos)
        out = sample(logits, t, jax.random.key(int(rng.integers(1 << 31))))
        tokens.append(int(np.asarray(out.tokens)[row]))
    return tokens


def test_seeded_request_is_batch_invariant():
    alone = seeded_sequence(1234)
    assert len(set(alone)) > 10  # really sampling, not a fixed token
    small = seeded_sequence(1234, np.random.default_rng(1), batch=5, row_of=lambda p: p % 5)
    large = seeded_sequence(1234, np.random.default_rng(2), batch=13,
                            row_of=lambda p: (7 * p + 3) % 13)
    assert small == alone
    assert large == alone


def test_seeded_noise_is_keyed_by_seed_and_position():
    """Token = argmax(logits / T + Gumbel(fold_in(key(seed), position))), whatever the row."""
    V, T = TARGET_V, 1.5
    logits = target_logits(0) / 2
    plist = [P(temperature=1.0)] * 3 + [P(temperature=T, seed=42)]
    tokens = []
    for pos in range(20):
        t = build_sampling_tensors(plist, [0, 0, 0, pos], vocab_size=V)
        tok = int(np.asarray(sample(np.tile(logits, (4, 1)), t, jax.random.key(pos)).tokens)[3])
        g = jax.random.gumbel(jax.random.fold_in(jax.random.key(42), pos), (V,), jnp.float32)
        assert tok == int(jnp.argmax(jnp.asarray(logits) / T + g))
        tokens.append(tok)
    assert len(set(tokens)) > 10  # same logits, new position: new noise


def test_different_seeds_differ():
    a, b = seeded_sequence(1234), seeded_sequence(1235)
    assert sum(x != y for x, y in zip(a, b)) >= 10


def test_unseeded_rows_follow_the_rng_key():
    B, V = 4, 1000  # same shape and flags as the test above: no new compilation
    logits = np.asarray(jax.random.normal(jax.random.key(6), (B, V)), np.float32)
    t = build_sampling_tensors([P(temperature=1.0)] * B, [3] * B, vocab_size=V)
    runs = [np.asarray(sample(logits, t, jax.random.key(k)).tokens) for k in range(4)]
    again = np.asarray(sample(logits, t, jax.random.PRNGKey(0)).tokens)  # raw uint32 key accepted
    np.testing.assert_array_equal(runs[0], again)
    assert all((runs[0] != r).sum() >= B // 2 for r in runs[1:])


# ------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "params",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1}, {"top_k": -2},
     {"repetition_penalty": 0.0}],
)
def test_invalid_parameters_rejected(params):
    with pytest.raises(ValueError):
        build_sampling_tensors([P(**params)], [0], vocab_size=10)


def test_padding_rows_and_defaults():
    t = build_sampling_tensors([None, P(top_k=-1, seed=(1 << 32) + 5)], [7, 8], vocab_size=10,
                               batch_size=4)
    np.testing.assert_array_equal(t.temperature, [1.0, 1.0, 0.0, 0.0])  # vLLM default T = 1
    np.testing.assert_array_equal(t.top_k, [0, 0, 0, 0])
    np.testing.assert_array_equal(t.has_seed, [False, True, False, False])
    assert t.seed[1] == 5 and t.position.tolist() == [7, 8, 0, 0]
    assert not t.do_top_k_top_p and not t.do_min_p and not t.do_penalties
    assert t.bias_ids.shape == (4, 0)
