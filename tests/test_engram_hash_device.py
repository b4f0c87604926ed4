"""The device's Engram hash of a pending token (asynchronous scheduling) equals the host's, bit for
bit: the 64-bit word arithmetic against Python integers, and whole rows against `hash_ids`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model.config import DEEPSEEK_V41_FLASH, TINY_V41
from deepinfer.model.engram_hash import hasher_for
from deepinfer.model.engram_hash_device import _mod_64, _mul_32x32, hash_drafts, hash_pending

EDGES = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]


def test_word_products_and_remainders_equal_python_integers():
    rng = np.random.default_rng(0)
    a = np.array(EDGES + list(rng.integers(0, 1 << 32, 200)), np.uint64)
    b = np.array(EDGES[::-1] + list(rng.integers(0, 1 << 32, 200)), np.uint64)
    high, low = jax.jit(_mul_32x32)(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))
    got = [(int(h) << 32) | int(lo) for h, lo in zip(np.asarray(high), np.asarray(low))]
    assert got == [int(x) * int(y) for x, y in zip(a, b)]

    primes = np.array([2, 3, 129281, 2147483629, 2147483647] * 40, np.uint64)
    values = [int(x) for x in rng.integers(0, 1 << 63, primes.size, dtype=np.uint64)]
    values[:3] = [0, (1 << 64) - 1, (1 << 63) + 12345]
    hi = np.array([v >> 32 for v in values], np.uint32)
    lo = np.array([v & 0xFFFFFFFF for v in values], np.uint32)
    rest = jax.jit(_mod_64)(jnp.asarray(hi), jnp.asarray(lo), jnp.asarray(primes, jnp.uint32))
    assert [int(r) for r in np.asarray(rest)] == [v % int(p) for v, p in zip(values, primes)]


@pytest.mark.parametrize("config", [TINY_V41, DEEPSEEK_V41_FLASH], ids=["tiny-v4.1", "v4.1-flash"])
def test_pending_token_rows_equal_the_host_hash(config):
    """Rows of the last token of sequences of 1..6 tokens (so the look-back reaches the sequence
    start) from the whole vocabulary, including its first and last ids."""
    hasher = hasher_for(config)
    rng = np.random.default_rng(1)
    vocab = hasher.vocab_size
    sequences = [rng.integers(0, vocab, n) for n in (1, 2, 3, 4, 6) for _ in range(8)]
    sequences[0][-1], sequences[1][-1], sequences[2][:] = 0, vocab - 1, vocab - 1
    want = np.stack([hasher.hash_ids(s)[-1] for s in sequences])
    folds = np.stack([hasher.pending_folds(hasher.compress(s[:-1])) for s in sequences])
    last = np.array([s[-1] for s in sequences], np.int32)
    got = jax.jit(hash_pending, static_argnums=0)(config, jnp.asarray(last), jnp.asarray(folds))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("config", [TINY_V41, DEEPSEEK_V41_FLASH], ids=["tiny-v4.1", "v4.1-flash"])
def test_draft_rows_equal_the_host_hash(config):
    """Rows of 1..7 drafts after sequences of 1..6 known tokens (the look-back reaches the
    sequence start and, for later drafts, only other drafts), vocabulary edges included."""
    hasher = hasher_for(config)
    rng = np.random.default_rng(2)
    vocab = hasher.vocab_size
    for k in (1, 2, 7):
        known = [rng.integers(0, vocab, n) for n in (1, 2, 3, 6) for _ in range(4)]
        drafts = rng.integers(0, vocab, (len(known), k)).astype(np.int32)
        drafts[0, 0], drafts[1, -1] = 0, vocab - 1
        want = np.stack([hasher.hash_ids(np.concatenate([s, d]))[len(s):] for s, d in zip(known, drafts)])
        folds = np.stack([hasher.draft_folds(hasher.compress(s), k) for s in known])
        got = jax.jit(hash_drafts, static_argnums=0)(config, jnp.asarray(drafts), jnp.asarray(folds))
        np.testing.assert_array_equal(np.asarray(got), want)
