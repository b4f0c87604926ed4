"""The lightning indexer's hot op in plain jnp: scores, the two-level candidate pool, top-k.

This is the model's own math (`deepinfer.model.indexer` calls these functions, so the model and
the `reference` implementation of `index_topk` are one code path, bit for bit). What stays in
the model is everything with weights: the query projection, RoPE and FP4 fake-quant of the index
queries, and the per-head weights (`weights_proj`, times `n_heads**-0.5`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.pallas_kernels.registry import REFERENCE, register


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


@register("index_topk", REFERENCE,
          why="plain jnp: all-head relu scores [B,T,H,R] in fp32, visibility/candidate masks, lax.top_k")
def index_topk(q: jax.Array, weights: jax.Array, keys: jax.Array, positions: jax.Array, ratio: int, k: int,
               candidates: jax.Array | None = None, pool: tuple[int, int] | None = None
               ) -> tuple[jax.Array, jax.Array | None]:
    """The indexer's selection for one index-source layer.

    q `[B, T, H, d]` (rotated, fake-quantized index queries), weights `[B, T, H]` fp32 (already
    times `H**-0.5`), keys `[B, R, d]`, positions `[B, T]` (-1 = padding), `ratio` the source's
    compress ratio, `k` the top-k size. `candidates` bool `[B, T, R]`: restrict the selection to
    this pool (Reindex layers after the candidate source). `pool=(top_blocks, block_size)`: also
    build the pool from the unrestricted scores (the candidate-source layer).

    Returns `(topk int32 [B, T, min(k, R)] with -1 where fewer are selectable, pool mask bool
    [B, T, R] or None)`.
    """
    scores = index_scores(q, weights, keys, positions, ratio)
    return topk_from_scores(scores, positions, ratio, k, candidates, pool)


# Rows (batch rows x entries) per chunk of `index_topk_paged`: the chunk's decoded keys and
# per-head dots stay within the CPU's caches (measured on tiny-v4.1, d = 64, 16 heads: 8192
# rows ran 8x faster than decoding a batch of 8 x 32K keys at once, bit-equal scores).
_CHUNK_ROWS = 8192
_CHUNK_DOTS = 1 << 17


def paged_chunk_pages(n_pages: int, per_page: int, batch: int, queries: int, heads: int) -> int:
    """Pages per chunk: the largest divisor of `n_pages` within the row and dot budgets (>= 1)."""
    rows = max(1, min(_CHUNK_ROWS // batch, _CHUNK_DOTS // (batch * queries * heads)) // per_page)
    pages = min(rows, n_pages)
    while n_pages % pages:
        pages -= 1
    return pages


@register("index_topk_paged", REFERENCE,
          why="plain jnp: decodes and scores the page pool a chunk of pages at a time (no decoded copy of "
              "the whole context, no [B,T,H,R] dots), then lax.top_k")
def index_topk_paged(q: jax.Array, weights: jax.Array, read_keys, n_pages: int, per_page: int,
                     positions: jax.Array, ratio: int, k: int, candidates: jax.Array | None = None,
                     pool: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array | None]:
    """`index_topk` over keys that live in pages: `read_keys(first, count)` returns the decoded
    keys `[B, count * per_page, d]` of every row's logical pages `first .. first + count - 1`
    (`first` may be traced, `count` is static), so the op never holds all `n_pages * per_page`
    decoded keys at once; the caller owns the page table and the codec. Same contract and
    result as `index_topk(q, weights, read_keys(0, n_pages), ...)`."""
    check_pool_args(candidates, pool)
    B, T, H, _ = q.shape
    R = n_pages * per_page
    pages = paged_chunk_pages(n_pages, per_page, B, T, H) if R else 1
    width = pages * per_page

    def chunk(i, scores):
        part = head_sum_scores(q, weights, read_keys(i * pages, pages))
        return jax.lax.dynamic_update_slice_in_dim(scores, part, i * width, axis=2)

    scores = jnp.zeros((B, T, R), jnp.float32)
    if R:
        scores = jax.lax.fori_loop(0, n_pages // pages, chunk, scores)
    return topk_from_scores(mask_invisible(scores, positions, ratio), positions, ratio, k, candidates, pool)
