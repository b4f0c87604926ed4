"""The mHC mixes of one site (V4.1 single-pass hyper-connections) in plain jnp.

Same formulas as `deepinfer.model.mhc.hc_mixes` (kept separate so the kernel package does not
import model code; `tests/kernels/test_mhc_kernel.py` checks the two agree): a flat RMS norm of
the `hc` streams, one projection to `2*hc + hc*hc` mixes, sigmoid gates for `pre` and `post`,
and a row softmax followed by Sinkhorn normalisation for `comb`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.pallas_kernels.registry import REFERENCE, register


@register("mhc_mixes", REFERENCE, why="plain jnp: norm, projection, gates, softmax and a Sinkhorn fori_loop")
def mhc_mixes(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
              hc_eps: float, sinkhorn_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams `[..., hc, D]`, fn `[2*hc + hc*hc, hc*D]`, base `[2*hc + hc*hc]`, scale `[3]`
    -> pre `[..., hc]`, post `[..., hc]`, comb `[..., hc, hc]`, all fp32.

    `comb[j, k]` weighs source stream j into destination stream k."""
    hc = streams.shape[-2]
    x = streams.reshape(*streams.shape[:-2], hc * streams.shape[-1]).astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + norm_eps)
    mix = jnp.einsum("...i,mi->...m", x, fn.astype(jnp.float32))
    b = base.astype(jnp.float32)
    s = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(s[0] * mix[..., :hc] + b[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(s[1] * mix[..., hc:2 * hc] + b[hc:2 * hc])
    logits = (s[2] * mix[..., 2 * hc:] + b[2 * hc:]).reshape(*mix.shape[:-1], hc, hc)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)  # columns

    def one_pass(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)  # rows
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)  # columns

    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, one_pass, comb)
    return pre, post, comb
