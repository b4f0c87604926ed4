"""Batch-invariant programs: every `dot_general` in fixed tiles, and XLA options that keep
element-wise code and reductions one per shape of a row.

XLA chooses a matmul's kernel and its blocking from the operand shapes: on CPU one row of
`x @ w` changes in the last bits with the number of rows (a matrix-vector product for one row,
small-matrix code for a few, Eigen blocked by size for more) and with the number of columns. An
engine whose step shapes follow the load (rows, chunk length, context) therefore gives a request
different bits depending on its neighbours (`engine-features.md` §3).

`batch_invariant(fn)` traces `fn` to a jaxpr and evaluates it again with each `dot_general`
computed in blocks of one fixed shape: the operands are brought to `[batch, M, K] x [batch, N, K]`
(as a checkpoint's `[out, in]` weights already are), padded to whole `TileShape` blocks, and a
loop over the blocks (`lax.fori_loop`, its trip count hidden from XLA so that one block runs in
the same loop body as many) computes one `[bt, tm, K] x [bt, N, K]` product per iteration. K is
never split. The tiles cut the rows (lhs) only: the model writes its products with the tokens
as the lhs (`tests/test_batch_invariant.py` checks that no column count follows the batch).
Loops, conditionals and nested calls are transformed inside.

The rest of a row's arithmetic is computed from that row alone, but not always in one way:
- on CPU XLA hands larger element-wise fusions and reductions to the YNNPACK library, whose
  `exp` and summation order differ from XLA's own code: `XLA_CPU_OPTIONS` turns those fusions
  off for the programs that must be invariant (per compilation, `jax.jit(compiler_options=...)`);
- XLA's own `exp`, `log1p`, `logistic`, `rsqrt`, `tanh` give an element one ulp apart depending
  on its place in the array (vectorised body or scalar remainder): they are evaluated with
  `ops.invariant_math` instead, made of correctly rounded operations only;
- a float sum of a few elements (mHC's 4-element Sinkhorn sums) is emitted with an order that
  depends on the array's other dimensions: sums of up to `_SHORT_SUM` elements are written out
  as additions in index order.
With these, a token's logits are the same bits in a prefill chunk, a decode step of two or more
rows and a verify step (tested). A step of one row and one token is not: XLA simplifies its
all-1 dimensions away and compiles another program (reductions to scalars among others); the
model step gives such a step a padding row (`model.step`), after which it agrees too.

This is the CPU and reference path of `EngineConfig(deterministic=True)`; what the model adds
itself (one order of the attention keys, cached and new keys read alike) is in
`model.invariant_attention`. Tested in `tests/test_batch_invariant.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial, wraps
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from deepinfer.ops.invariant_math import INVARIANT_PRIMITIVES

__all__ = ["TileShape", "XLA_CPU_OPTIONS", "batch_invariant", "compiler_options", "invariant_dot_general"]

# No YNNPACK fusions: XLA's own element-wise and reduction code, one per row shape (measured on
# XLA CPU of jax 0.12: `exp(x - max(x))` over 256 columns differs for fewer than 16 rows with them).
XLA_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(platform: str) -> dict[str, str]:
    """The `jax.jit(compiler_options=...)` of a batch-invariant program on `platform`."""
    return dict(XLA_CPU_OPTIONS) if platform == "cpu" else {}


@dataclass(frozen=True)
class TileShape:
    """The one block shape every product is computed in: `m` rows by `n` columns (K whole)."""

    m: int = 16
    n: int | None = None  # None: the columns whole (products whose N never depends on the batch)
    batch: int = 16  # batch elements per block of a product with batch dimensions

    def __post_init__(self):
        if self.m < 1 or self.batch < 1 or (self.n is not None and self.n < 1):
            raise ValueError(f"TileShape: m, n and batch must be >= 1, got {self}")


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def invariant_dot_general(lhs: jax.Array, rhs: jax.Array, *, dimension_numbers, tile: TileShape = TileShape(),
                          **params) -> jax.Array:
    """`lax.dot_general_p.bind(lhs, rhs, dimension_numbers=..., **params)` computed in `tile`
    blocks (see the module docstring); the same shape and dtype as the plain product."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch_shape = tuple(lhs.shape[d] for d in lb)
    m_shape, n_shape = tuple(lhs.shape[d] for d in lf), tuple(rhs.shape[d] for d in rf)
    Bt, M, N = math.prod(batch_shape), math.prod(m_shape), math.prod(n_shape)
    K = math.prod(lhs.shape[d] for d in lc)
    bt = tile.batch if lb else 1  # a product without batch dimensions has one "batch" always
    tn = tile.n or N
    a = _pad_to(_pad_to(jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(Bt, M, K), 0, bt), 1, tile.m)
    # rhs as [batch, N, K] (contracted last, as a checkpoint's [out, in] weights already are)
    b = _pad_to(_pad_to(jnp.transpose(rhs, (*rb, *rf, *rc)).reshape(Bt, N, K), 0, bt), 1, tn)
    n_bt, n_mt, n_nt = a.shape[0] // bt, a.shape[1] // tile.m, b.shape[1] // tn
    # [Btt*Mt, bt, tm, K] blocks of rows, and [Btt, bt, Nt, tn, K]: the column blocks are a batch dim
    a = a.reshape(n_bt, bt, n_mt, tile.m, K).transpose(0, 2, 1, 3, 4).reshape(n_bt * n_mt, bt, tile.m, K)
    b = b.reshape(n_bt, bt, n_nt, tn, K)
    # The operands are materialized in this canonical layout: otherwise XLA may fold the
    # transposes into the product in one program and not in another, and a transposed operand
    # takes another kernel.
    a, b = jax.lax.optimization_barrier((a, b))
    dims = (((3,), (3,)), ((0, 1), (0, 1)))

    def block(i: jax.Array, out: jax.Array) -> jax.Array:  # block i: [bt, Nt, tm, tn]
        rows = jax.lax.dynamic_index_in_dim(a, i, keepdims=False)[:, None]
        if n_nt > 1:
            rows = jnp.broadcast_to(rows, (bt, n_nt, tile.m, K))
        cols = jax.lax.dynamic_index_in_dim(b, i // n_mt, keepdims=False)
        product = jax.lax.dot_general_p.bind(rows, cols, dimension_numbers=dims, **params)
        return jax.lax.dynamic_update_index_in_dim(out, product.astype(out.dtype), i, 0)

    out_dtype = jax.eval_shape(partial(jax.lax.dot_general_p.bind, dimension_numbers=dims, **params),
                               jax.ShapeDtypeStruct((bt, n_nt, tile.m, K), a.dtype),
                               jax.ShapeDtypeStruct(b.shape[1:], b.dtype)).dtype
    out = jnp.zeros((a.shape[0], bt, n_nt, tile.m, tn), out_dtype)
    # A loop whose trip count XLA cannot see, so that one block is computed by the same loop
    # body as many (a one-trip loop would be inlined and compiled with its neighbours).
    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(a.shape[0])), block, out)
    out = out.reshape(n_bt, n_mt, bt, n_nt, tile.m, tn).transpose(0, 2, 1, 4, 3, 5)
    out = out.reshape(n_bt * bt, n_mt * tile.m, n_nt * tn)[:Bt, :M, :N]
    return out.reshape(*batch_shape, *m_shape, *n_shape)


