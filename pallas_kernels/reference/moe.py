"""Routed-expert SwiGLU with DeepSeek's clamps, computed for every expert and combined with a
dense routing-weight matrix (zero for unselected experts): exact, simple, and the oracle for the
grouped-matmul kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.pallas_kernels.registry import REFERENCE, register


def _tokens_first(x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum("nd,efd->enf")` with the tokens as the product's rows (lhs), which a
    batch-invariant program tiles (`ops.batch_invariant`; `jnp.einsum` makes the weight the lhs)."""
    return jnp.transpose(jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (2,)), ((), ()))), (1, 0, 2))


@register("moe_experts", REFERENCE, why="plain jnp: every expert on every token, dense combine weights")
def moe_experts(x: jax.Array, combine: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array,
                swiglu_limit: float) -> jax.Array:
    """x `[N, D]`, combine `[N, E]` (route weight, 0 if unselected), w1/w3 `[E, F, D]`,
    w2 `[E, D, F]` dense -> `[N, D]` fp32 sum over experts of w2(silu(g) * u * weight)."""
    gate = _tokens_first(x, w1).astype(jnp.float32)
    up = _tokens_first(x, w3).astype(jnp.float32)
    if swiglu_limit > 0:
        up = jnp.clip(up, -swiglu_limit, swiglu_limit)
        gate = jnp.minimum(gate, swiglu_limit)
    h = jax.nn.silu(gate) * up * combine.T[:, :, None]
    out = jnp.einsum("enf,edf->end", h.astype(x.dtype), w2.astype(x.dtype)).astype(jnp.float32)
    return jnp.sum(out, axis=0)
