"""The Engram hash of one token on the device, for a token only the device knows yet.

Under asynchronous scheduling a decode row's input token is the one its previous step sampled,
still on the device when the host builds the next step (`serve/engine/placeholders.py`). Its
Engram rows (`engram_hash.py`: products of compressed ids with odd 64-bit multipliers, XOR-folded
over the look-back, reduced modulo primes) need 64-bit integers, which JAX's default 32-bit mode
does not have; this computes them exactly in pairs of uint32 words. The host supplies the
look-back's part of each fold (`EngramHasher.pending_folds`); here the token's compressed id
times the first multiplier is XOR-ed in and the 64-bit value reduced modulo each prime (primes
are below 2**31, so the bit-serial remainder stays within 32 bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.config import ModelConfig

__all__ = ["hash_pending"]

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


def hash_pending(config: ModelConfig, tokens: jax.Array, folds: jax.Array) -> jax.Array:
    """Engram rows int32 `[B, n_engram_layers, n_cols]` of the tokens `tokens` i32[B], whose
    look-back folds are `folds` u32 `[B, n_engram_layers, N - 1, 2]`; equal to the host's
    `EngramHasher.hash_ids` of the same sequence, bit for bit."""
    from deepinfer.model.engram_hash import hasher_for

    hasher = hasher_for(config)
    token_map = jnp.asarray(hasher.token_map.astype(np.int32))
    first = hasher.multipliers[:, 0].astype(np.uint64)  # [L]
    m_high = jnp.asarray((first >> np.uint64(32)).astype(np.uint32))
    m_low = jnp.asarray((first & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    c0 = token_map[tokens].astype(jnp.uint32)[:, None]  # [B, 1]
    high, low = _mul_32x32(c0, m_low[None])  # [B, L]
    high = high + c0 * m_high[None]  # the product is < 2**63: the high word's wrap is exact
    high = high[:, :, None] ^ folds[..., 0]  # [B, L, N-1]
    low = low[:, :, None] ^ folds[..., 1]
    primes = jnp.asarray(hasher.primes.astype(np.uint32))  # [L, N-1, H]
    rows = _mod_64(high[..., None], low[..., None], primes[None])  # [B, L, N-1, H]
    rows = rows.astype(jnp.int32) + jnp.asarray(hasher.offsets.astype(np.int32))[None]
    return rows.reshape(tokens.shape[0], hasher.n_layers, hasher.n_cols)
