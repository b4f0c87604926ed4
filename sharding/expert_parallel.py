"""Expert parallelism (EP) for the routed experts of the MoE.

Why: the routed experts hold nearly all of a DeepSeek model's weights, so they are split over
every device ("DP attention + EP MoE"): the device at index ``i`` along the EP mesh axes owns the
physical experts ``[i * n_local, (i + 1) * n_local)``. Each token must then travel to the devices
owning its chosen experts and its results must travel back. `ExpertParallel.experts` does that
inside a `jax.shard_map` body and returns, for the local tokens, the same routed-expert sum as the
single-device `deepinfer.model.moe.routed_experts` (up to the fp32 summation order).

Methods:

- ``"all_to_all"``: a dense, padded `jax.lax.all_to_all`. Every (token, choice) pair ``p`` of the
  ``P = N * k`` local pairs is written to slot ``p`` of its destination's chunk, so the capacity per
  destination is ``P`` and no token is ever dropped (exact). Runs everywhere, including CPU.
- ``"ragged_all_to_all"``: the same exchange with `jax.lax.ragged_all_to_all`, sending only the
  pairs each device really receives (pairs sorted by destination, sizes exchanged first). For GPU
  backends: XLA:CPU does not implement ``ragged-all-to-all`` (it lowers to StableHLO on CPU but does
  not compile), so asking for it on CPU is a ValueError. Its bookkeeping is tested on CPU through
  `ep_experts(..., ragged_all_to_all=...)` with an emulation built from dense all_to_all.
- ``"all_gather"``: the fallback: every device gathers all tokens of the EP group, runs its own
  experts on them and `psum_scatter` returns each device's rows.

``replicated_axes``: when the tokens are identical over some mesh axes (e.g. only ``dp`` splits
rows and the ``cp``/``tp`` ranks hold copies), each replica takes a 1/size share of the rows (N
padded to a multiple), exchanges only that share, and the shares are all-gathered back, so no
expert work is duplicated and every replica still ends with the full ``[N, D]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from deepinfer.model.layers import dequantize
from deepinfer.model.params import FP4, QuantWeight
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel

METHODS = ("all_to_all", "ragged_all_to_all", "all_gather")

__all__ = ["METHODS", "ExpertParallel", "ep_experts", "ep_size", "ffn_partition_specs"]


def _axis_tuple(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclass(frozen=True)
class ExpertParallel:
    """How the routed experts are split and exchanged; hashable, so it can be a static jit argument.

    `axes`: mesh axes the physical experts shard over (their product is the EP size); `method`:
    one of `METHODS`; `replicated_axes`: axes over which the tokens given to `experts` are equal."""

    axes: tuple[str, ...]
    method: str = "all_to_all"
    replicated_axes: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "axes", _axis_tuple(self.axes))
        object.__setattr__(self, "replicated_axes", _axis_tuple(self.replicated_axes))
        if not self.axes:
            raise ValueError("ExpertParallel needs at least one mesh axis in `axes`")
        if self.method not in METHODS:
            raise ValueError(f"ExpertParallel method must be one of {METHODS}, got {self.method!r}")

    def experts(self, x: jax.Array, weights: jax.Array, ids: jax.Array, experts: dict,
                swiglu_limit: float, kernels: KernelConfig | None = None) -> jax.Array:
        """Inside `shard_map`: local tokens x `[N, D]`, routing `weights`/`ids` `[N, k]` (physical
        ids), the local experts shard -> `[N, D]` fp32 routed-expert sum of the local tokens."""
        if self.method == "ragged_all_to_all" and jax.default_backend() == "cpu":
            raise ValueError("ExpertParallel method 'ragged_all_to_all' cannot run on the CPU backend "
                             "(XLA:CPU does not implement ragged-all-to-all); use method='all_to_all'")
        return ep_experts(x, weights, ids, experts, swiglu_limit, kernels, axes=self.axes,
                          method=self.method, replicated_axes=self.replicated_axes)


def ep_size(mesh: Mesh, axes) -> int:
    """Devices the experts are split over: the product of the sizes of `axes` on `mesh`."""
    return math.prod(mesh.shape[a] for a in _axis_tuple(axes))


def ffn_partition_specs(ffn: dict, mesh: Mesh, axes) -> dict:
    """shard_map `in_specs` for an ffn params subtree: the routed experts (dense or QuantWeight)
    split along their leading (physical expert) dim over the `axes` of size > 1 on `mesh` (as
    `params_shardings` places them); gate, shared expert and placement replicated."""
    split = tuple(a for a in _axis_tuple(axes) if mesh.shape[a] > 1)
    experts = PartitionSpec(split if len(split) != 1 else split[0]) if split else PartitionSpec()
    return {key: jax.tree.map(lambda _: experts if key == "experts" else PartitionSpec(), sub)
            for key, sub in ffn.items()}


def ep_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, experts: dict, swiglu_limit: float,
               kernels: KernelConfig | None = None, *, axes, method: str = "all_to_all",
               replicated_axes=(), ragged_all_to_all=jax.lax.ragged_all_to_all) -> jax.Array:
    """`ExpertParallel.experts` without the platform check. `ragged_all_to_all` is injectable
    so the exact-size path can be checked on CPU against an emulation of the collective."""
    # size-1 axes move nothing; dropping them keeps the result's varying-axes type minimal
    axes, replicated_axes = (tuple(a for a in _axis_tuple(t) if jax.lax.axis_size(a) > 1)
                             for t in (axes, replicated_axes))
    n = x.shape[0]
    x, weights, ids = _take_share(x, weights, ids, replicated_axes)
    n_local = _leading_dim(experts["w1"])
    run = partial(_local_experts, experts=experts, n_local=n_local, limit=swiglu_limit, kernels=kernels)
    if method not in METHODS:
        raise ValueError(f"expert-parallel method must be one of {METHODS}, got {method!r}")
    if not axes:  # one EP device: it holds every expert
        y = run(x, ids, weights)
    elif method == "all_gather":
        y = _via_all_gather(x, weights, ids, run, n_local, axes)
    elif method == "all_to_all":
        y = _via_exchange(x, weights, ids, run, n_local, _dense_exchange(axes))
    else:
        y = _via_exchange(x, weights, ids, run, n_local, _ragged_exchange(axes, ragged_all_to_all))
    if replicated_axes:
        y = jax.lax.all_gather(y, replicated_axes, tiled=True, to="invarying")[:n]
    return y


def _take_share(x, weights, ids, replicated_axes):
    """This replica's 1/size share of the rows; padding rows get id -1 (no expert)."""
    if not replicated_axes:
        return x, weights, ids
    size = jax.lax.axis_size(replicated_axes)
    share = -(-x.shape[0] // size)
    pad = share * size - x.shape[0]
    start = jax.lax.axis_index(replicated_axes) * share
    take = lambda a, fill: jax.lax.dynamic_slice_in_dim(
        jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill), start, share)
    return take(x, 0), take(weights, 0), take(ids, -1)


