"""Engram memory (V4.1 layers 1 and 14): an n-gram lookup written into the residual streams,
gated per stream by how well the looked-up key matches the stream.

The hash ids are computed on the host from token ids (`engram_hash.py`); here the rows are
gathered (FP8 rows dequantized on the fly), projected by `wkv` into one key per stream and a
shared value, and added to each stream through `sigmoid(signed_sqrt(normalized dot))`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import gather_rows, linear


@jax.named_scope("engram")
def engram(p: dict, config: ModelConfig, streams: jax.Array, hash_ids: jax.Array,
           live: jax.Array | None = None) -> jax.Array:
    """streams `[B, T, hc, D]`, hash_ids int32 `[B, T, n_cols]`; `live` bool `[B, T]` (False
    shuts the gate, e.g. image tokens). Returns updated streams."""
    B, T, hc, D = streams.shape
    rows = gather_rows(p["embed"], hash_ids, streams.dtype)  # [B, T, n_cols, d]
    kv = linear(rows.reshape(B, T, -1), p["wkv"])
    key = kv[..., : hc * D].astype(jnp.float32).reshape(B, T, hc, D)
    value = kv[..., hc * D:].astype(jnp.float32)
    weight = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    h = streams.astype(jnp.float32)
    eps = config.rms_norm_eps
    rstd = jax.lax.rsqrt(jnp.mean(h * h, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(h * weight * key, axis=-1) * rstd * D ** -0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    if live is not None:
        gate = jnp.where(live[..., None], gate, 0.0)
    return (h + gate[..., None] * value[..., None, :]).astype(streams.dtype)
