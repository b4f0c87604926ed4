"""Pallas kernel for `mhc_mixes`: the fused mHC mix of one site (flat RMS norm, projection,
sigmoid gates, row softmax and the Sinkhorn passes) in one pass over the streams.

Semantics are those of `reference/mhc.py`. Per program: `block_n` rows (tokens) of the
flattened streams `x [N, hc*D]`, read once in `block_f`-wide chunks; each chunk feeds the
sum of squares and three small fp32 products with the projection (`pre`, `post` and `comb`
rows, each zero-padded to `P = max(16, hc*hc)` outputs). The RMS scale is a per-row scalar, so
it is applied to the projected mixes instead of the inputs. The `hc x hc` comb matrices live
flattened as `[block_n, P]` (entry `j*hc + k`); per-row-group and per-column-group sums are
masked reductions, so no reshapes or slices of register tensors are needed (Triton has
neither) and padded entries stay zero.

GPU lowering: Pallas-Triton (`pallas.triton.CompilerParams`), like `sparse_attention`; the
kernel is memory-bound (it reads `N * hc * D` activations once and writes `N * (2*hc + hc*hc)`
floats).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer.pallas_kernels.sparse_attention import _pad_axis, _pow2_at_least


def _dot_nt_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def _group_sum(v: jax.Array, group: jax.Array, n_groups: int) -> jax.Array:
    """For each entry, the sum of its row's entries in the same group (0 outside all groups)."""
    out = jnp.zeros_like(v)
    for g in range(n_groups):
        in_g = group[None, :] == g
        total = jnp.sum(jnp.where(in_g, v, 0.0), axis=1)
        out = jnp.where(in_g, total[:, None], out)
    return out


def _group_max(v: jax.Array, group: jax.Array, n_groups: int) -> jax.Array:
    out = jnp.zeros_like(v)
    for g in range(n_groups):
        in_g = group[None, :] == g
        top = jnp.max(jnp.where(in_g, v, -jnp.inf), axis=1)
        out = jnp.where(in_g, top[:, None], out)
    return out


def _kernel(x_ref, fn_ref, affine_ref, group_ref, pre_ref, post_ref, comb_ref, *, hc: int, width: int,
            block_f: int, n_f_blocks: int, norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    bn = x_ref.shape[0]
    p = pre_ref.shape[1]

    def chunk(i, carry):
        ss, a_pre, a_post, a_comb = carry
        start = pl.multiple_of(i * block_f, block_f)
        x = x_ref[:, pl.ds(start, block_f)].astype(jnp.float32)  # [BN, BF]
        ss = ss + jnp.sum(x * x, axis=1)
        a_pre = a_pre + _dot_nt_f32(x, fn_ref[0, :, pl.ds(start, block_f)])
        a_post = a_post + _dot_nt_f32(x, fn_ref[1, :, pl.ds(start, block_f)])
        a_comb = a_comb + _dot_nt_f32(x, fn_ref[2, :, pl.ds(start, block_f)])
        return ss, a_pre, a_post, a_comb

    zeros = jnp.zeros((bn, p), jnp.float32)
    ss, a_pre, a_post, a_comb = jax.lax.fori_loop(
        0, n_f_blocks, chunk, (jnp.zeros((bn,), jnp.float32), zeros, zeros, zeros))
    r = jax.lax.rsqrt(ss / width + norm_eps)[:, None]

    pre_ref[...] = jax.nn.sigmoid(affine_ref[0, 0] * (a_pre * r) + affine_ref[1, 0]) + hc_eps
    post_ref[...] = 2.0 * jax.nn.sigmoid(affine_ref[0, 1] * (a_post * r) + affine_ref[1, 1])

    row = group_ref[0]  # [P]: source stream j of entry j*hc + k, hc for padding
    col = group_ref[1]  # [P]: destination stream k, hc for padding
    valid = (row < hc)[None, :]
    logits = affine_ref[0, 2] * (a_comb * r) + affine_ref[1, 2]
    e = jnp.exp(logits - _group_max(logits, row, hc))
    e = jnp.where(valid, e, 0.0)
    c = jnp.where(valid, e / jnp.where(valid, _group_sum(e, row, hc), 1.0) + hc_eps, 0.0)
    c = c / (_group_sum(c, col, hc) + hc_eps)

    def one_pass(_, c):
        c = c / (_group_sum(c, row, hc) + hc_eps)
        return c / (_group_sum(c, col, hc) + hc_eps)

    comb_ref[...] = jax.lax.fori_loop(0, sinkhorn_iters - 1, one_pass, c)


@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "sinkhorn_iters", "interpret", "block_n",
                                             "block_f", "num_warps", "num_stages"))
