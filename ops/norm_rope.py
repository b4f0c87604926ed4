"""RMSNorm and DeepSeek's interleaved partial RoPE with YaRN frequencies: plain jnp, shared by the
model and the kernels' reference implementations."""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back to the input dtype before the (optional) weight."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else weight.astype(x.dtype) * y


# ---- RoPE ------------------------------------------------------------------------------


def _correction_dim(rotations: float, dim: int, base: float, max_len: int) -> float:
    return dim * math.log(max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


@lru_cache(maxsize=None)
def rope_inv_freq(dim: int, base: float, yarn: tuple[float, int, float, float] | None) -> np.ndarray:
    """Inverse frequencies of DeepSeek's `precompute_freqs_cis`; `yarn` = (factor,
    original_seq_len, beta_fast, beta_slow) blends interpolated and original frequencies over
    the correction range, with no magnitude (mscale) factor."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if yarn is not None:
        factor, original_len, beta_fast, beta_slow = yarn
        low = max(math.floor(_correction_dim(beta_fast, dim, base, original_len)), 0)
        high = min(math.ceil(_correction_dim(beta_slow, dim, base, original_len)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        smooth = 1.0 - ramp
        freqs = freqs / factor * (1.0 - smooth) + freqs * smooth
    return freqs.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate adjacent channel pairs (2i, 2i+1) of the trailing `2*len(inv_freq)` channels.

    `x` is `[..., T, D]` or `[..., T, H, D]` with `positions` `[..., T]`."""
    rope_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, rd/2]
    if x.ndim == positions.ndim + 2:
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