def _leading_dim(w) -> int:
    return (w.q if hasattr(w, "q") else w).shape[0]


def _local_experts(rows, local_ids, row_weights, *, experts, n_local, limit, kernels):
    """Rows `[R, D]` with local expert ids / weights `[R, j]` (-1: none) -> `[R, D]` fp32 through
    the registry over this device's experts only: MXFP4 experts (the checkpoint's format) go to
    `moe_experts_mxfp4`, which dequantizes in the kernel; others to the dense `moe_experts`."""
    if all(isinstance(experts[w], QuantWeight) and experts[w].kind == FP4 for w in ("w1", "w3", "w2")):
        return get_kernel("moe_experts_mxfp4", kernels)(rows, row_weights, local_ids, experts["w1"],
                                                         experts["w3"], experts["w2"], limit)
    combine = jnp.sum(jax.nn.one_hot(local_ids, n_local, dtype=jnp.float32) * row_weights[..., None], axis=1)
    run = get_kernel("moe_experts", kernels)
    dtype = rows.dtype
    return run(rows, combine, dequantize(experts["w1"], dtype), dequantize(experts["w3"], dtype),
               dequantize(experts["w2"], dtype), limit)


def _via_all_gather(x, weights, ids, run, n_local, axes):
    """All tokens of the EP group to every device; each adds its own experts' share of every row,
    and `psum_scatter` sums the shares and hands each device its rows back."""
    gather = partial(jax.lax.all_gather, axis_name=axes, tiled=True)
    ids_all = gather(ids)
    local = ids_all - jax.lax.axis_index(axes) * n_local
    local = jnp.where((ids_all >= 0) & (local >= 0) & (local < n_local), local, -1)
    y = run(gather(x), local, gather(weights))
    return jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)