def mhc_mixes_pallas(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
                     hc_eps: float, sinkhorn_iters: int, interpret: bool = False, block_n: int = 32,
                     block_f: int = 128, num_warps: int = 4,
                     num_stages: int = 2) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as the reference `mhc_mixes`."""
    *lead, hc, d = streams.shape
    width = hc * d
    x = streams.reshape(-1, width)
    n = x.shape[0]
    p = _pow2_at_least(hc * hc)
    bn = min(_pow2_at_least(block_n), _pow2_at_least(n))
    n_pad = max(bn, -(-n // bn) * bn)
    bf = min(_pow2_at_least(block_f), _pow2_at_least(width))
    f_pad = -(-width // bf) * bf
    x = _pad_axis(_pad_axis(x, 0, n_pad), 1, f_pad)

    fn = fn.astype(jnp.float32)
    groups = [fn[:hc], fn[hc:2 * hc], fn[2 * hc:2 * hc + hc * hc]]
    fn3 = jnp.stack([_pad_axis(_pad_axis(g, 0, p), 1, f_pad) for g in groups])  # [3, P, F]
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    bases = jnp.stack([_pad_axis(base[:hc], 0, p), _pad_axis(base[hc:2 * hc], 0, p),
                       _pad_axis(base[2 * hc:2 * hc + hc * hc], 0, p)])  # [3, P]
    affine = jnp.stack([jnp.broadcast_to(scale[:3, None], (3, p)), bases])  # [2 (scale, base), 3, P]
    a = jnp.arange(p, dtype=jnp.int32)
    inside = a < hc * hc
    group = jnp.stack([jnp.where(inside, a // hc, hc), jnp.where(inside, a % hc, hc)])  # [2, P]

    kernel = functools.partial(_kernel, hc=hc, width=width, block_f=bf, n_f_blocks=f_pad // bf,
                               norm_eps=float(norm_eps), hc_eps=float(hc_eps), sinkhorn_iters=int(sinkhorn_iters))
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltr

        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out_spec = pl.BlockSpec((bn, p), lambda i: (i, 0))
    out_type = jax.ShapeDtypeStruct((n_pad, p), jnp.float32)
    pre, post, comb = pl.pallas_call(
        kernel,
        grid=(n_pad // bn,),
        in_specs=[
            pl.BlockSpec((bn, f_pad), lambda i: (i, 0)),
            pl.BlockSpec((3, p, f_pad), lambda i: (0, 0, 0)),
            pl.BlockSpec((2, 3, p), lambda i: (0, 0, 0)),
            pl.BlockSpec((2, p), lambda i: (0, 0)),
        ],
        out_specs=[out_spec, out_spec, out_spec],
        out_shape=[out_type, out_type, out_type],
        interpret=interpret,
        name="mhc_mixes",
        **kwargs,
    )(x, fn3, affine, group)
    pre = pre[:n, :hc].reshape(*lead, hc)
    post = post[:n, :hc].reshape(*lead, hc)
    comb = comb[:n, :hc * hc].reshape(*lead, hc, hc)
    return pre, post, comb


# ---- registry entries -----------------------------------------------------------------------

from deepinfer.pallas_kernels.registry import GPU_TRITON, INTERPRET, register  # noqa: E402


@register("mhc_mixes", GPU_TRITON, why="Pallas-Triton kernel: one read of the streams, norm+projection+Sinkhorn fused")
def mhc_mixes_triton(streams, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters):
    return mhc_mixes_pallas(streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps,
                            sinkhorn_iters=sinkhorn_iters)


@register("mhc_mixes", INTERPRET, why="the Pallas kernel run by the Pallas interpreter (slow; tests)")
def mhc_mixes_interpret(streams, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters):
    return mhc_mixes_pallas(streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps,
                            sinkhorn_iters=sinkhorn_iters, interpret=True)
