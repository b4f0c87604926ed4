"""Compress a chunk at a KV source and store the new entries and indexer keys into the paged pool.

This is the body of the engine step's `_source_step` (model/step.py) up to, not including, the
read-back of the sequence's pages, factored out op for op so that it IS the engine's path: the
same jnp calls in the same order, so its pools and pending state are bit-equal to the step's
(tests/kernels/test_compress_store_kernel.py runs both on one cache and compares every byte).

Per token of a row (`positions` -1 = padding):

* ratio 2: the token pairs with the token before it (the first one with the slot's held
  `pending` token of the previous step): per-channel softmax of the two gates, gated sum of
  the two `kv`, cast to the compute dtype, RMSNorm. A token at an odd position completes
  entry `position // 2`, rotated at `position - 1`. The row's last token, if at an even
  position, becomes the slot's new pending token.
* ratio 1: RMSNorm of `kv`; every valid token is entry `position`, rotated at `position`.

Entries are RoPE'd latents; indexer keys are `RoPE(RMSNorm(latent @ wk.T, k_norm))`. The
indexer-key projection is inside the op (it needs the latent the op makes), done as the model's
`linear`, so the Pallas kernel (pallas_kernels/compress_store.py) can keep it an XLA matmul of
the same shape and stay bit-equal. Storage PACKED encodes rows as FP4 records (entries: e2m1 +
e4m3 per 16, keys: e2m1 + UE8M0 per 32); FLOAT stores the compute-dtype rows, fake-quantized
when `fake_quant` is on. A row goes to `page_table[b, entry // per_page]`, slot
`entry % per_page`; rows that are not emitted, whose page is -1 or lies past the pool, are
dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.ops import quant
from deepinfer.ops.cache_codec import FLOAT, encode
from deepinfer.ops.norm_rope import apply_rope, rms_norm
from deepinfer.pallas_kernels.linear import linear
from deepinfer.pallas_kernels.registry import REFERENCE, register

OP = "compress_store"


def next_pending(kv: jax.Array, gate: jax.Array, held: jax.Array, pending: jax.Array, slots: jax.Array,
                 positions: jax.Array, last_index: jax.Array) -> jax.Array:
    """The ratio-2 pending state after the step: a row whose last token sits at an even position
    holds that token's (kv, gate) in its slot; other rows keep `held` (their slot's old state)."""
    rows = jnp.arange(kv.shape[0])
    last_pos = positions[rows, last_index]
    newest = jnp.stack([kv[rows, last_index], gate[rows, last_index]], axis=1)
    return pending.at[slots].set(jnp.where((last_pos % 2 == 0)[:, None, None], newest, held))


def entry_targets(positions: jax.Array, valid: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(emit, entry index, RoPE position) per token: which tokens complete an entry."""
    if ratio == 1:
        return valid, positions, positions
    return valid & (positions % 2 == 1), positions // 2, positions - 1


