"""Manifold-constrained hyper-connections (mHC), single-pass form of V4.1.

The residual is `hc_mult` parallel streams. Each site (attention, FFN) computes its three mixes
from its own input in one projection: `pre` (collapse weights, used by the NEXT site), `post`
(how the sublayer output enters each stream) and `comb` (stream-to-stream mixing, projected to a
doubly stochastic matrix by Sinkhorn iterations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def hc_mixes(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
             hc_eps: float, sinkhorn_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams `[..., hc, D]` -> pre `[..., hc]`, post `[..., hc]`, comb `[..., hc, hc]` (fp32).

    `comb[j, k]` weighs source stream j into destination stream k."""
    hc = streams.shape[-2]
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mixes = jnp.einsum("...i,mi->...m", flat, fn.astype(jnp.float32))
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*mixes.shape[:-1], hc, hc)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)

    def sinkhorn_pass(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, sinkhorn_pass, comb)
    return pre, post, comb


def hc_collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """Weighted sum of the streams: the sublayer input."""
    out = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2)
    return out.astype(streams.dtype)


def hc_expand(y: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """out_k = post_k * y + sum_j comb[j, k] * streams_j."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, streams.astype(jnp.float32))
    out = post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(streams.dtype)
