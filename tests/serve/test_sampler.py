"""The on-device sampler (`serve.engine.sampler`) and its per-slot state (`sampling_state`):
each parameter against a plain numpy reference, the distribution it draws from, batch
independence of the counter-based noise, the state the step advances, and logprobs only when
asked."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from deepinfer.serve.engine import sampler as S
from deepinfer.serve.engine.sampling_state import (
    check_capacity,
    clear_slots,
    init_state,
    slot_row,
    write_slot,
)

MAX_BIAS, MAX_BANS, EOS = 4, 3, 1
_sample = jax.jit(S.sample, static_argnames="num_logprobs")
_process = jax.jit(S.process_logits)


def P(**kw):
    """A request's sampling parameters; absent fields take vLLM defaults."""
    return types.SimpleNamespace(**kw)


def make_state(params, V, seeds=None, prompts=None, outputs=None, slots=None):
    """A state of len(params) slots (or max(slots) + 1), request i in slot slots[i]."""
    n = len(params)
    slots = list(range(n)) if slots is None else slots
    state = init_state(max(slots) + 1, V, MAX_BIAS, MAX_BANS)
    for i, p in enumerate(params):
        row = slot_row(p, seed=(seeds[i] if seeds is not None else i), vocab_size=V, max_logit_bias=MAX_BIAS,
                       max_bans=MAX_BANS, eos_token_id=EOS, prompt_token_ids=prompts[i] if prompts else (),
                       output_token_ids=outputs[i] if outputs else ())
        state = write_slot(state, np.int32(slots[i]), row)
    return state


