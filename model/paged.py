"""One KV source's paged pool as an engine step reads it: every page, or only chosen entries.

A source's compressed entries and indexer keys live in pages shared by all sequences
(`model.kv_cache`); a row of the step reaches its own through its page table. Reading costs
what is read: the indexer must score every visible key, which it reads a chunk of pages at a
time (`read_keys`), but the attention needs only the top-k entries its index source selected
and a Reindex layer only the keys of its candidate pool (`entries_at`, `keys_at`), so a decode
step gathers and dequantizes O(k) entries per source, not the sequence's whole context.
`all_keys` / `all_entries` read everything at once (long prefill chunks, and the reference path
the tests compare against). The packed codecs decode row by row, so a row read alone equals the
same row read with its page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deepinfer.model.kv_cache import decode


def gather_pages(pool: tuple[jax.Array, ...], page_table: jax.Array) -> tuple[jax.Array, ...]:
    """A sequence's rows in logical order: `[B, n_pages * per_page, ...]` (a missing page, -1,
    reads page 0: those rows lie past the sequence and are never visible)."""
    table = jnp.maximum(page_table, 0)
    out = []
    for array in pool:
        rows = array[table]  # [B, n_pages, per_page, ...]
        out.append(rows.reshape(rows.shape[0], -1, *rows.shape[3:]))
    return tuple(out)


def gather_rows(pool: tuple[jax.Array, ...], page_table: jax.Array, index: jax.Array) -> tuple[jax.Array, ...]:
    """Rows at logical entry `index [B, N]` (-1 or past the table: some row of the pool; callers
    mask those) -> each pool array's `[B, N, ...]`."""
    per_page = pool[0].shape[1]
    index = jnp.maximum(index, 0)
    logical = jnp.minimum(index // per_page, page_table.shape[1] - 1)
    page = jnp.maximum(jnp.take_along_axis(page_table, logical, axis=1), 0)
    return tuple(array[page, index % per_page] for array in pool)


class PagedSource:
    """A KV source's pools after this step's writes, read through the rows' `page_table`
    `[B, n_pages]`; rows decode to `dtype`. Whole-context reads are made once per step."""

    def __init__(self, entries: tuple[jax.Array, ...], keys: tuple[jax.Array, ...], page_table: jax.Array, dtype):
        self.entries, self.keys, self.page_table, self.dtype = entries, keys, page_table, dtype

    @property
    def n_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def per_page(self) -> int:
        return self.entries[0].shape[1]

    @property
    def capacity(self) -> int:
        """Entries addressed by the page table (the width of a whole-context read)."""
        return self.n_pages * self.per_page

    def read_keys(self, first, count: int) -> jax.Array:
        """The indexer keys of logical pages `first .. first + count - 1` (`first` may be traced)
        `[B, count * per_page, index_head_dim]`: what `index_topk_paged` reads a chunk at a time."""
        table = jax.lax.dynamic_slice_in_dim(self.page_table, first, count, axis=1)
        return decode("index", gather_pages(self.keys, table), self.dtype)

    @functools.cached_property
    def all_keys(self) -> jax.Array:
        """Every indexer key of each row's pages `[B, capacity, index_head_dim]`."""
        return decode("index", gather_pages(self.keys, self.page_table), self.dtype)

    @functools.cached_property
    def all_entries(self) -> jax.Array:
        """Every compressed entry of each row's pages `[B, capacity, head_dim]`."""
        return decode("entry", gather_pages(self.entries, self.page_table), self.dtype)

    def keys_at(self, index: jax.Array) -> jax.Array:
        """Indexer keys at logical entries `index [B, N]` -> `[B, N, index_head_dim]`."""
        return decode("index", gather_rows(self.keys, self.page_table, index), self.dtype)

    def entries_at(self, index: jax.Array) -> jax.Array:
        """Compressed entries at logical entries `index [B, N]` -> `[B, N, head_dim]`."""
        return decode("entry", gather_rows(self.entries, self.page_table, index), self.dtype)
