"""CSA2 compressor of a KV-source layer: turns the layer's (attn-normed) input into compressed
latents, one per `ratio` tokens, aligned to absolute positions (group k = positions
k*ratio .. k*ratio+ratio-1).

Ratio 2 (encoder sources): fp32 projections `kv` and `gate`, per-channel softmax of the gate over
the two tokens of a group, gated sum, RMSNorm. Ratio 1 (the decoder source): RMSNorm of the plain
projection, one latent per token. Latents are returned BEFORE RoPE: the indexer keys derive
from them, and the main-cache entry is their rotated, FP4-quantized form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.model import quant
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import apply_rope, compress_inv_freq, dequantize, linear, rms_norm


def project(p: dict, x: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array | None]:
    """Per-token compressor inputs: (kv, gate) in fp32 for ratio > 1, (kv, None) for ratio 1."""
    if ratio == 1:
        return linear(x, p["wkv"]), None
    xf = x.astype(jnp.float32)
    kv = jnp.einsum("...i,oi->...o", xf, dequantize(p["wkv"], jnp.float32))
    gate = jnp.einsum("...i,oi->...o", xf, dequantize(p["wgate"], jnp.float32))
    return kv, gate


def pool_groups(kv: jax.Array, gate: jax.Array | None, ratio: int, norm_weight: jax.Array, eps: float,
                dtype) -> jax.Array:
    """Complete groups `[B, G*ratio, D]` -> normalized latents `[B, G, D]` (pre-RoPE)."""
    if ratio == 1:
        return rms_norm(kv, norm_weight, eps)
    B, n, D = kv.shape
    kv = kv.reshape(B, n // ratio, ratio, D)
    weights = jax.nn.softmax(gate.reshape(B, n // ratio, ratio, D), axis=2)
    latent = jnp.sum(kv * weights, axis=2).astype(dtype)
    return rms_norm(latent, norm_weight, eps)


def cache_entries(config: ModelConfig, latent: jax.Array, positions: jax.Array) -> jax.Array:
    """Main compressed-KV entries: RoPE (compress rope) at each group's first position, then
    the reference's FP4 fake-quant (e2m1, one e4m3 scale per 16 channels)."""
    rotated = apply_rope(latent, positions, compress_inv_freq(config))
    if config.fake_quant:
        rotated = quant.fake_quant_fp4(rotated, block=16, e4m3_scales=True)
    return rotated


def compress_full(p: dict, config: ModelConfig, x: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array]:
    """All complete groups of a whole sequence `x [B, T, D]` (positions 0..T-1): returns
    pre-RoPE latents `[B, T//ratio, D]` and their positions `[B, T//ratio]`."""
    B, T, _ = x.shape
    n = (T // ratio) * ratio
    kv, gate = project(p, x[:, :n], ratio)
    latent = pool_groups(kv, gate, ratio, p["norm"], config.rms_norm_eps, x.dtype)
    positions = jnp.broadcast_to(jnp.arange(T // ratio, dtype=jnp.int32) * ratio, (B, T // ratio))
    return latent, positions
