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

from deepinfer.model import qat
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import apply_rope, compress_inv_freq, dequantize, linear, rms_norm


@jax.named_scope("compressor")
def project(p: dict, x: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array | None]:
    """Per-token compressor inputs: (kv, gate) in fp32 for ratio > 1, (kv, None) for ratio 1."""
    if ratio == 1:
        return linear(x, p["wkv"]), None
    xf = x.astype(jnp.float32)
    kv = jnp.einsum("...i,oi->...o", xf, dequantize(p["wkv"], jnp.float32))
    gate = jnp.einsum("...i,oi->...o", xf, dequantize(p["wgate"], jnp.float32))
    return kv, gate


@jax.named_scope("compressor")
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


@jax.named_scope("compressor")
def cache_entries(config: ModelConfig, latent: jax.Array, positions: jax.Array) -> jax.Array:
    """Main compressed-KV entries: RoPE (compress rope) at each group's first position, then
    the reference's fake-quant (`qat.compressed_kv`)."""
    return qat.compressed_kv(apply_rope(latent, positions, compress_inv_freq(config)), config)


@jax.named_scope("compressor")
def compress_full(p: dict, config: ModelConfig, x: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array]:
    """All complete groups of a whole sequence `x [B, T, D]` (positions 0..T-1): returns
    pre-RoPE latents `[B, T//ratio, D]` and their positions `[B, T//ratio]`."""
    B, T, _ = x.shape
    n = (T // ratio) * ratio
    kv, gate = project(p, x[:, :n], ratio)
    latent = pool_groups(kv, gate, ratio, p["norm"], config.rms_norm_eps, x.dtype)
    positions = jnp.broadcast_to(jnp.arange(T // ratio, dtype=jnp.int32) * ratio, (B, T // ratio))
    return latent, positions


@jax.named_scope("compressor")
def compress_full_v4(p: dict, config: ModelConfig, x: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V4 compressor over a whole sequence `x [B, T, D]`: rows `[B, T//ratio, width]`
    (normalized, pre-RoPE) and their positions (each window's first token).

    Per channel, a softmax over the window's slots of `gate + ape[slot]` weighs the slots' `kv`.
    CSA (ratio 4) overlaps: row w pools the first halves of window w-1 (channels :width, ape
    `[:, :width]`) and the second halves of window w (channels width:, ape `[:, width:]`), so it
    covers tokens 4w-4 .. 4w+3; window -1 contributes nothing (score -inf). HCA pools its window."""
    B, T, _ = x.shape
    n = T // ratio
    width = p["norm"].shape[-1]
    if n == 0:
        return jnp.zeros((B, 0, width), x.dtype), jnp.zeros((B, 0), jnp.int32)
    xf = x[:, : n * ratio].astype(jnp.float32)
    kv = jnp.einsum("...i,oi->...o", xf, dequantize(p["wkv"], jnp.float32)).reshape(B, n, ratio, -1)
    score = jnp.einsum("...i,oi->...o", xf, dequantize(p["wgate"], jnp.float32)).reshape(B, n, ratio, -1)
    score = score + p["ape"].astype(jnp.float32)
    if ratio == 4:
        prev_kv = jnp.pad(kv[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_score = jnp.pad(score[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([prev_kv, kv[..., width:]], axis=2)
        score = jnp.concatenate([prev_score, score[..., width:]], axis=2)
    rows = jnp.sum(kv * jax.nn.softmax(score, axis=2), axis=2).astype(x.dtype)
    rows = rms_norm(rows, p["norm"], config.rms_norm_eps)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * ratio, (B, n))
    return rows, positions