def draw(logits, state, positions, slots=None, emit=None, num_logprobs=None):
    B = logits.shape[0]
    slots = np.arange(B, dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
    emit = np.ones(B, bool) if emit is None else np.asarray(emit)
    rows = S.SampleRows(emit, np.asarray(positions, np.int32))
    return _sample(jnp.asarray(logits, jnp.float32), state, slots, rows, num_logprobs=num_logprobs)


# ------------------------------------------------------------------------- numpy reference


def _mix(x):
    x = np.atleast_1d(np.asarray(x, np.uint32))  # arrays wrap around silently, scalars warn
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def ref_gumbel(key, ids):
    bits = _mix(np.uint32(key) ^ _mix(np.asarray(ids, np.uint32) + np.uint32(0x9E3779B9)))
    u = (bits >> np.uint32(9)).astype(np.float64) * 2.0 ** -23 + 2.0 ** -24
    return -np.log(-np.log(u))


def ref_key(seed, position):
    return _mix(_mix(seed) ^ (np.atleast_1d(np.uint32(position)) * np.uint32(0x9E3779B9)))[0]


def ref_process(x, p, prompt, output):
    """Steps 1-2 in float32, one row."""
    x = np.asarray(x, np.float32).copy()
    for tid, value in (getattr(p, "logit_bias", None) or {}).items():
        x[tid] += np.float32(value)
    if len(output) < getattr(p, "min_tokens", 0):
        banned = set(getattr(p, "stop_token_ids", None) or [])
        if not getattr(p, "ignore_eos", False):
            banned.add(EOS)
        for tid in banned:
            x[tid] += np.float32(S.BAN)
    rep = np.float32(getattr(p, "repetition_penalty", 1.0))
    pres = np.float32(getattr(p, "presence_penalty", 0.0))
    freq = np.float32(getattr(p, "frequency_penalty", 0.0))
    if rep != 1 or pres != 0 or freq != 0:
        for tid in set(prompt) | set(output):  # repetition: prompt and output
            x[tid] = x[tid] / rep if x[tid] > 0 else x[tid] * rep
        for tid in set(output):  # presence / frequency: output only
            x[tid] -= freq * np.float32(output.count(tid)) + pres
    return x


def ref_keep(scaled, p):
    """Step 4's masks (min-p, then top-k with ties to the lower id, then top-p), one row."""
    keep = np.ones(scaled.shape, bool)
    min_p = getattr(p, "min_p", 0.0)
    if min_p > 0:
        probs = np.exp(scaled - scaled.max())
        keep &= probs >= min_p * probs.max() * (1 - 1e-6)
    order = np.argsort(-np.where(keep, scaled, -np.inf), kind="stable")
    k = getattr(p, "top_k", 0) or len(scaled)
    top = order[:k]
    probs = np.exp(scaled[top] - scaled[top].max())
    probs /= probs.sum()
    top_p = getattr(p, "top_p", 1.0)
    before = np.cumsum(probs) - probs
    kept = top[(before < top_p) | (np.arange(len(top)) == 0)] if top_p < 1 else top
    mask = np.zeros(scaled.shape, bool)
    mask[kept] = True
    return keep & mask


def ref_token(x, p, seed, position, prompt=(), output=()):
    """The reference sampler for one row: processing, masks and the two-level Gumbel-max draw."""
    return ref_token_margin(x, p, seed, position, prompt, output)[0]


def _gap(values):
    """The best minus the second best of `values` (inf when fewer than two are finite)."""
    finite = np.sort(values[np.isfinite(values)])
    return float(finite[-1] - finite[-2]) if len(finite) > 1 else np.inf


def ref_token_margin(x, p, seed, position, prompt=(), output=()):
    """`(token, margin)`: `ref_token`'s token, and by how much its choices were made: the
    smallest gap between the best and the second best of the processed logits (greedy) or of the
    perturbed block and token scores of the draw, and between the top-k-th and the next scaled
    logit where top-k cuts. Logits off by less than about half the margin choose the same token."""
    processed = ref_process(x, p, list(prompt), list(output))
    t = getattr(p, "temperature", 1.0)
    if t < 1e-5:
        return int(np.argmax(processed)), _gap(processed)
    scaled = processed.astype(np.float64) / np.float32(t)
    margin = np.inf
    k = getattr(p, "top_k", 0) or 0
    if 0 < k < len(scaled):
        ordered = np.sort(scaled)[::-1]
        margin = ordered[k - 1] - ordered[k]
    scaled = np.where(ref_keep(scaled, p), scaled, -np.inf)
    V = len(scaled)
    nb = -(-V // S.BLOCK)
    blocks = np.full(nb * S.BLOCK, -np.inf)
    blocks[:V] = scaled
    blocks = blocks.reshape(nb, S.BLOCK)
    with np.errstate(divide="ignore"):
        top = blocks.max(-1)
        safe = np.where(np.isfinite(top), top, 0.0)
        lse = np.log(np.exp(blocks - safe[:, None]).sum(-1)) + safe
    key = ref_key(seed, position)
    block_scores = lse + ref_gumbel(_mix(key ^ np.uint32(0x5BD1E995)), np.arange(nb))
    b = int(np.argmax(block_scores))
    ids = b * S.BLOCK + np.arange(S.BLOCK)
    token_scores = blocks[b] + ref_gumbel(key, ids)
    margin = min(margin, _gap(block_scores), _gap(token_scores))
    return int(b * S.BLOCK + np.argmax(token_scores)), float(margin)


# ------------------------------------------------------------------- parameters vs reference


V_REF, B_REF = 700, 16  # three blocks, the last one partial

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature_low": dict(temperature=0.5),
    "temperature_high": dict(temperature=1.7),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_p": dict(temperature=0.9, top_p=0.6),
    "top_k_top_p": dict(temperature=1.2, top_k=30, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.3),
    "repetition": dict(temperature=0.0, repetition_penalty=1.8),
    "repetition_sampled": dict(temperature=1.0, repetition_penalty=0.7),
    "presence": dict(temperature=1.0, presence_penalty=1.5),
    "frequency": dict(temperature=0.0, frequency_penalty=-1.2),
    "logit_bias": dict(temperature=1.0, logit_bias={3: 6.0, 650: 8.0, 11: -5.0}),
    "min_tokens": dict(temperature=0.0, min_tokens=5, stop_token_ids=[4, 9]),
    "min_tokens_ignore_eos": dict(temperature=1.0, min_tokens=5, stop_token_ids=[4], ignore_eos=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_parameter_matches_the_numpy_reference(case):
    rng = np.random.default_rng(sorted(CASES).index(case))
    logits = rng.normal(size=(B_REF, V_REF)).astype(np.float32) * 2
    logits[:, [EOS, 4, 9]] += 4  # the banned tokens would win without the ban
    prompts = [rng.integers(0, V_REF, 12).tolist() for _ in range(B_REF)]
    outputs = [rng.integers(0, 40, int(rng.integers(0, 9))).tolist() for _ in range(B_REF)]  # repeats
    params = [P(**CASES[case]) for _ in range(B_REF)]
    seeds = rng.integers(0, 1 << 32, B_REF, dtype=np.uint64).tolist()
    positions = rng.integers(0, 5000, B_REF)
    slots = rng.permutation(B_REF + 3)[:B_REF]  # rows read their own slot, wherever it is
    state = make_state(params, V_REF, seeds, prompts, outputs, slots=slots.tolist())

    got = np.asarray(_process(jnp.asarray(logits), state, jnp.asarray(slots, jnp.int32), jnp.ones(B_REF, bool)))
    expected = np.stack([ref_process(logits[b], params[b], prompts[b], outputs[b]) for b in range(B_REF)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
    if case in ("repetition", "presence", "frequency", "logit_bias", "min_tokens"):
        assert not np.allclose(got, logits)  # the parameter did something

    # tokens gained after the state was written (a verify position's earlier drafts) count as
    # outputs: the same as a state that had them (-1: no token; the min_tokens boundary is crossed)
    earlier = np.where(rng.random((B_REF, 3)) < 0.7, rng.integers(0, 40, (B_REF, 3)), -1).astype(np.int32)
    got = np.asarray(_process(jnp.asarray(logits), state, jnp.asarray(slots, jnp.int32), jnp.ones(B_REF, bool),
                              jnp.asarray(earlier)))
    expected = np.stack([ref_process(logits[b], params[b], prompts[b], outputs[b] + [t for t in earlier[b] if t >= 0])
                         for b in range(B_REF)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)

    _, out = draw(logits, state, positions, slots=slots)
    ref = [ref_token(logits[b], params[b], seeds[b], positions[b], prompts[b], outputs[b]) for b in range(B_REF)]
    assert np.asarray(out.tokens).tolist() == ref
    if case.startswith("min_tokens"):  # outputs shorter than 5 never end early
        for b in range(B_REF):
            banned = {4, 9} if case == "min_tokens" else {4}
            if len(outputs[b]) < 5:
                assert ref[b] not in banned


def test_blocked_argmax_is_the_first_maximum():
    x = np.random.default_rng(0).normal(size=(6, 700)).astype(np.float32)
    x[1, [5, 300, 690]] = 9.0  # ties across blocks: the lowest id
    x[2, 699] = 9.0  # in the partial last block
    x[3] = -np.inf
    x[3, 256] = 0.0
    np.testing.assert_array_equal(np.asarray(jax.jit(S.blocked_argmax)(x)), [*x[:3].argmax(-1), 256,
                                                                             *x[4:].argmax(-1)])


# ------------------------------------------------------------------------------ distributions


def chi2_stat(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_softmax_across_blocks():
    """Eight likely tokens spread over three blocks (the rest far less likely): 4000 draws from
    1000 seeds x 4 positions match softmax(logits / T), and not the usual mistakes."""
    V, T, N = 700, 0.5, 1000
    ids = np.array([2, 100, 255, 256, 400, 511, 600, 699])
    logits = np.full(V, -40.0, np.float32)
    logits[ids] = [1.0, 0.2, -0.5, 0.8, -1.2, 0.0, 0.5, -0.3]
    state = make_state([P(temperature=T)] * N, V, seeds=list(range(N)))
    tokens = np.concatenate([np.asarray(draw(np.tile(logits, (N, 1)), state, np.full(N, pos))[1].tokens)
                             for pos in (3, 4, 5, 1000)])
    assert set(tokens.tolist()) <= set(ids.tolist())
    counts = np.array([(tokens == i).sum() for i in ids], np.float64)
    critical = stats.chi2.ppf(1 - 1e-3, df=len(ids) - 1)
    probs = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # noqa: E731
    assert chi2_stat(counts, probs(logits[ids] / T)) < critical
    assert chi2_stat(counts, probs(logits[ids] * T)) > 10 * critical  # 1/T instead of T
    assert chi2_stat(counts, probs(logits[ids])) > 10 * critical  # T ignored


NUCLEUS_PROBS = np.array([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"top_p": 0.79}, {0, 1}),
        ({"top_p": 0.81}, {0, 1, 2}),
        ({"top_p": 0.45}, {0}),
        ({"top_p": 1e-6}, {0}),  # at least one token survives
        # top-p applies to the probabilities renormalised after top-k: {0.625, 0.375}
        ({"top_k": 2, "top_p": 0.6}, {0}),
        ({"top_k": 2, "top_p": 0.7}, {0, 1}),
        ({"min_p": 0.2}, {0, 1, 2}),  # keep p >= min_p * p_max
        ({"min_p": 0.9}, {0}),
        # min-p sees temperature-scaled probabilities: at T = 0.5 they are ~[.685, .247, .062, .007]
        ({"min_p": 0.2, "temperature": 0.5}, {0, 1}),
    ],
)
def test_truncation_keeps_exactly_the_expected_set(params, expected):
    N = 1000
    state = make_state([P(**params)] * N, 4, seeds=list(range(N)))
    _, out = draw(np.tile(np.log(NUCLEUS_PROBS), (N, 1)), state, np.full(N, 3))
    assert set(np.asarray(out.tokens).tolist()) == expected


# ------------------------------------------------------------------------------- determinism


V_DET = 1000


def target_logits(position):
    return np.asarray(2 * np.random.default_rng(100 + position).normal(size=V_DET), np.float32)


def seeded_sequence(seed, rng=None, batch=1, row_of=lambda pos: 0):
    """A top-p request's tokens over 20 positions, placed in a batch of other requests."""
    rng = rng or np.random.default_rng(0)
    tokens = []
    for pos in range(20):
        row = row_of(pos)
        others = [P(temperature=float(rng.uniform(0.3, 2.0)), top_k=int(rng.integers(0, 50)),
                    min_p=float(rng.choice([0.0, 0.02])), presence_penalty=float(rng.choice([0.0, 0.5])))
                  for _ in range(batch - 1)]
        params = others[:row] + [P(temperature=1.0, top_p=0.95)] + others[row:]
        seeds = [int(s) for s in rng.integers(0, 1 << 31, batch)]
        seeds[row] = seed
        positions = rng.integers(0, 5000, batch)
        positions[row] = pos
        histories = [rng.integers(0, V_DET, 6).tolist() for _ in range(batch)]
        state = make_state(params, V_DET, seeds, histories, histories)
        logits = rng.normal(size=(batch, V_DET)).astype(np.float32) * 2
        logits[row] = target_logits(pos)
        tokens.append(int(np.asarray(draw(logits, state, positions)[1].tokens)[row]))
    return tokens


def test_a_seeded_request_is_batch_invariant():
    alone = seeded_sequence(1234)
    assert len(set(alone)) > 10  # really sampling, not a fixed token
    assert seeded_sequence(1234, np.random.default_rng(1), batch=5, row_of=lambda p: p % 5) == alone
    assert seeded_sequence(1234, np.random.default_rng(2), batch=13, row_of=lambda p: (7 * p + 3) % 13) == alone
    other = seeded_sequence(1235)
    assert sum(x != y for x, y in zip(alone, other)) >= 10  # another seed, other tokens


# ------------------------------------------------------------------------ the state it keeps


def test_the_step_counts_kept_tokens_only():
    V = 300
    logits = np.full((3, V), -5.0, np.float32)
    logits[:, 7] = 5.0
    params = [P(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.0)] * 3
    state = make_state(params, V, outputs=[[7, 8], [], []])
    for _ in range(2):  # row 2 is padding: its slot is never advanced
        state, out = draw(logits, state, [5, 6, 7], emit=[True, True, False])
    counts = np.asarray(state.output_counts)
    assert counts[0, 7] == 3 and counts[0, 8] == 1 and counts[1, 7] == 2 and counts[2].sum() == 0
    np.testing.assert_array_equal(np.asarray(state.num_output), [4, 2, 0])
    # the frequency penalty reads the counts: 5 - 2 * count falls below -5 after 5 tokens
    tokens = []
    for _ in range(4):
        state, out = draw(logits, state, [5, 6, 7], emit=[True, True, False])
        tokens.append(int(np.asarray(out.tokens)[1]))
    assert tokens == [7, 7, 7, 0]


def test_write_and_clear_slots():
    V = 50
    state = make_state([P(temperature=0.7, top_k=3, logit_bias={2: 1.0}, repetition_penalty=1.2, min_tokens=2)],
                       V, prompts=[[1, 5]], outputs=[[5, 5, 9]], seeds=[(1 << 32) + 7])
    assert float(state.temperature[0]) == pytest.approx(0.7) and int(state.seed[0]) == 7
    assert int(state.num_output[0]) == 3 and int(state.output_counts[0, 5]) == 2
    assert bool(state.prompt_seen[0, 1]) and not bool(state.prompt_seen[0, 9])
    assert np.asarray(state.bias_ids[0]).tolist() == [2, -1, -1, -1]
    assert np.asarray(state.ban_ids[0]).tolist() == [EOS, -1, -1]
    cleared = clear_slots(state, np.array([0, 1], np.int32))  # 1: padding past the end
    fresh = init_state(1, V, MAX_BIAS, MAX_BANS)
    for a, b in zip(jax.tree.leaves(cleared), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("params, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {60: 1.0}}, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": {i: 1.0 for i in range(MAX_BIAS + 1)}}, "logit_bias"),  # more than the list holds
    ({"min_tokens": 1, "stop_token_ids": [2, 3, 4]}, "stop_token_ids"),  # 3 stop ids + EOS > 3
])
def test_bad_rows_name_the_field(params, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        slot_row(P(**params), seed=0, vocab_size=50, max_logit_bias=MAX_BIAS, max_bans=MAX_BANS, eos_token_id=EOS)
    check_capacity(P(min_tokens=0, stop_token_ids=[2, 3, 4]), eos_token_id=EOS, max_logit_bias=MAX_BIAS,
                   max_bans=MAX_BANS)  # without min_tokens nothing is held back


# --------------------------------------------------------------------------------- logprobs


def test_logprobs_only_when_asked_and_raw():
    V, n = 300, 5
    logits = np.asarray(3 * np.random.default_rng(5).normal(size=(4, V)), np.float32)
    params = [P(temperature=0.0), P(temperature=0.8, top_k=20, presence_penalty=1.0, repetition_penalty=1.5),
              P(temperature=1.5, top_p=0.9, min_p=0.05, logit_bias={7: 4.0}), P(temperature=1.0)]
    state = make_state(params, V, prompts=[[1, 2], [3], [], [7]], outputs=[[4], [5, 6], [7], [8, 8]])
    rows = S.SampleRows(np.ones(4, bool), np.arange(10, 14, dtype=np.int32))
    slots = np.arange(4, dtype=np.int32)
    shape = jax.eval_shape(lambda *a: S.sample(*a, num_logprobs=None), logits, state, slots, rows)[1]
    assert [leaf.shape for leaf in jax.tree.leaves(shape)] == [(4,)]  # the tokens alone
    shape = jax.eval_shape(lambda *a: S.sample(*a, num_logprobs=n), logits, state, slots, rows)[1]
    assert shape.top_ids.shape == (4, n) and shape.top_ids.dtype == jnp.int32

    _, out = draw(logits, state, rows.position, num_logprobs=n)
    _, plain = draw(logits, state, rows.position)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens, np.asarray(plain.tokens))  # asking changes no token
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(4), tokens], atol=1e-5)
    sampled = ref[np.arange(4), tokens]
    np.testing.assert_array_equal(np.asarray(out.ranks), 1 + (ref > sampled[:, None]).sum(-1))
    order = np.argsort(-ref, axis=1)[:, :n]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, order, 1), atol=1e-5)
