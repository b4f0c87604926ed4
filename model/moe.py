"""Mixture of experts of V4.1: sqrt-softplus router with a selection-only bias, top-k,
renormalised weights times the routed scale, clamped SwiGLU experts (routing weight applied
before `w2`), plus one shared expert with weight 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import dequantize, linear
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


def route(gate: dict, x: jax.Array, top_k: int, config: ModelConfig,
          token_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x `[N, D]` -> (weights `[N, k]` fp32 including the routed scale, expert ids `[N, k]`).

    Experts are the top-k of `scores + bias` (the bias steers selection only), or, in V4's
    hash-routed layers, `tid2eid[token_id]`; weights always come from the unbiased scores."""
    logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), dequantize(gate["weight"], jnp.float32))
    scores = jnp.sqrt(jax.nn.softplus(logits / config.gate_temp))
    if "tid2eid" in gate:
        ids = gate["tid2eid"][token_ids.reshape(-1)]
    else:
        _, ids = jax.lax.top_k(scores + gate["bias"].astype(jnp.float32), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if config.norm_topk_prob and top_k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


def shared_expert(p: dict, x: jax.Array, limit: float) -> jax.Array:
    gate = linear(x, p["w1"]).astype(jnp.float32)
    up = linear(x, p["w3"]).astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return linear((jax.nn.silu(gate) * up).astype(x.dtype), p["w2"]).astype(jnp.float32)


def moe(p: dict, config: ModelConfig, x: jax.Array, *, token_ids: jax.Array | None = None,
        n_active: int | None = None, kernels: KernelConfig | None = None) -> jax.Array:
    """x `[..., D]` (ffn-normed) -> `[..., D]` in x's dtype (fp32 accumulation). `token_ids`
    (shaped like x without D) feed hash-routed layers."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    k = n_active or config.num_experts_per_tok
    weights, ids = route(p["gate"], flat, k, config, token_ids)
    n_experts = _n_experts(p)
    combine = jnp.zeros((flat.shape[0], n_experts), jnp.float32)
    combine = combine.at[jnp.arange(flat.shape[0])[:, None], ids].add(weights)
    experts = p["experts"]
    run = get_kernel("moe_experts", kernels)
    y = run(flat, combine, dequantize(experts["w1"], x.dtype), dequantize(experts["w3"], x.dtype),
            dequantize(experts["w2"], x.dtype), config.swiglu_limit)
    if "shared_experts" in p:
        y = y + shared_expert(p["shared_experts"], flat, config.swiglu_limit)
    return y.astype(x.dtype).reshape(shape)


def _n_experts(p: dict) -> int:
    w1 = p["experts"]["w1"]
    return (w1.q if hasattr(w1, "q") else w1).shape[0]
