"""Pallas kernel for `index_topk`: the indexer's fused scoring, then top-k in jnp.

Semantics are those of `reference/indexer.py` (the oracle). The reference materializes the
per-head relu dots `[B, T, H, R]` in fp32 (H = 32..64 times the size of the scores); the kernel
never does: per program it keeps one key tile in registers, and per query of its query tile one
`[H, d] x [d, block_r]` dot (all heads of a token share the keys), relu, times `d**-0.5`, times
the head weights, summed over heads, then the visibility mask (`r < (pos+1)//ratio`) and the
candidate mask, and writes only the `[B, T, R]` fp32 scores.

* grid `(B, T / block_t, R / chunk)`, `chunk = block_r * tiles`: a program scores `block_t`
  queries against `chunk` entries in `tiles` steps of `block_r` keys. Key tiles past the last
  entry visible to any of its queries are not computed (just written -inf), so causal prefill
  does about half the work and a short sequence in a long cache almost none.
* Heads are the dot's M dimension (padded with zero queries and zero weights to >= 16, Triton's
  smallest dot operand); the head sum is a reduction over that axis, so no register reshapes.
* Ragged R and T need no padding of the large inputs: Pallas-Triton masks loads/stores of
  blocks that cross the array end (the interpreter pads), and those rows are masked to -inf or
  never stored.
* Precision: the reference upcasts q and keys to fp32; bf16 x bf16 products are exact in fp32,
  so bf16 inputs use the tensor cores with fp32 accumulation, fp32 inputs `Precision.HIGHEST`
  (IEEE fp32 on Triton). Kernel and reference differ by summation order only.

Top-k is not fused: Pallas-Triton on jax 0.12.0.1 has no lowering for `sort`/`top_k` (only
single-axis argmax/argmin reductions; `tests/kernels/test_indexer_kernel.py` pins this), and a
k-step argmax selection would cost O(k * R) per query for k = 512. The selection therefore runs
the reference's `lax.top_k` (and, at the candidate-source layer, its block-max candidate pool)
on the kernel's scores; a fused streaming top-k needs a sort in-kernel (Triton's `tl.sort` /
`tl.topk` via jax-triton, or a Mosaic GPU port, which this kernel allows: it has no gather).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer.pallas_kernels.reference.indexer import check_pool_args, topk_from_scores, visible_counts
from deepinfer.pallas_kernels.sparse_attention import _pad_axis, _pow2_at_least

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _kernel(vis_ref, q_ref, w_ref, k_ref, *rest, scale: float, block_t: int, block_r: int, tiles: int,
            has_candidates: bool):
    if has_candidates:
        cand_ref, o_ref = rest
    else:
        (o_ref,) = rest
    chunk_start = pl.program_id(2) * (block_r * tiles)
    # Key tiles holding an entry visible to some query of this tile; the rest are only -inf.
    live = jnp.clip((jnp.max(vis_ref[...]) - chunk_start + block_r - 1) // block_r, 0, tiles)
    dt = k_ref.dtype
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    qs = [q_ref[i].astype(dt) for i in range(block_t)]  # block_t x [H, d], loaded once
    ws = [w_ref[i] for i in range(block_t)]  # block_t x [H] fp32

    def score_tile(j, _):
        start = pl.multiple_of(j * block_r, block_r)
        keys = k_ref[pl.ds(start, block_r), :]  # [BR, d]
        entry = chunk_start + start + jax.lax.broadcasted_iota(jnp.int32, (block_r,), 0)
        for i in range(block_t):
            dots = jax.lax.dot_general(qs[i], keys, (((1,), (1,)), ((), ())), precision=prec,
                                       preferred_element_type=jnp.float32)  # [H, BR]
            s = jnp.sum(jnp.maximum(dots, 0.0) * scale * ws[i][:, None], axis=0)  # [BR]
            ok = entry < vis_ref[i]
            if has_candidates:
                ok = ok & (cand_ref[i, pl.ds(start, block_r)] != 0)
            o_ref[i, pl.ds(start, block_r)] = jnp.where(ok, s, -jnp.inf)
        return 0

    def hidden_tile(j, _):
        start = pl.multiple_of(j * block_r, block_r)
        o_ref[:, pl.ds(start, block_r)] = jnp.full((block_t, block_r), -jnp.inf, jnp.float32)
        return 0

    jax.lax.fori_loop(0, live, score_tile, 0)
    jax.lax.fori_loop(live, tiles, hidden_tile, 0)


@functools.partial(jax.jit, static_argnames=("ratio", "interpret", "block_t", "block_r", "tiles",
                                             "num_warps", "num_stages"))
def index_scores_pallas(q: jax.Array, weights: jax.Array, keys: jax.Array, positions: jax.Array, ratio: int,
                        candidates: jax.Array | None = None, *, interpret: bool = False, block_t: int | None = None,
                        block_r: int = 64, tiles: int = 8, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """`reference.index_scores` (then `where(candidates, ., -inf)` when given) as one kernel:
    fp32 `[B, T, R]`. `interpret=True` runs the Pallas interpreter (any platform), otherwise it
    lowers through Pallas-Triton.

    `block_t` queries per program (default: enough for 64 dot rows, `64 // H`, at least 1) share
    each loaded key tile; `block_r` keys per step (64 rows of d=128 bf16 = 16 KiB); `tiles` steps
    per program, so `block_r * tiles` entries per program along R (grid parallelism for decode)."""
    B, T, H, d = q.shape
    R = keys.shape[1]
    if R == 0 or T == 0:
        scores = jnp.zeros((B, T, R), jnp.float32)
        return scores
    cdt = jnp.promote_types(q.dtype, keys.dtype)
    h_pad = _pow2_at_least(H)
    d_pad = _pow2_at_least(d)
    bt = min(_pow2_at_least(block_t or max(1, 64 // h_pad), 1), _pow2_at_least(T, 1))
    br = min(_pow2_at_least(block_r), _pow2_at_least(R))
    n_tiles = min(_pow2_at_least(tiles, 1), -(-R // br))
    chunk = br * n_tiles

    vis = jnp.clip(visible_counts(positions, ratio), 0, R).astype(jnp.int32)
    qp = _pad_axis(_pad_axis(q.astype(cdt), 2, h_pad), 3, d_pad)
    wp = _pad_axis(weights.astype(jnp.float32), 2, h_pad)
    kp = _pad_axis(keys.astype(cdt), 2, d_pad)
    args = [vis, qp, wp, kp]
    in_specs = [
        pl.BlockSpec((None, bt), lambda b, t, c: (b, t)),  # visible counts
        pl.BlockSpec((None, bt, h_pad, d_pad), lambda b, t, c: (b, t, 0, 0)),  # queries
        pl.BlockSpec((None, bt, h_pad), lambda b, t, c: (b, t, 0)),  # head weights
        pl.BlockSpec((None, chunk, d_pad), lambda b, t, c: (b, c, 0)),  # keys of this chunk
    ]
    if candidates is not None:
        args.append(candidates.astype(jnp.int8))
        in_specs.append(pl.BlockSpec((None, bt, chunk), lambda b, t, c: (b, t, c)))

    kernel = functools.partial(_kernel, scale=float(d) ** -0.5, block_t=bt, block_r=br, tiles=n_tiles,
                               has_candidates=candidates is not None)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltr

        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=(B, pl.cdiv(T, bt), pl.cdiv(R, chunk)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bt, chunk), lambda b, t, c: (b, t, c)),
        out_shape=jax.ShapeDtypeStruct((B, T, R), jnp.float32),
        interpret=interpret,
        name="index_scores",
        **kwargs,
    )(*args)


def index_topk_pallas(q, weights, keys, positions, ratio, k, candidates=None, pool=None, *, interpret=False,
                      **tiles):
    """Same contract as the reference `index_topk`: the kernel's scores, then the reference's
    candidate pool and `lax.top_k` selection on them."""
    check_pool_args(candidates, pool)
    scores = index_scores_pallas(q, weights, keys, positions, ratio, candidates, interpret=interpret, **tiles)
    return topk_from_scores(scores, positions, ratio, k, None, pool)


# ---- registry entries -----------------------------------------------------------------------

from deepinfer.pallas_kernels.registry import GPU_TRITON, INTERPRET, register  # noqa: E402


@register("index_topk", GPU_TRITON,
          why="Pallas-Triton kernel: fused relu-dot/head-sum/masks per key tile (no [B,T,H,R] tensor), then lax.top_k")
def index_topk_triton(q, weights, keys, positions, ratio, k, candidates=None, pool=None):
    return index_topk_pallas(q, weights, keys, positions, ratio, k, candidates, pool)


@register("index_topk", INTERPRET, why="the Pallas kernel run by the Pallas interpreter (slow; tests)")
def index_topk_interpret(q, weights, keys, positions, ratio, k, candidates=None, pool=None):
    return index_topk_pallas(q, weights, keys, positions, ratio, k, candidates, pool, interpret=True)


@register("index_topk_paged", GPU_TRITON,
          why="decodes every page's keys at once (HBM is not the CPU's cache), then the index_topk kernel")
def index_topk_paged_triton(q, weights, read_keys, n_pages, per_page, positions, ratio, k, candidates=None,
                            pool=None):
    return index_topk_pallas(q, weights, read_keys(0, n_pages), positions, ratio, k, candidates, pool)


@register("index_topk_paged", INTERPRET, why="every page's keys, then the index_topk kernel in the Pallas interpreter")
def index_topk_paged_interpret(q, weights, read_keys, n_pages, per_page, positions, ratio, k, candidates=None,
                               pool=None):
    return index_topk_pallas(q, weights, read_keys(0, n_pages), positions, ratio, k, candidates, pool,
                             interpret=True)
