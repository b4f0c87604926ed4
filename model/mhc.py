"""Manifold-constrained hyper-connections (mHC), single-pass form of V4.1.

The residual is `hc_mult` parallel streams. Each site (attention, FFN) computes its three mixes
from its own input in one projection: `pre` (collapse weights, used by the NEXT site), `post`
(how the sublayer output enters each stream) and `comb` (stream-to-stream mixing, projected to a
doubly stochastic matrix by Sinkhorn iterations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


@jax.named_scope("mhc")
def hc_mixes(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
             hc_eps: float, sinkhorn_iters: int,
             kernels: KernelConfig | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams `[..., hc, D]` -> pre `[..., hc]`, post `[..., hc]`, comb `[..., hc, hc]` (fp32).

    `comb[j, k]` weighs source stream j into destination stream k. A hot op: computed by the
    registry's `mhc_mixes` kernel (plain jnp on CPU)."""
    return get_kernel("mhc_mixes", kernels)(streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps,
                                            sinkhorn_iters=sinkhorn_iters)


@jax.named_scope("mhc")
def hc_collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """Weighted sum of the streams: the sublayer input."""
    out = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2)
    return out.astype(streams.dtype)


@jax.named_scope("mhc")
def hc_expand(y: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """out_k = post_k * y + sum_j comb[j, k] * streams_j."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, streams.astype(jnp.float32))
    out = post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(streams.dtype)
