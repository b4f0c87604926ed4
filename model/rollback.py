"""Undo the tail of a verify step: keep each row's first `kept` tokens in the cache, as if the
step had run on those tokens only.

Speculative decoding runs the target over a row's anchor and its drafts (consecutive positions
p .. p+k) in one step and learns on the device, after the last layer, how many of them it
accepts. What the rejected tokens wrote must not stay where a later step reads it
(model-v4.1-flash.md §3):

- per sequence, the 128-token window rings of every layer and draft block, and `window_pos`:
  a rejected token at p+j overwrote ring slot (p+j) % 128, which held position p+j-128, still
  inside the window of the next queries. `RingSnapshot` keeps those rows as the step found them
  and `roll_back` puts them back.
- per sequence, a ratio-2 source's pending token: after the step it must be the last KEPT
  token's `(kv, gate)` when that token opens a pair (an even position). The step reports every
  token's compressor inputs (`Undo.pair_inputs`) so the right one can be chosen; at an odd
  frontier the next step's first token opens a pair and never reads it.
- global, paged: compressed entries and indexer keys of rejected positions stay in the pages but
  are invisible (an entry is visible only to queries at or past the position that completes it:
  `ops.index_select.visible_counts`) and are rewritten, before any read, by the step that
  computes the real tokens at those positions (the step writes new entries first). Nothing to do.

Rows that kept every token (and padding rows) are left exactly as the step made them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from deepinfer.model.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RingSnapshot:
    """The ring rows a step is about to overwrite: `rows[i]` `[rings, B, T, ...]` of window array
    i at each token's ring slot `index [B, T]` (W: the token writes no ring row), and the
    `window_pos [B, T]` there."""

    rows: tuple[jax.Array, ...]
    pos: jax.Array
    index: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Undo:
    """What `roll_back` needs from a verify step: the ring snapshot and, per ratio-2 source, every
    token's compressor inputs `[B, T, 2, D]` fp32 (kv, gate)."""

    rings: RingSnapshot
    pair_inputs: tuple[jax.Array, ...]


def snapshot_rings(cache: KVCache, slots: jax.Array, index: jax.Array) -> RingSnapshot:
    """The rows of `slots [B]` at ring slots `index [B, T]` (W = none) before a step writes them."""
    W = cache.window_pos.shape[1]
    at = jnp.minimum(index, W - 1)  # a dropped write's row is never restored (see roll_back)
    rows = tuple(w[:, slots[:, None], at] for w in cache.window)
    return RingSnapshot(rows, cache.window_pos[slots[:, None], at], index)


def roll_back(cache: KVCache, undo: Undo, slots: jax.Array, positions: jax.Array, kept: jax.Array) -> KVCache:
    """The cache after a verify step over rows at `positions [B, T]` (-1 = padding) in `slots`,
    keeping each row's first `kept [B]` tokens (>= 1 for a real row)."""
    W = cache.window_pos.shape[1]
    B, T = positions.shape
    token = jnp.arange(T)[None, :]
    rejected = (token >= kept[:, None]) & (positions >= 0)
    snap = undo.rings
    # restore only rows a rejected token wrote; everything else goes to the dropped index W
    index = jnp.where(rejected & (snap.index < W), snap.index, W)
    window = tuple(w.at[:, slots[:, None], index].set(old, mode="drop") for w, old in zip(cache.window, snap.rows))
    window_pos = cache.window_pos.at[slots[:, None], index].set(snap.pos, mode="drop")

    rows = jnp.arange(B)
    last = jnp.clip(kept - 1, 0, T - 1)
    frontier = positions[rows, last]
    opens_pair = (frontier >= 0) & (frontier % 2 == 0) & jnp.any(rejected, axis=1)
    pending = []
    for held, inputs in zip(cache.pending, undo.pair_inputs):
        target = jnp.where(opens_pair, slots, held.shape[0])  # others: dropped
        pending.append(held.at[target].set(inputs[rows, last], mode="drop"))
    return dataclasses.replace(cache, window=window, window_pos=window_pos, pending=tuple(pending))
