"""Lightning indexer of CSA2 with the two-level (hierarchical) top-k of V4.1.

Index keys are produced only by KV-source layers, from the compressor latent (`wk` + `k_norm`,
RoPE at the group position, FP4 fake-quant); in V4 every CSA layer makes its own with a second
compressor (`compressor.compress_full_v4`). Every index-source layer scores its queries against
its source's keys: `s[t] = sum_h w_h * relu(q_h . k_t) / sqrt(d)`, invisible entries -inf. The
candidate-source layer (20 in the release) also selects a pool of 8-entry blocks that later
Reindex layers are restricted to.

The scoring and selection math lives in `ops/index_select.py` (below the model and the kernels;
the `index_topk` kernel op's reference is built from it); this module computes the op's inputs
and reaches the op through the kernel registry, so a GPU kernel can replace it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.model import qat
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import apply_rope, compress_inv_freq, linear, rms_norm
from deepinfer.ops import index_select
from deepinfer.ops.index_select import candidate_blocks, select_topk  # noqa: F401 (model API)
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


@jax.named_scope("indexer")
def index_keys(p: dict, config: ModelConfig, latent: jax.Array, positions: jax.Array) -> jax.Array:
    k = rms_norm(linear(latent, p["wk"]), p["k_norm"], config.rms_norm_eps)
    return qat.index_vector(apply_rope(k, positions, compress_inv_freq(config)), config)


@jax.named_scope("indexer")
def index_queries(p: dict, config: ModelConfig, x: jax.Array, q_residual: jax.Array,
                  positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The weighted part of the indexer: x `[B, T, D]` (attn-normed), q_residual `[B, T, q_lora]`
    -> index queries `[B, T, H, d]` (rotated, fake-quantized) and fp32 head weights `[B, T, H]`
    (times `H**-0.5`), the inputs of the `index_topk` kernel op."""
    B, T, _ = x.shape
    nh, d = config.index_n_heads, config.index_head_dim
    q = linear(q_residual, p["wq_b"]).reshape(B, T, nh, d)
    q = qat.index_vector(apply_rope(q, positions, compress_inv_freq(config)), config)
    weights = linear(x, p["weights_proj"]).astype(jnp.float32) * nh ** -0.5
    return q, weights


@jax.named_scope("indexer")
def index_scores(p: dict, config: ModelConfig, x: jax.Array, q_residual: jax.Array, positions: jax.Array,
                 keys: jax.Array, ratio: int) -> jax.Array:
    """x `[B, T, D]` (attn-normed), q_residual `[B, T, q_lora]`, keys `[B, R, d]` -> `[B, T, R]`
    fp32 scores with entries not yet visible to each query (e >= (pos+1)//ratio) at -inf."""
    q, weights = index_queries(p, config, x, q_residual, positions)
    return index_select.index_scores(q, weights, keys, positions, ratio)


@jax.named_scope("indexer")
def select(p: dict, config: ModelConfig, layer: int, x: jax.Array, q_residual: jax.Array, positions: jax.Array,
           shared: dict, kernels: KernelConfig | None = None) -> tuple[jax.Array, jax.Array | None]:
    """One index-source layer's selection through the `index_topk` kernel op: `(topk [B, T, K],
    candidate pool [B, T, R] at the candidate-source layer else None)`; Reindex layers after the
    candidate source are restricted to `shared["candidates"]`."""
    ratio = config.compress_ratios[layer]
    q, weights = index_queries(p, config, x, q_residual, positions)
    candidates = shared["candidates"] if config.uses_candidates(layer) else None
    index_topk = get_kernel("index_topk", kernels)
    return index_topk(q, weights, shared["index_keys", config.kv_source(layer)], positions, ratio,
                      config.index_topk, candidates, candidate_pool(config, layer))


def candidate_pool(config: ModelConfig, layer: int) -> tuple[int, int] | None:
    """`(top blocks, block size)` of the candidate pool a layer builds (the candidate source's
    `pool` argument of the `index_topk` ops), None for every other layer."""
    if layer == config.candidate_source_layer_id:
        return config.candidate_topk_blocks, config.candidate_block_size
    return None


def pool_ids(pool: jax.Array, block_size: int, top_blocks: int) -> jax.Array:
    """The candidate pool as entry ids: bool `pool [B, T, R]` (whole blocks of `block_size`, as
    `candidate_blocks` makes it) -> int32 `[B, T, min(top_blocks, n_blocks) * block_size]`, the
    kept blocks' entries in ascending order, -1 after them (fewer blocks kept) and past R."""
    B, T, R = pool.shape
    pad = -R % block_size
    n_blocks = (R + pad) // block_size
    kept = jnp.pad(pool, ((0, 0), (0, 0), (0, pad))).reshape(B, T, n_blocks, block_size).any(-1)
    # top_k of (n_blocks - block) over kept blocks: the smallest kept block ids, ascending
    order, _ = jax.lax.top_k(jnp.where(kept, n_blocks - jnp.arange(n_blocks), 0).astype(jnp.float32),
                             min(top_blocks, n_blocks))
    block = jnp.where(order > 0, n_blocks - order.astype(jnp.int32), -1)
    ids = block[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    ids = jnp.where((block[..., None] >= 0) & (ids < R), ids, -1)
    return ids.reshape(B, T, -1)


def select_in_pool(index_topk, q: jax.Array, weights: jax.Array, keys: jax.Array, ids: jax.Array,
                   positions: jax.Array, ratio: int, k: int) -> jax.Array:
    """A Reindex layer's top-k scored on its candidate pool only: `keys [B, T, C, d]` are the
    source's indexer keys at the pool's ascending entry `ids [B, T, C]` (-1 = none, see
    `pool_ids`). Each query becomes a row of its own for the `index_topk` op, its candidates
    masked to the entries visible at its position; the op's picks map back to entry ids.

    The same selection as the op over every key restricted to the pool (`candidates`): the same
    scores of the same entries, in the same order, so ties break alike (lower entry first)."""
    B, T, C, d = keys.shape
    H = q.shape[2]
    visible = (ids >= 0) & (ids < index_select.visible_counts(positions, ratio)[..., None])
    every = jnp.full((B * T, 1), C * ratio - 1, jnp.int32)  # a position that sees all C rows
    top, _ = index_topk(q.reshape(B * T, 1, H, d), weights.reshape(B * T, 1, H), keys.reshape(B * T, C, d), every,
                        ratio, k, visible.reshape(B * T, 1, C), None)
    top = top.reshape(B, T, -1)
    return jnp.where(top >= 0, jnp.take_along_axis(ids, jnp.maximum(top, 0), axis=-1), -1)


def dense_selection(positions: jax.Array, n_rows: int, ratio: int) -> jax.Array:
    """V4's HCA attends to every visible compressed row: indices `[B, T, n_rows]`, -1 where the
    row is not visible yet."""
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    return jnp.where(rows < ((positions + 1) // ratio)[..., None], rows, -1)
