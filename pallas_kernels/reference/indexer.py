"""The `reference` implementation of the lightning indexer's kernel ops (`index_topk`,
`index_topk_paged`) in plain jnp, built from the model's own math (`deepinfer.ops.index_select`,
re-exported here for the kernels and their tests): the model and this reference are one code
path, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.ops.index_select import (  # noqa: F401  (re-exported: the kernels' oracle)
    candidate_blocks,
    check_pool_args,
    head_sum_scores,
    index_scores,
    mask_invisible,
    select_topk,
    topk_from_scores,
    visible_counts,
)
from deepinfer.pallas_kernels.registry import REFERENCE, register


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
