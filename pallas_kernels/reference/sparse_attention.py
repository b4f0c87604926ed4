"""Attention with a per-head sink over a sliding window plus top-k selected compressed entries."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.pallas_kernels.registry import REFERENCE, register


@register("sparse_attention", REFERENCE, why="plain jnp: gathers the selected rows, one dense softmax")
def sparse_attention(q: jax.Array, window_kv: jax.Array, window_mask: jax.Array, compressed_kv: jax.Array,
                     topk: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """One softmax over [window keys ++ selected compressed entries ++ sink], K == V.

    q `[B, T, H, D]`; window_kv `[B, S, D]` with window_mask bool `[B, T, S]`; compressed_kv
    `[B, R, D]` with topk int32 `[B, T, K]` (entry indices, -1 = empty slot); sink `[H]`.
    The sink only adds `exp(sink)` to the denominator. Returns `[B, T, H, D]` in q's dtype.
    """
    qf = q.astype(jnp.float32)
    logits_w = jnp.einsum("bthd,bsd->bths", qf, window_kv.astype(jnp.float32)) * scale
    logits_w = jnp.where(window_mask[:, :, None, :], logits_w, -jnp.inf)
    values = [window_kv.astype(jnp.float32)]
    parts = [logits_w]
    if topk.shape[-1] and compressed_kv.shape[1]:
        picked = jnp.take_along_axis(
            compressed_kv[:, None, :, :], jnp.maximum(topk, 0)[..., None], axis=2
        ).astype(jnp.float32)  # [B, T, K, D]
        logits_c = jnp.einsum("bthd,btkd->bthk", qf, picked) * scale
        logits_c = jnp.where((topk >= 0)[:, :, None, :], logits_c, -jnp.inf)
        parts.append(logits_c)
    sink_col = jnp.broadcast_to(sink.astype(jnp.float32)[None, None, :, None], (*logits_w.shape[:3], 1))
    logits = jnp.concatenate(parts + [sink_col], axis=-1)
    logits = logits - jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    S = window_kv.shape[1]
    out = jnp.einsum("bths,bsd->bthd", probs[..., :S], window_kv.astype(jnp.float32))
    if len(parts) > 1:
        out = out + jnp.einsum("bthk,btkd->bthd", probs[..., S:-1], picked)
    return out.astype(q.dtype)
