"""The lightning indexer's scoring and selection math in plain jnp: scores, the two-level
candidate pool, top-k.

It sits below both the model and the kernels: `deepinfer.model.indexer` calls it directly
(`index_scores`, `candidate_blocks`, `select_topk`), the `reference` implementation of the
`index_topk` kernel op (`pallas_kernels/reference/indexer.py`) is built from it, so the model
and that reference are one code path, bit for bit, and the GPU kernels share its selection part
(their fused part is the scoring). What stays in the model is everything with weights: the query
projection, RoPE and FP4 fake-quant of the index queries, and the per-head weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["candidate_blocks", "check_pool_args", "head_sum_scores", "index_scores", "mask_invisible",
           "select_topk", "topk_from_scores", "visible_counts"]


def visible_counts(positions: jax.Array, ratio: int) -> jax.Array:
    """Entries `e < (pos+1)//ratio` are visible to a query at `pos` (<= 0 for padding at -1)."""
    return (positions + 1) // ratio


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, positions: jax.Array,
                 ratio: int) -> jax.Array:
    """q `[B, T, H, d]` index queries, weights `[B, T, H]` fp32, keys `[B, R, d]`, positions
    `[B, T]` -> fp32 `[B, T, R]` scores `sum_h w_h * relu(q_h . k_r) * d**-0.5`, entries not yet
    visible to the query at -inf."""
    return mask_invisible(head_sum_scores(q, weights, keys), positions, ratio)


def head_sum_scores(q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
    """`index_scores` before the visibility mask: fp32 `[B, T, R]`."""
    d = q.shape[-1]
    dots = jnp.einsum("bthd,brd->bthr", q.astype(jnp.float32), keys.astype(jnp.float32))
    dots = jax.nn.relu(dots) * d ** -0.5
    return jnp.einsum("bthr,bth->btr", dots, weights)


def mask_invisible(scores: jax.Array, positions: jax.Array, ratio: int) -> jax.Array:
    """-inf at the entries `r >= (pos+1)//ratio` a query cannot see yet."""
    visible = jnp.arange(scores.shape[-1])[None, None, :] < visible_counts(positions, ratio)[..., None]
    return jnp.where(visible, scores, -jnp.inf)


def candidate_blocks(scores: jax.Array, positions: jax.Array, ratio: int, top_blocks: int,
                     block_size: int) -> jax.Array:
    """Level one: keep the `top_blocks` best blocks of `block_size` entries (block score = max),
    the block holding the query's newest visible entry always kept. Returns a bool mask like
    `scores`."""
    B, T, R = scores.shape
    pad = -R % block_size
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    n_blocks = (R + pad) // block_size
    block_scores = jnp.max(padded.reshape(B, T, n_blocks, block_size), axis=-1)
    newest = (visible_counts(positions, ratio) - 1) // block_size  # -1 when nothing is visible
    block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
    k = min(top_blocks, n_blocks)
    values, idx = jax.lax.top_k(block_scores, k)
    keep = jnp.zeros((B, T, n_blocks), bool)
    keep = keep.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], idx].set(values > -jnp.inf)
    return jnp.repeat(keep, block_size, axis=-1)[..., :R]


def select_topk(scores: jax.Array, k: int) -> jax.Array:
    """Top-`k` entry indices per query, `-1` where fewer than `k` entries are selectable."""
    if k == 0 or scores.shape[-1] == 0:
        return jnp.zeros((*scores.shape[:-1], 0), jnp.int32)
    k = min(k, scores.shape[-1])
    values, idx = jax.lax.top_k(scores, k)
    return jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)


def topk_from_scores(scores: jax.Array, positions: jax.Array, ratio: int, k: int,
                     candidates: jax.Array | None, pool: tuple[int, int] | None
                     ) -> tuple[jax.Array, jax.Array | None]:
    """The selection part of `index_topk` on visibility-masked scores (shared by the kernels,
    whose fused part is the scoring)."""
    check_pool_args(candidates, pool)
    pool_mask = None
    if pool is not None:
        pool_mask = candidate_blocks(scores, positions, ratio, *pool)
    if candidates is not None:
        scores = jnp.where(candidates, scores, -jnp.inf)
    return select_topk(scores, k), pool_mask


def check_pool_args(candidates, pool) -> None:
    if candidates is not None and pool is not None:
        raise ValueError("index_topk: a layer either builds the candidate pool (pool=(blocks, size)) or is "
                         "restricted to one (candidates=mask), not both")
