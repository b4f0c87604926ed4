"""Mixture of experts of V4.1: sqrt-softplus router with a selection-only bias, top-k,
renormalised weights times the routed scale, clamped SwiGLU experts (routing weight applied
before `w2`), plus one shared expert with weight 1.

An EPLB layout (`p["placement"]`, physical expert slots) and expert parallelism (a duck-typed `ep`
object) plug in here without this module importing the sharding code."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import dequantize, linear
from deepinfer.model.params import FP4, QuantWeight
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


@jax.named_scope("moe")
def moe(p: dict, config: ModelConfig, x: jax.Array, *, token_ids: jax.Array | None = None,
        n_active: int | None = None, kernels: KernelConfig | None = None, ep=None,
        live: jax.Array | None = None, return_counts: bool = False):
    """x `[..., D]` (ffn-normed) -> `[..., D]` in x's dtype (fp32 accumulation). `token_ids`
    (shaped like x without D) feed hash-routed layers.

    With `p["placement"]` (an EPLB layout: `log2phy [E, max_rep]`, `count [E]`) the experts are
    physical slots and routing is remapped onto them (`to_physical`). `ep` (duck-typed, e.g.
    `deepinfer.sharding.expert_parallel.ExpertParallel`; call inside its `shard_map`) computes
    the routed experts with expert parallelism instead of every expert locally.
    `return_counts=True` returns `(y, counts)`: int32 `[n_logical_experts]` (token, choice)
    pairs per logical expert among `live` tokens (shaped like x without D; None = all)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    k = n_active or config.num_experts_per_tok
    weights, ids = route(p["gate"], flat, k, config, token_ids)
    counts = expert_counts(ids, _leading_dim(p["gate"]["weight"]), live) if return_counts else None
    if "placement" in p:
        rows = jnp.arange(flat.shape[0], dtype=jnp.int32)
        ids = to_physical(ids, p["placement"]["log2phy"], p["placement"]["count"], rows)
    if ep is None:
        y = routed_experts(flat, weights, ids, p["experts"], config.swiglu_limit, kernels)
    else:
        y = ep.experts(flat, weights, ids, p["experts"], config.swiglu_limit, kernels)
    if "shared_experts" in p:
        y = y + shared_expert(p["shared_experts"], flat, config.swiglu_limit)
    y = y.astype(x.dtype).reshape(shape)
    return (y, counts) if return_counts else y


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, experts: dict, limit: float,
                   kernels: KernelConfig | None = None) -> jax.Array:
    """The routed experts of x `[N, D]` with the routing (`ids` / `weights` `[N, k]`) -> `[N, D]`
    fp32: the single-device path.

    MXFP4 experts (the checkpoint's format) go to the registry's `moe_experts_mxfp4`, which
    dequantizes inside the kernel on a GPU instead of writing the dense expert stack to HBM
    (its reference is bit for bit the dense path below); other weights are dequantized here
    and run every expert on every row with a dense combine matrix."""
    w1, w3, w2 = experts["w1"], experts["w3"], experts["w2"]
    if all(isinstance(w, QuantWeight) and w.kind == FP4 for w in (w1, w3, w2)):
        return get_kernel("moe_experts_mxfp4", kernels)(x, weights, ids, w1, w3, w2, limit)
    combine = jnp.zeros((x.shape[0], _leading_dim(experts["w1"])), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    run = get_kernel("moe_experts", kernels)
    return run(x, combine, dequantize(experts["w1"], x.dtype), dequantize(experts["w3"], x.dtype),
               dequantize(experts["w2"], x.dtype), limit)


def to_physical(ids: jax.Array, log2phy: jax.Array, replica_count: jax.Array,
                token_index: jax.Array) -> jax.Array:
    """Logical expert ids `[N, k]` -> physical slots `[N, k]` of an EPLB layout (`log2phy
    [E, max_rep]` padded, `replica_count [E]`). Token n takes replica `n % count[e]`: deterministic,
    and it spreads a hot expert's tokens evenly over its copies."""
    replica = token_index.reshape(-1, 1) % jnp.maximum(replica_count[ids], 1)
    return log2phy[ids, replica]


def expert_counts(ids: jax.Array, n_experts: int, live: jax.Array | None = None) -> jax.Array:
    """(token, choice) pairs per expert, int32 `[n_experts]`, counting only `live` tokens: the
    load statistic EPLB plans from."""
    ones = jnp.ones(ids.shape, jnp.int32)
    if live is not None:
        ones = ones * live.reshape(-1, 1).astype(jnp.int32)
    return jnp.zeros((n_experts,), jnp.int32).at[ids.reshape(-1)].add(ones.reshape(-1))


def _leading_dim(w) -> int:
    return (w.q if hasattr(w, "q") else w).shape[0]
