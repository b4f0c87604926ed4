"""The attention of a batch-invariant step: each query's keys in one fixed order and shape.

The engine step attends each query over [ring ++ chunk] keys shared by the chunk's queries
(`model.step`): where a key sits in that array, and how long the array is, depend on how the
prompt was cut into chunks and on the step's token bucket, and so does the order in which the
softmax and the value sum add the keys up. With `KernelConfig(batch_invariant=True)` the step
instead gives every query its own `window` keys ordered by distance (offset 0 = the query's own
position), read from the ring for positions before the chunk and from the chunk for the rest,
and attends each query as its own batch row, its selected compressed entries gathered first:
a query's reductions then see the same keys in the same order in prefill, chunked prefill,
decode and verification, whatever else the step holds (`engine-features.md` §3).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["per_query_attention", "window_by_offset"]


def window_by_offset(keys: jax.Array, key_pos: jax.Array, positions: jax.Array,
                     window: int) -> tuple[jax.Array, jax.Array]:
    """`keys` `[B, W + T, D]` = ring (slot = position % W) ++ the chunk's T rows, whose first row
    is the row's first position `positions[:, 0]`; `key_pos` `[B, W + T]` their positions (-1 =
    empty). Returns each query's `window` keys `[B, T, window, D]` at positions `p - o` for
    o = 0 .. window-1, and those keys' positions `[B, T, window]`, -1 where the key is not there
    (before the sequence, an empty ring slot, or a padding query)."""
    W = keys.shape[1] - positions.shape[1]
    start = positions[:, :1, None]  # [B, 1, 1]
    want = positions[:, :, None] - jnp.arange(window, dtype=positions.dtype)  # [B, T, window]
    index = jnp.where(want >= start, W + want - start, jnp.mod(want, W))
    index = jnp.clip(index, 0, keys.shape[1] - 1)
    B = keys.shape[0]
    flat = index.reshape(B, -1)
    got_pos = jnp.take_along_axis(key_pos, flat, axis=1).reshape(index.shape)
    picked = jnp.take_along_axis(keys, flat[..., None], axis=1).reshape(*index.shape, keys.shape[-1])
    valid = (want >= 0) & (got_pos == want) & (positions[:, :, None] >= 0)
    return picked, jnp.where(valid, want, -1)


def per_query_attention(attend: Callable, q: jax.Array, keys: jax.Array, mask: jax.Array, entries: jax.Array,
                        topk: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """`attend` (the registry's `sparse_attention`) with every query its own batch row: q
    `[B, T, H, D]`, keys `[B, T, S, D]` and mask `[B, T, S]` per query (`window_by_offset`),
    compressed `entries` `[B, R, D]` selected by `topk` `[B, T, K]` (-1 = none)."""
    B, T, H, D = q.shape
    rows = B * T
    K = topk.shape[-1]
    if K and entries.shape[1]:
        picked = jnp.take_along_axis(entries[:, None], jnp.maximum(topk, 0)[..., None], axis=2)  # [B, T, K, D]
        picked = picked.reshape(rows, K, entries.shape[-1])
        slots = jnp.where(topk >= 0, jnp.arange(K, dtype=topk.dtype), -1).reshape(rows, 1, K)
    else:  # a sliding-window-only layer
        picked, slots = jnp.zeros((rows, 0, entries.shape[-1]), entries.dtype), topk.reshape(rows, 1, K)
    o = attend(q.reshape(rows, 1, H, D), keys.reshape(rows, *keys.shape[2:]), mask.reshape(rows, 1, -1), picked,
               slots, sink, scale)
    return o.reshape(B, T, H, D)
