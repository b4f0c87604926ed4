"""Pallas kernel for `sparse_attention`: sliding-window keys plus top-k selected compressed
entries, one online softmax with a per-head sink, K == V, fp32 accumulation.

Semantics are those of `reference/sparse_attention.py` (the oracle). Layout of the work:

* grid `(B, T, H_pad / block_h)`: one program per query token and head block. All heads of a
  token share one KV stream (MQA), so a program streams the token's keys once for `block_h`
  heads.
* The softmax state starts at `m = sink, l = 1, acc = 0`, which puts `exp(sink)` into the
  denominator and nothing into the numerator, exactly the reference's extra sink column.
* Window keys: a loop over `block_s` rows of `window_kv[b]`, from the block of the first to
  the block of the last admitted key of this query (the wrapper computes that range from the
  mask), each block masked by `window_mask[b, t]`.
* Compressed entries: a loop over `block_k` slots of `topk[b, t]`; the slot indices gather
  rows of `compressed_kv[b]` **inside the kernel** (`ref[idx_vector, :]`); `-1` (or
  out-of-range) slots read row 0 and are masked to `-inf`.

GPU lowering: Pallas-Triton (`pallas.triton.CompilerParams`). The gather is a vector-indexed
load, which Triton expresses directly (a tensor of row pointers). On jax 0.12.0.1 Mosaic GPU is
reachable only through `plgpu.kernel`, whose lowering rejects a vector-indexed ref read
(`NotImplementedError: int_indexer_shape non-empty`; scalar-indexed row reads do lower); a Mosaic
version would need one TMA copy per selected row. Pallas-Triton is deprecated in jax 0.11+
(a DeprecationWarning at lowering time), so this file is the port target once Mosaic GPU gains
gathers (Blackwell TMA gather4) or a jax-triton/tokamax kernel replaces it.

Triton shape rules the wrapper takes care of: every block dimension is a power of two and
every `dot` operand dimension is at least 16, so heads, window rows, top-k slots and the head
dimension are padded (zeros / masked) and the output is sliced back.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Lowering-time notice of the Pallas-Triton deprecation (see the module docstring); the
# kernel choice is deliberate and documented, so keep it out of every log line.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

_MIN_DOT = 16  # Triton's smallest dot operand dimension


def _pow2_at_least(n: int, lo: int = _MIN_DOT) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a `[M, D]` . b `[N, D]`^T -> fp32 `[M, N]` (full fp32 precision for fp32 inputs)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _online_update(carry, s, values):
    """One block of the online softmax: s fp32 `[BH, N]` (masked = -inf), values `[N, D]`."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A head whose sink is -inf and whose keys so far are all masked keeps m = -inf; shift by 0
    # there so no (-inf) - (-inf) appears.
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_ref)
    p = jnp.exp(s - m_ref[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot_nn(p.astype(values.dtype), values)
    return m_new, l, acc


def _kernel(lo_ref, hi_ref, q_ref, sink_ref, kv_ref, mask_ref, topk_ref, ckv_ref, o_ref, *,
            scale: float, block_s: int, block_k: int, n_k_blocks: int, n_rows: int):
    q = q_ref[...]  # [BH, D]
    bh = q.shape[0]
    dt = kv_ref.dtype
    q = q.astype(dt)
    m = sink_ref[...].astype(jnp.float32)
    carry = (m, jnp.ones((bh,), jnp.float32), jnp.zeros(q_ref.shape, jnp.float32))

    def window_block(j, carry):
        start = pl.multiple_of(j * block_s, block_s)
        keys = kv_ref[pl.ds(start, block_s), :]  # [BS, D]
        ok = mask_ref[pl.ds(start, block_s)] != 0  # [BS]
        s = _dot_nt(q, keys) * scale
        s = jnp.where(ok[None, :], s, -jnp.inf)
        return _online_update(carry, s, keys)

    lo = lo_ref[0]
    hi = hi_ref[0]
    carry = jax.lax.fori_loop(lo // block_s, (hi + block_s - 1) // block_s, window_block, carry)

    if n_k_blocks:
        def selected_block(j, carry):
            start = pl.multiple_of(j * block_k, block_k)
            idx = topk_ref[pl.ds(start, block_k)]  # [BK] int32
            ok = (idx >= 0) & (idx < n_rows)
            rows = ckv_ref[jnp.where(ok, idx, 0), :]  # in-kernel gather, [BK, D]
            s = _dot_nt(q, rows) * scale
            s = jnp.where(ok[None, :], s, -jnp.inf)
            return _online_update(carry, s, rows)

        carry = jax.lax.fori_loop(0, n_k_blocks, selected_block, carry)

    _, l, acc = carry
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _window_range(window_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per query `[B, T, 1]`: first admitted key and one past the last (0, 0 when none)."""
    S = window_mask.shape[-1]
    if S == 0:
        zero = jnp.zeros((*window_mask.shape[:-1], 1), jnp.int32)
        return zero, zero
    any_ok = jnp.any(window_mask, axis=-1)
    lo = jnp.argmax(window_mask, axis=-1)
    hi = S - jnp.argmax(window_mask[..., ::-1], axis=-1)
    lo = jnp.where(any_ok, lo, 0).astype(jnp.int32)
    hi = jnp.where(any_ok, hi, 0).astype(jnp.int32)
    return lo[..., None], hi[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "block_s", "block_k",
                                             "num_warps", "num_stages"))
def sparse_attention_pallas(q: jax.Array, window_kv: jax.Array, window_mask: jax.Array,
                            compressed_kv: jax.Array, topk: jax.Array, sink: jax.Array, scale: float, *,
                            interpret: bool = False, block_h: int = 16, block_s: int | None = None,
                            block_k: int | None = None, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Same contract as the reference `sparse_attention`; `interpret=True` runs the kernel body
    with the Pallas HLO interpreter (any platform), otherwise it lowers through Pallas-Triton.

    `block_s` / `block_k` (rows of window keys / selected entries per step) default to what
    keeps one key tile at 32 KiB (64 rows of 256 B, 32 of D=512 bf16), so `num_stages` copies
    of it fit in shared memory next to the q and accumulator tiles."""
    B, T, H, D = q.shape
    S = window_kv.shape[1]
    R = compressed_kv.shape[1]
    K = topk.shape[-1]
    # One compute dtype for the dots (the model passes one dtype; mixed inputs are promoted).
    cdt = jnp.promote_types(jnp.promote_types(q.dtype, window_kv.dtype), compressed_kv.dtype)
    window_kv = window_kv.astype(cdt)
    compressed_kv = compressed_kv.astype(cdt)
    tile_rows = max(_MIN_DOT, min(64, (32 * 1024) // (_pow2_at_least(D) * jnp.dtype(cdt).itemsize)))
    block_s = block_s or tile_rows
    block_k = block_k or tile_rows

    bh = min(_pow2_at_least(block_h), _pow2_at_least(H))
    h_pad = -(-H // bh) * bh
    d_pad = _pow2_at_least(D)
    bs = min(_pow2_at_least(block_s), _pow2_at_least(S))
    s_pad = max(bs, -(-S // bs) * bs)
    use_selected = K > 0 and R > 0
    bk = min(_pow2_at_least(block_k), _pow2_at_least(K)) if use_selected else _MIN_DOT
    k_pad = -(-K // bk) * bk if use_selected else bk
    n_k_blocks = k_pad // bk if use_selected else 0

    qp = _pad_axis(_pad_axis(q.astype(cdt), 2, h_pad), 3, d_pad)
    sinkp = _pad_axis(sink.astype(jnp.float32), 0, h_pad)
    kvp = _pad_axis(_pad_axis(window_kv, 1, s_pad), 2, d_pad)
    maskp = _pad_axis(window_mask.astype(jnp.int8), 2, s_pad)
    lo, hi = _window_range(window_mask)
    if use_selected:
        topkp = _pad_axis(topk.astype(jnp.int32), 2, k_pad, value=-1)
        ckvp = _pad_axis(compressed_kv, 2, d_pad)
        n_rows = R
    else:  # nothing to gather: tiny placeholders the kernel never reads
        topkp = jnp.full((B, T, k_pad), -1, jnp.int32)
        ckvp = jnp.zeros((B, 1, d_pad), window_kv.dtype)
        n_rows = 0

    kernel = functools.partial(_kernel, scale=float(scale), block_s=bs, block_k=bk, n_k_blocks=n_k_blocks,
                               n_rows=n_rows)
    grid = (B, T, h_pad // bh)
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltr

        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, 1), lambda b, t, h: (b, t, 0)),  # lo
            pl.BlockSpec((None, None, 1), lambda b, t, h: (b, t, 0)),  # hi
            pl.BlockSpec((None, None, bh, d_pad), lambda b, t, h: (b, t, h, 0)),  # q
            pl.BlockSpec((bh,), lambda b, t, h: (h,)),  # sink
            pl.BlockSpec((None, s_pad, d_pad), lambda b, t, h: (b, 0, 0)),  # window keys
            pl.BlockSpec((None, None, s_pad), lambda b, t, h: (b, t, 0)),  # window mask
            pl.BlockSpec((None, None, k_pad), lambda b, t, h: (b, t, 0)),  # topk slots
            pl.BlockSpec((None, ckvp.shape[1], d_pad), lambda b, t, h: (b, 0, 0)),  # compressed rows
        ],
        out_specs=pl.BlockSpec((None, None, bh, d_pad), lambda b, t, h: (b, t, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, h_pad, d_pad), cdt),
        interpret=interpret,
        name="sparse_attention",
        **kwargs,
    )(lo, hi, qp, sinkp, kvp, maskp, topkp, ckvp)
    return out[:, :, :H, :D].astype(q.dtype)


# ---- registry entries -----------------------------------------------------------------------

from deepinfer.pallas_kernels.registry import GPU_TRITON, INTERPRET, register  # noqa: E402


@register("sparse_attention", GPU_TRITON,
          why="Pallas-Triton kernel: in-kernel top-k row gather + window, one online softmax with sink")
def sparse_attention_triton(q, window_kv, window_mask, compressed_kv, topk, sink, scale):
    return sparse_attention_pallas(q, window_kv, window_mask, compressed_kv, topk, sink, scale)


@register("sparse_attention", INTERPRET, why="the Pallas kernel run by the Pallas interpreter (slow; tests)")
def sparse_attention_interpret(q, window_kv, window_mask, compressed_kv, topk, sink, scale):
    return sparse_attention_pallas(q, window_kv, window_mask, compressed_kv, topk, sink, scale, interpret=True)
