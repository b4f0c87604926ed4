"""Whole cache pages between the device pools and the host: what the prefix cache's host and
disk tiers move (`cache.CacheManager.connect`, `page_store.py`).

Page ids are a dp rank's own; the pools are rank-major, so rank r's page p is row
`r * pages_per_rank + p`. A copy is padded to a power of two of pages (one program per size
class). On a mesh a write keeps the cache's shardings: the mesh step's programs are compiled for
them, and a cache laid out otherwise would not be accepted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.kv_cache import KVCache
from deepinfer.serve.engine.page_store import EvictedPages

__all__ = ["PageIO"]


@jax.jit
def _gather_pages(cache: KVCache, pages: jax.Array) -> list[jax.Array]:
    return [a[pages] for a in jax.tree.leaves((cache.entries, cache.index_keys))]


def _scatter_pages_body(cache: KVCache, pages: jax.Array, rows: list[jax.Array]) -> KVCache:
    pools, tree = jax.tree.flatten((cache.entries, cache.index_keys))
    entries, keys = jax.tree.unflatten(tree, [a.at[pages].set(r, mode="drop") for a, r in zip(pools, rows)])
    return dataclasses.replace(cache, entries=entries, index_keys=keys)


_scatter_pages = jax.jit(_scatter_pages_body, donate_argnums=0)


def _page_bucket(n: int) -> int:
    return max(8, 1 << (n - 1).bit_length())


class PageIO:
    """Reads and writes pages of `runner`'s cache (`ModelRunner.cache`, replaced on a write)."""

    def __init__(self, runner):
        self.runner = runner
        self._scatter_on_mesh = None  # the write on a mesh (made at first use)

    def read_pages(self, pages: list[int], rank: int = 0) -> EvictedPages:
        """The bytes of dp rank `rank`'s `pages` (every source's entries and indexer keys), copied
        to the host asynchronously: row i of each array is page i."""
        index = np.zeros(_page_bucket(len(pages)), np.int32)
        index[:len(pages)] = self._global_pages(pages, rank)
        return EvictedPages(_gather_pages(self.runner.cache, jnp.asarray(index)))

    def write_pages(self, pages: list[int], rows: list[list[np.ndarray]], rank: int = 0) -> None:
        """Write pages read back from the host (`rows[i]`: page i's arrays, as `read_pages` gave
        them) into dp rank `rank`'s `pages`, before any later step reads them."""
        runner = self.runner
        n = _page_bucket(len(pages))
        index = np.full(n, runner.layout.num_pages, np.int32)  # padding: dropped
        index[:len(pages)] = self._global_pages(pages, rank)
        stacked = []
        for j, like in enumerate(jax.tree.leaves((runner.cache.entries, runner.cache.index_keys))):
            block = np.zeros((n, *like.shape[1:]), like.dtype)
            block[:len(pages)] = [r[j] for r in rows]
            stacked.append(block)
        if runner.mesh_step is None:
            runner.cache = _scatter_pages(runner.cache, jnp.asarray(index), stacked)
            return
        if self._scatter_on_mesh is None:
            shardings = jax.tree.map(lambda a: a.sharding, runner.cache)
            self._scatter_on_mesh = jax.jit(_scatter_pages_body, donate_argnums=0, out_shardings=shardings)
        runner.cache = self._scatter_on_mesh(runner.cache, runner.mesh_step.replicate(index),
                                             runner.mesh_step.replicate(stacked))

    def _global_pages(self, pages: list[int], rank: int) -> np.ndarray:
        layout = self.runner.layout
        return np.asarray(pages, np.int32) + rank * (layout.num_pages // layout.dp)
