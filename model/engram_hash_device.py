"""The Engram hash of one token on the device, for a token only the device knows yet.

Under asynchronous scheduling a decode row's input token is the one its previous step sampled,
still on the device when the host builds the next step (`serve/engine/placeholders.py`). Its
Engram rows (`engram_hash.py`: products of compressed ids with odd 64-bit multipliers, XOR-folded
over the look-back, reduced modulo primes) need 64-bit integers, which JAX's default 32-bit mode
does not have; this computes them exactly in pairs of uint32 words. The host supplies the
look-back's part of each fold (`EngramHasher.pending_folds`); here the token's compressed id
times the first multiplier is XOR-ed in and the 64-bit value reduced modulo each prime (primes
are below 2**31, so the bit-serial remainder stays within 32 bits).

Speculative decoding has several such tokens in a row: the drafts the device proposes after a
row's last known token (`hash_drafts`). Each draft's n-grams reach the drafts before it (their
products are computed here) and the host's tokens (their fold is `EngramHasher.draft_folds`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.config import ModelConfig

__all__ = ["hash_drafts", "hash_pending"]

_LOW16 = 0xFFFF


def _mul_32x32(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The full 64-bit product of uint32 `a` and `b` as (high, low) uint32 words."""
    a0, a1 = a & _LOW16, a >> 16
    b0, b1 = b & _LOW16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # each < 2**32
    mid = p01 + p10
    mid_carry = (mid < p01).astype(jnp.uint32)  # wrapped past 2**32
    low = p00 + (mid << 16)
    low_carry = (low < p00).astype(jnp.uint32)
    high = p11 + (mid >> 16) + (mid_carry << 16) + low_carry
    return high, low


def _mod_64(high: jax.Array, low: jax.Array, prime: jax.Array) -> jax.Array:
    """(high * 2**32 + low) mod prime, for uint32 words and primes < 2**31."""
    rest = high % prime

    def bit(i, r):
        r = (r << 1) | ((low >> (31 - i)) & 1)
        return jnp.where(r >= prime, r - prime, r)

    return jax.lax.fori_loop(0, 32, bit, rest)


def _products(c: jax.Array, multipliers: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(high, low) uint32 words `[..., L]` of the 64-bit products of compressed ids `c [...]`
    (uint32) with one multiplier per layer `multipliers [L]` (uint64)."""
    m = multipliers.astype(np.uint64)
    m_high = jnp.asarray((m >> np.uint64(32)).astype(np.uint32))
    m_low = jnp.asarray((m & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    high, low = _mul_32x32(c[..., None], m_low)
    return high + c[..., None] * m_high, low  # the product is < 2**63: the high word's wrap is exact


def _rows(hasher, high: jax.Array, low: jax.Array) -> jax.Array:
    """Folded 64-bit words `[..., L, N-1]` -> int32 table rows `[..., L, N-1, H]`."""
    primes = jnp.asarray(hasher.primes.astype(np.uint32))  # [L, N-1, H]
    rows = _mod_64(high[..., None], low[..., None], primes)
    return rows.astype(jnp.int32) + jnp.asarray(hasher.offsets.astype(np.int32))


def hash_drafts(config: ModelConfig, drafts: jax.Array, folds: jax.Array) -> jax.Array:
    """Engram rows int32 `[B, K, n_engram_layers, n_cols]` of draft tokens `drafts` i32 `[B, K]`
    at the K positions after a row's last host-known token, given the host's part of their
    folds `folds` u32 `[B, K, n_engram_layers, N - 1, 2]` (`EngramHasher.draft_folds`); equal
    to the host's `hash_ids` of the sequence with the drafts appended, bit for bit."""
    from deepinfer.model.engram_hash import hasher_for

    hasher = hasher_for(config)
    B, K = drafts.shape
    c = jnp.asarray(hasher.token_map.astype(np.int32))[drafts].astype(jnp.uint32)  # [B, K]
    high, low = folds[..., 0], folds[..., 1]  # [B, K, L, N-1]
    n_folds = hasher.max_ngram - 1
    for s in range(min(K, hasher.max_ngram)):  # shift s of draft j is draft j - s (s < j)
        ph, pl = _products(c[:, : K - s], hasher.multipliers[:, s])  # drafts 1..K-s -> positions s+1..K
        reach = jnp.asarray(np.arange(1, n_folds + 1) >= s)  # fold n covers shifts 0..n
        ph = jnp.where(reach, ph[..., None], jnp.uint32(0))
        pl = jnp.where(reach, pl[..., None], jnp.uint32(0))
        pad = ((0, 0), (s, 0), (0, 0), (0, 0))
        high, low = high ^ jnp.pad(ph, pad), low ^ jnp.pad(pl, pad)
    return _rows(hasher, high, low).reshape(B, K, hasher.n_layers, hasher.n_cols)


def hash_pending(config: ModelConfig, tokens: jax.Array, folds: jax.Array) -> jax.Array:
    """Engram rows int32 `[B, n_engram_layers, n_cols]` of the tokens `tokens` i32[B], whose
    look-back folds are `folds` u32 `[B, n_engram_layers, N - 1, 2]`; equal to the host's
    `EngramHasher.hash_ids` of the same sequence, bit for bit."""
    from deepinfer.model.engram_hash import hasher_for

    hasher = hasher_for(config)
    c0 = jnp.asarray(hasher.token_map.astype(np.int32))[tokens].astype(jnp.uint32)  # [B]
    high, low = _products(c0, hasher.multipliers[:, 0])  # [B, L]
    high = high[:, :, None] ^ folds[..., 0]  # [B, L, N-1]
    low = low[:, :, None] ^ folds[..., 1]
    return _rows(hasher, high, low).reshape(tokens.shape[0], hasher.n_layers, hasher.n_cols)