def _via_exchange(x, weights, ids, run, n_local, exchange):
    """Pairs (token, choice) to their experts' devices and back: `exchange(rows, dest, local_ids,
    weights, compute)` moves the pairs, applies `compute` on the receiving side, returns each
    pair's result `[P, D]`; the k results of a token are then summed."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    dest = jnp.where(flat >= 0, flat // n_local, -1)
    local = jnp.where(flat >= 0, flat % n_local, -1)
    compute = lambda r, i, w: run(r, i[:, None], w[:, None])
    pair_y = exchange(jnp.repeat(x, k, axis=0), dest, local, weights.reshape(-1), compute)
    return pair_y.reshape(n, k, -1).sum(axis=1)


def _dense_exchange(axes):
    """Padded all_to_all: pair p goes to slot p of its destination's chunk (capacity P, exact)."""
    a2a = partial(jax.lax.all_to_all, axis_name=axes, split_axis=0, concat_axis=0, tiled=True)

    def exchange(rows, dest, local, w, compute):
        ep, n_pairs = jax.lax.axis_size(axes), rows.shape[0]
        to = dest[None, :] == jnp.arange(ep)[:, None]  # [ep, P]
        send_rows = jnp.where(to[..., None], rows[None], 0).reshape(ep * n_pairs, -1)
        send_ids = jnp.where(to, local[None], -1).reshape(-1)
        send_w = jnp.where(to, w[None], 0).reshape(-1)
        out = compute(a2a(send_rows), a2a(send_ids), a2a(send_w))
        back = a2a(out).reshape(ep, n_pairs, -1)
        return back[jnp.maximum(dest, 0), jnp.arange(n_pairs)]  # pairs with dest -1 got zeros

    return exchange


def _ragged_exchange(axes, ragged_all_to_all):
    """Exact-size exchange: pairs sorted by destination; a [sender, receiver] table of pair
    counts (all_gather of each device's send sizes) gives every offset of both directions."""

    def exchange(rows, dest, local, w, compute):
        ep, n_pairs = jax.lax.axis_size(axes), rows.shape[0]
        me = jax.lax.axis_index(axes)
        key = jnp.where(dest >= 0, dest, ep)  # pairs without expert sort last and are not sent
        order = jnp.argsort(key, stable=True)
        sizes = jnp.sum(key[None, :] == jnp.arange(ep)[:, None], axis=1).astype(jnp.int32)
        table = jax.lax.all_gather(sizes, axes)  # [sender, receiver]
        send_off = jnp.cumsum(table, axis=1) - table  # chunk start in the sender's sorted pairs
        recv_off = jnp.cumsum(table, axis=0) - table  # chunk start in the receiver's buffer
        cap = ep * n_pairs
        fwd = lambda operand, out: ragged_all_to_all(operand, out, send_off[me], table[me], recv_off[me],
                                                     table[:, me], axis_name=axes)
        got_rows = fwd(rows[order], jnp.zeros((cap, rows.shape[1]), rows.dtype))
        got_ids = fwd(local[order], jnp.full((cap,), -1, local.dtype))
        got_w = fwd(w[order], jnp.zeros((cap,), w.dtype))
        out = compute(got_rows, got_ids, got_w)
        back = ragged_all_to_all(out, jnp.zeros((n_pairs, out.shape[1]), out.dtype), recv_off[:, me],
                                 table[:, me], send_off[:, me], table[me], axis_name=axes)
        return jnp.zeros_like(back).at[order].set(back)

    return exchange
