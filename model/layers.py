"""Small shared building blocks: RMSNorm, interleaved partial RoPE with DeepSeek's YaRN, and the
linear layer that dequantizes checkpoint-format weights at use."""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model import quant
from deepinfer.model.config import ModelConfig
from deepinfer.model.params import FP4, FP8, FP8_ROWS, QuantWeight
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back to the input dtype before the (optional) weight."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else weight.astype(x.dtype) * y


def dequantize(w, dtype) -> jax.Array:
    """A dense array of `dtype` from a plain array or a checkpoint-format `QuantWeight`."""
    if not isinstance(w, QuantWeight):
        return w.astype(dtype)
    if w.kind in (FP8, FP8_ROWS):
        return quant.dequantize_fp8_blocks(w.q, w.scale, block=w.block, xp=jnp).astype(dtype)
    if w.kind == FP4:
        return quant.dequantize_mxfp4(w.q, w.scale, block=w.block[1], xp=jnp).astype(dtype)
    raise ValueError(f"unknown quantized weight kind {w.kind!r}")


def linear(x: jax.Array, w, kernels: KernelConfig | None = None) -> jax.Array:
    """`x @ w.T` for a weight stored `[out, in]` as in the checkpoint, in x's dtype.

    A block-FP8 `QuantWeight` goes through the registry's `fp8_block_matmul` (the reference on
    CPU, bit for bit the dequantize + einsum below; on a CUDA GPU a kernel that dequantizes
    tile by tile instead of writing the dense weight to HBM). Callers need not pass `kernels`:
    `None` is the platform's choice."""
    if isinstance(w, QuantWeight) and w.kind == FP8:
        return get_kernel("fp8_block_matmul", kernels)(x, w)
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))


def gather_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """Rows of an embedding-like table (dense or FP8 rows with 1x32 scales) without
    dequantizing the whole table."""
    if isinstance(table, QuantWeight):
        rows = QuantWeight(table.q[ids], table.scale[ids], kind=table.kind, block=table.block)
        return dequantize(rows, dtype)
    return table[ids].astype(dtype)


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


def layer_inv_freq(config: ModelConfig, layer: int) -> np.ndarray:
    """Ratio-0 layers: `rope_theta`, no YaRN; layers with a compressed branch: the compress rope."""
    if config.compress_ratios[layer] == 0:
        return rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, None)
    return compress_inv_freq(config)


def compress_inv_freq(config: ModelConfig) -> np.ndarray:
    yarn = (config.rope_factor, config.original_seq_len, config.beta_fast, config.beta_slow)
    return rope_inv_freq(config.qk_rope_head_dim, config.compress_rope_theta, yarn)


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