def _avals(vars_) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
            for v in vars_]


def _transformed(closed: ClosedJaxpr, tile: TileShape) -> ClosedJaxpr:
    """`closed` with its products tiled, as a new closed jaxpr of the same signature."""
    return jax.make_jaxpr(partial(_eval, closed.jaxpr, closed.consts, tile=tile))(*_avals(closed.jaxpr.invars))


# Call-like primitives whose body is simply evaluated in place (inlined), by parameter name.
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
           "remat": "jaxpr", "checkpoint": "jaxpr"}


def _rewrite_params(params: dict, tile: TileShape) -> dict:
    """Params of a higher-order primitive (scan, while, cond) with its bodies transformed."""
    out = {}
    for key, value in params.items():
        if isinstance(value, ClosedJaxpr):
            value = _transformed(value, tile)
        elif isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr) for v in value):
            value = tuple(_transformed(v, tile) for v in value)
        elif isinstance(value, Jaxpr):
            raise NotImplementedError(f"batch_invariant: open jaxpr parameter {key!r} is not supported")
        out[key] = value
    return out


# Float sums over at most this many elements are written out as additions in index order.
_SHORT_SUM = 32


def _short_float_sum(x: jax.Array, axes: tuple[int, ...]) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and math.prod(x.shape[a] for a in axes) <= _SHORT_SUM


def _sum_in_order(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """`reduce_sum(x, axes)` as ((x_0 + x_1) + x_2) + ...: XLA CPU emits a short reduction
    (mHC's 4-element row and column sums of its Sinkhorn passes) with a summation order that
    depends on the array's other dimensions, so the same row changed in the last bit with the
    number of tokens in the step; additions written out have one order."""
    kept = [d for d in range(x.ndim) if d not in axes]
    flat = jnp.transpose(x, (*kept, *axes)).reshape(*(x.shape[d] for d in kept), -1)
    if flat.shape[-1] == 0:
        return jnp.zeros(flat.shape[:-1], x.dtype)
    total = flat[..., 0]
    for i in range(1, flat.shape[-1]):
        total = total + flat[..., i]
    return total


def _eval(jaxpr: Jaxpr, consts, *args, tile: TileShape):
    """Evaluate `jaxpr` on `args` (tracers of the enclosing `jit`), binding every equation as
    it is except the products, the transcendental functions, short float sums and nested calls
    (module docstring); loops and conditionals keep their form, their bodies transformed."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dot_general":
            outs = invariant_dot_general(*invals, tile=tile, **eqn.params)
        elif name in INVARIANT_PRIMITIVES:
            outs = INVARIANT_PRIMITIVES[name](*invals)
        elif name == "reduce_sum" and _short_float_sum(invals[0], eqn.params["axes"]):
            outs = _sum_in_order(invals[0], eqn.params["axes"])
        elif name in _INLINE and isinstance(eqn.params.get(_INLINE[name]), ClosedJaxpr):
            body = eqn.params[_INLINE[name]]
            outs = _eval(body.jaxpr, body.consts, *invals, tile=tile)
        else:
            outs = eqn.primitive.bind(*invals, **_rewrite_params(eqn.params, tile))
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def batch_invariant(fn: Callable, tile: TileShape = TileShape()) -> Callable:
    """`fn` with every matrix product computed in fixed `tile` blocks (module docstring). Traced
    once per call (use it inside `jax.jit`); keyword arguments are passed through as static."""

    @wraps(fn)  # the signature, for `jax.jit`'s static and donated arguments
    def wrapped(*args, **kwargs):
        closed, shape = jax.make_jaxpr(partial(fn, **kwargs), return_shape=True)(*args)
        leaves = jax.tree_util.tree_leaves(args)
        outs = _eval(closed.jaxpr, closed.consts, *leaves, tile=tile)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)

    return wrapped
