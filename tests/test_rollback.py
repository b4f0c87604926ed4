"""A verify step rolled back to its kept tokens leaves the cache as a step over those tokens only
(`model.rollback`): the window rings and their positions, the ratio-2 pending token, and what
the next step computes from them.

Two sequences in one batch, past the 128-token window (the rings wrap), each verifying an
anchor and 5 drafts whose rejected tail is junk; kept counts cover all-rejected, partial (even
and odd frontiers: the pending token matters only at an even one) and all-kept."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.forward import engram_hash_ids
from deepinfer.model.kv_cache import PACKED, CacheLayout, init_cache
from deepinfer.model.rollback import roll_back
from deepinfer.model.step import StepBatch, forward_step, verify_body

PAGE = 64
PROMPTS = (301, 262)  # the verify rows start at odd and even positions
DRAFTS = 5


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short")  # fake-quant on, packed rows: as served
    params = init_params(config, seed=3)
    pages = -(-(max(PROMPTS) + DRAFTS + 2) // PAGE)
    layout = CacheLayout(num_slots=3, page_size=PAGE, num_pages=3 * pages, max_pages_per_slot=pages, storage=PACKED)
    table = np.arange(2 * pages, dtype=np.int32).reshape(2, pages)[::-1].copy()  # slot 1 gets the low pages
    rng = np.random.default_rng(11)
    sequences = [rng.integers(3, 120_000, n + DRAFTS + 2).astype(np.int32) for n in PROMPTS]
    return config, params, layout, table, sequences


def _batch(config, table, rows: list[tuple[np.ndarray, int, int]], sequences) -> StepBatch:
    """Rows (tokens, start position, slot) of one step, padded to the longest."""
    T = max(len(t) for t, _, _ in rows)
    tok = np.zeros((len(rows), T), np.int32)
    pos = np.full((len(rows), T), -1, np.int32)
    hashes = np.zeros((len(rows), T, len(config.engram_layer_ids), config.n_hash_columns), np.int32)
    for b, (t, start, slot) in enumerate(rows):
        tok[b, :len(t)] = t
        pos[b, :len(t)] = np.arange(start, start + len(t))
        context = np.concatenate([sequences[slot][:start], t])
        hashes[b, :len(t)] = engram_hash_ids(config, context[None])[0][start:]
    slots = np.asarray([s for _, _, s in rows], np.int32)
    last = np.asarray([len(t) - 1 for t, _, _ in rows], np.int32)
    return StepBatch(*map(jnp.asarray, (tok, pos, slots, table[slots], hashes, last, np.zeros(len(rows), np.int32))))


def _prefilled(model):
    config, params, layout, table, sequences = model
    cache = init_cache(config, layout)
    for start in range(0, max(PROMPTS), 128):  # several chunks, as the engine prefills
        rows = [(seq[start:min(start + 128, n)], start, slot) for slot, (seq, n) in enumerate(zip(sequences, PROMPTS))
                if start < n]
        cache, _, _ = forward_step(params, config, layout, cache, _batch(config, table, rows, sequences))
    return cache


def _ring(cache, slot):
    return [np.asarray(w[:, slot]).view(np.uint8) for w in cache.window], np.asarray(cache.window_pos[slot])


@pytest.mark.parametrize("kept", [(1, 6), (2, 3), (4, 5), (6, 1)])
def test_verify_then_roll_back_equals_a_step_over_the_kept_tokens(model, kept):
    config, params, layout, table, sequences = model
    rng = np.random.default_rng(sum(kept))

    # reference: a plain step over each row's kept tokens, then the next token's step
    ref = forward_step(params, config, layout, _prefilled(model),
                       _batch(config, table, [(seq[n:n + k], n, s) for s, (seq, n, k) in
                                              enumerate(zip(sequences, PROMPTS, kept))], sequences))[0]
    # verify: the kept tokens followed by junk drafts, all in one step, then rolled back
    rows = []
    for s, (seq, n, k) in enumerate(zip(sequences, PROMPTS, kept)):
        junk = rng.integers(3, 120_000, DRAFTS + 1 - k).astype(np.int32)
        rows.append((np.concatenate([seq[n:n + k], junk]), n, s))
    batch = _batch(config, table, rows, sequences)
    verify = jax.jit(partial(verify_body, config=config, layout=layout))
    cache, logits, _, undo = verify(params, _prefilled(model), batch)
    assert logits.shape == (2, DRAFTS + 1, config.vocab_size)
    unrolled = cache
    cache = roll_back(cache, undo, batch.slots, batch.positions, jnp.asarray(kept, jnp.int32))

    for s, (n, k) in enumerate(zip(PROMPTS, kept)):
        (got, got_pos), (want, want_pos) = _ring(cache, s), _ring(ref, s)
        np.testing.assert_array_equal(got_pos, want_pos)
        rejected = [(n + j) % config.sliding_window for j in range(k, DRAFTS + 1)]
        kept_slots = [(n + j) % config.sliding_window for j in range(k)]
        for g, w in zip(got, want):  # restored rows: bit for bit as before the step
            np.testing.assert_array_equal(g[:, rejected], w[:, rejected])
            untouched = np.setdiff1d(np.arange(config.sliding_window), rejected + kept_slots)
            np.testing.assert_array_equal(g[:, untouched], w[:, untouched])
        frontier = n + k - 1
        for got_p, want_p in zip(cache.pending, ref.pending):
            if frontier % 2 == 0:  # the kept token that opens a pair waits: computed in a longer chunk
                np.testing.assert_allclose(np.asarray(got_p[s]), np.asarray(want_p[s]), rtol=2e-5, atol=2e-5)

    # the next step reads the rolled-back cache as the reference's: same logits
    nxt = _batch(config, table, [(seq[n + k:n + k + 1], n + k, s) for s, (seq, n, k) in
                                 enumerate(zip(sequences, PROMPTS, kept))], sequences)
    _, want_logits, _ = forward_step(params, config, layout, ref, nxt)
    _, got_logits, _ = forward_step(params, config, layout, jax.tree.map(jnp.copy, cache), nxt)
    want_logits = np.asarray(want_logits)
    scale = np.abs(want_logits).max()
    # (~1e-6 measured: the kept rows and the pending token come from a longer chunk; the bound
    # leaves room for an FP8 rounding flip of a window row)
    np.testing.assert_allclose(np.asarray(got_logits), want_logits, atol=1e-2 * scale)

    # without the roll back, a row that rejected drafts reads their junk: the check can fail
    if min(kept) < DRAFTS + 1:
        _, stale, _ = forward_step(params, config, layout, unrolled, nxt)
        row = int(np.argmin(kept))
        assert np.abs(np.asarray(stale)[row] - want_logits[row]).max() > 0.1 * scale  # (0.5-0.75 measured)