def page_slots(page_table: jax.Array, entry_idx: jax.Array, emit: jax.Array, per_page: int,
               num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of each token's entry; page = `num_pages` (out of range: the write is
    dropped) where nothing is emitted or the table has no page (-1)."""
    logical = jnp.clip(entry_idx // per_page, 0, page_table.shape[1] - 1)
    page = page_table[jnp.arange(entry_idx.shape[0])[:, None], logical]
    page = jnp.where(emit & (page >= 0), page, num_pages)
    return page, entry_idx % per_page


def _write_rows(pool: tuple[jax.Array, ...], rows: tuple[jax.Array, ...], page: jax.Array,
                offset: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(array.at[page, offset].set(values.astype(array.dtype), mode="drop")
                 for array, values in zip(pool, rows))


def check_args(kv, gate, pending, slots, last_index, entries, ratio: int, storage: str) -> None:
    """Argument checks shared by every implementation (static shapes only)."""
    if ratio not in (1, 2):
        raise ValueError(f"compress_store: ratio must be 1 or 2, got {ratio}")
    if ratio == 2 and (gate is None or pending is None or slots is None or last_index is None):
        raise ValueError("compress_store: ratio 2 needs gate, pending, slots and last_index")
    if ratio == 1 and gate is not None:
        raise ValueError("compress_store: ratio 1 has no gate")
    if (len(entries) == 1) != (storage == FLOAT):
        raise ValueError(f"compress_store: storage {storage!r} does not match a pool of {len(entries)} arrays")


@register(OP, REFERENCE, why="plain jnp: the engine step's pooling, RMSNorm, RoPE, FP4 encode and page scatter")
def compress_store(kv: jax.Array, gate: jax.Array | None, positions: jax.Array, valid: jax.Array,
                   page_table: jax.Array, entries: tuple[jax.Array, ...], index_keys: tuple[jax.Array, ...],
                   pending: jax.Array | None = None, slots: jax.Array | None = None,
                   last_index: jax.Array | None = None, *, ratio: int, norm: jax.Array, wk, k_norm: jax.Array,
                   inv_freq: np.ndarray, eps: float, dtype, storage: str,
                   fake_quant: bool) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array | None]:
    """Compress a chunk and write its entries and indexer keys into the pools.

    kv `[B, T, D]` (fp32 for ratio 2, the compute dtype for ratio 1) and gate `[B, T, D]` fp32
    (ratio 2; None for ratio 1) are the compressor projections of the chunk; positions int32
    `[B, T]` (-1 = padding), valid bool `[B, T]` (tokens allowed to emit), page_table int32
    `[B, n_pages]`. Pools: `entries` / `index_keys` are the source's pool arrays, each
    `[P, per_page, ...]` (PACKED: codes uint8 + scales; FLOAT: one array of rows). Ratio 2 also
    takes the source's pending state `[S, 2, D]` fp32 with the rows' `slots [B]` and the index
    of each row's last valid token `last_index [B]`. `norm [D]` is the compressor's norm, `wk`
    `[Dk, D]` (dense or QuantWeight) and `k_norm [Dk]` the indexer's key projection and norm,
    `inv_freq` the compressed-RoPE inverse frequencies; `dtype` the compute dtype.

    Returns the updated (entries, index_keys, pending); pending is None for ratio 1."""
    check_args(kv, gate, pending, slots, last_index, entries, ratio, storage)
    emit, entry_idx, entry_pos = entry_targets(positions, valid, ratio)
    if ratio == 1:
        latent = rms_norm(kv, norm, eps)
    else:
        held = pending[slots]  # [B, 2, D]
        prev_kv = jnp.concatenate([held[:, None, 0], kv[:, :-1]], axis=1)
        prev_gate = jnp.concatenate([held[:, None, 1], gate[:, :-1]], axis=1)
        pair_kv = jnp.stack([prev_kv, kv], axis=2)
        weights = jax.nn.softmax(jnp.stack([prev_gate, gate], axis=2), axis=2)
        latent = rms_norm(jnp.sum(pair_kv * weights, axis=2).astype(dtype), norm, eps)
        pending = next_pending(kv, gate, held, pending, slots, positions, last_index)
    rows = apply_rope(latent, entry_pos, inv_freq)
    keys = apply_rope(rms_norm(linear(latent, wk), k_norm, eps), entry_pos, inv_freq)
    if storage == FLOAT and fake_quant:  # store exactly what the attention uses
        rows = quant.fake_quant_fp4(rows, block=quant.KV_FP4_BLOCK, e4m3_scales=True)
        keys = quant.fake_quant_fp4(keys, block=quant.INDEX_FP4_BLOCK, e4m3_scales=False)
    page, offset = page_slots(page_table, entry_idx, emit, entries[0].shape[1], entries[0].shape[0])
    entries = _write_rows(entries, encode("entry", rows, storage), page, offset)
    index_keys = _write_rows(index_keys, encode("index", keys, storage), page, offset)
    return entries, index_keys, pending
