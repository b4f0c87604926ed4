"""Host-side cache management: slots, pages, admission and memory accounting.

The device cache (`deepinfer.model.kv_cache.KVCache`) has a fixed number of slots (each holds a
sequence's bounded state: window rings, pending compressor token) and a pool of pages (each
holds `page_size` tokens of global compressed KV for every source). This module decides which
sequence owns which slot and pages; the device arrays are only touched by the jitted steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.model.kv_cache import PACKED, CacheLayout, bytes_per_token, slot_bytes
from deepinfer.serve.engine.page_store import DiskPageStore, HostPageStore, Rows
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig, PrefixIndex, page_keys, salt_of


class AdmissionError(ValueError):
    """A request that can never fit (its prompt alone exceeds the cache or the context)."""


@dataclass(frozen=True)
class CacheBudget:
    """How big the cache is: either explicit page/slot counts or a memory budget in bytes."""

    num_slots: int = 8
    max_model_len: int = 4096
    page_size: int = 128
    num_pages: int | None = None  # default: enough for every slot at max_model_len
    memory_bytes: int | None = None  # if set, num_pages = what fits after the slots' bounded state


def make_layout(config: ModelConfig, budget: CacheBudget, storage: str | None = None, dp: int = 1,
                draft_rings: int = 0) -> CacheLayout:
    """The cache's static shape; with `dp` > 1 slots and pages split evenly over the ranks;
    `draft_rings`: window rings for the DSpark drafter's blocks (0 or all of them)."""
    storage = storage or (PACKED if config.fake_quant else "float")
    if budget.num_slots % dp:
        raise ValueError(f"max_num_seqs ({budget.num_slots}) must be a multiple of the data-parallel size dp={dp}")
    max_pages = math.ceil(budget.max_model_len / budget.page_size)
    probe = CacheLayout(budget.num_slots, budget.page_size, 1, max_pages, storage, draft_rings=draft_rings)
    if budget.memory_bytes is not None:
        free = budget.memory_bytes - budget.num_slots * slot_bytes(config, probe)
        per_page = bytes_per_token(config, probe) * budget.page_size
        num_pages = int(free // per_page) // dp * dp
        if num_pages < dp:
            raise AdmissionError(f"memory budget {budget.memory_bytes} B holds no page after {budget.num_slots} slots")
    else:
        num_pages = budget.num_pages or budget.num_slots * max_pages
        if num_pages % dp:
            raise ValueError(f"num_pages ({num_pages}) must be a multiple of the data-parallel size dp={dp}")
    return CacheLayout(budget.num_slots, budget.page_size, num_pages, max_pages, storage, dp, draft_rings)


class PageAllocator:
    """A rank's physical pages: a free list, how many sequences hold each page, and (with a
    prefix cache) the published pages that no sequence holds, which are free on demand."""

    def __init__(self, num_pages: int, index: PrefixIndex | None = None):
        self.num_pages = num_pages
        self.index = index
        self._free = list(range(num_pages - 1, -1, -1))
        self.refs: dict[int, int] = {}
        # keeps the bytes of evicted published pages (the host tier), given (page, key, deadline)
        self.offload: Callable[[list[tuple[int, bytes, float]]], None] | None = None

    @property
    def free(self) -> int:
        """Pages an allocation can have: free ones and cached ones no sequence holds."""
        return len(self._free) + (len(self.index.idle) if self.index is not None else 0)

    def alloc(self, n: int) -> list[int]:
        if n > self.free:
            raise MemoryError(f"{n} pages requested, {self.free} free")
        if n > len(self._free):
            evicted = self.index.evict(n - len(self._free))
            if self.offload is not None:
                self.offload(evicted)
            self._free.extend(page for page, _, _ in evicted)
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def hold(self, pages: list[int], ttl: float) -> None:
        """Another sequence shares these published pages."""
        for page in pages:
            self.refs[page] = self.refs.get(page, 0) + 1
            self.index.adopt(page, ttl)

    def release(self, pages: list[int]) -> None:
        """A sequence lets go of its pages: those nobody holds go back to the free list unless
        they stay cached."""
        freed = []
        now = None if self.index is None else self.index.clock()
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                if self.index is None or not self.index.park(page, now):
                    freed.append(page)
        self._free.extend(reversed(freed))

    def expire(self) -> int:
        """Free the cached pages whose TTL ran out; returns how many."""
        if self.index is None:
            return 0
        pages = self.index.expired()
        for page in pages:
            self.index.drop(page)
        self._free.extend(pages)
        return len(pages)


class RankedPages:
    """One page allocator per data-parallel rank (page ids are local to the rank)."""

    def __init__(self, num_pages: int, dp: int, clock=None):
        self.ranks = [PageAllocator(num_pages // dp, None if clock is None else PrefixIndex(clock))
                      for _ in range(dp)]

    @property
    def free(self) -> int:
        return sum(a.free for a in self.ranks)

    @property
    def cached(self) -> int:
        """Published pages (held or idle) over every rank."""
        return sum(len(a.index) for a in self.ranks if a.index is not None)


@dataclass
class PrefixHit:
    """Cached pages that start a sequence: on `rank`, naming its first `len(pages)` pages."""

    rank: int
    pages: list[int]
    last_key: bytes  # chain hash of the last page: the sequence's next pages chain from it


@dataclass
class PrefixLookup:
    keys: list[bytes]  # chain hashes of the sequence's full pages
    hit: PrefixHit | None
    waits: bool  # a running sequence is computing the page after the hit
    # the pages after the device's hit found in the host or disk tier: (key, rows, tier)
    restore: list[tuple[bytes, Rows, str]] = field(default_factory=list)

    @property
    def pages(self) -> int:
        """Cached pages in all tiers."""
        return (0 if self.hit is None else len(self.hit.pages)) + len(self.restore)


class CacheManager:
    """Slots and page tables of the running sequences. Slot ids are global and rank-major
    (rank = slot // slots_per_rank); a slot's pages come from its rank's share. With a prefix
    cache (`prefix_cache.py`) a sequence may start with published pages it shares, and its own
    full pages are published as they are computed (`publish`)."""

    def __init__(self, config: ModelConfig, layout: CacheLayout, prefix: PrefixCacheConfig | None = None,
                 weights: bytes = b""):
        """`weights`: a fingerprint of the params (`page_store.params_fingerprint`), part of
        every page's key where pages outlive the process (the disk tier)."""
        self.config = config
        self.layout = layout
        self.prefix = prefix
        self.pages = RankedPages(layout.num_pages, layout.dp, None if prefix is None else prefix.clock)
        per_rank = layout.slots_per_rank
        self._free_slots = [list(range((r + 1) * per_rank - 1, r * per_rank - 1, -1)) for r in range(layout.dp)]
        self.page_table = np.full((layout.num_slots, layout.max_pages_per_slot), -1, np.int32)
        self._owned: dict[int, list[int]] = {}
        # prefix cache: what besides the tokens decides a page's bytes; per slot the TTL its
        # pages get (0: it publishes none) and (pages published, last chain hash)
        self._salt = b"" if prefix is None else salt_of(config, layout.page_size, layout.storage, prefix.replay,
                                                         weights)
        self._ttl: dict[int, float] = {}
        self._chain: dict[int, tuple[int, bytes]] = {}
        self._claims: dict[bytes, int] = {}  # pages running sequences will publish -> slot
        self.store: HostPageStore | None = None  # the tiers below the device (`connect`)
        self._page_io = None

    # -- accounting --
    @property
    def bytes_per_token(self) -> float:
        return bytes_per_token(self.config, self.layout)

    def tokens_that_fit(self) -> int:
        return self.layout.num_pages * self.layout.page_size

    @property
    def free_slots(self) -> int:
        return sum(len(f) for f in self._free_slots)

    def usage(self) -> float:
        return 1.0 - self.pages.free / self.layout.num_pages

    def pages_for(self, length: int) -> int:
        return math.ceil(length / self.layout.page_size)

    def rank_of(self, slot: int) -> int:
        return slot // self.layout.slots_per_rank

    def check_admissible(self, prompt_len: int, max_len: int) -> None:
        """Raise if the prompt can never run, whatever else is in the cache."""
        if prompt_len < 1:
            raise AdmissionError("prompt is empty")
        if prompt_len > self.layout.max_len or prompt_len >= max_len:
            raise AdmissionError(
                f"prompt of {prompt_len} tokens does not fit the context ({min(self.layout.max_len, max_len)} tokens)"
            )
        if self.pages_for(prompt_len) > self.layout.pages_per_rank:
            where = "the whole cache" if self.layout.dp == 1 else "a data-parallel rank's share of the cache"
            raise AdmissionError(f"prompt of {prompt_len} tokens needs more pages than {where} holds")

    # -- ownership --
    def _best_rank(self, length: int) -> int | None:
        """Where a new sequence goes: a rank with a free slot and room for `length` tokens, the
        one with the most free pages, then the fewest running sequences."""
        need = self.pages_for(length)
        fits = [r for r in range(self.layout.dp) if self._free_slots[r] and self.pages.ranks[r].free >= need]
        if not fits:
            return None
        return max(fits, key=lambda r: (self.pages.ranks[r].free, len(self._free_slots[r]), -r))

    def can_allocate(self, length: int, slot: int | None = None) -> bool:
        if slot is None:
            return self._best_rank(length) is not None
        need = self.pages_for(length) - len(self._owned.get(slot, []))
        return need <= self.pages.ranks[self.rank_of(slot)].free

    def acquire_slot(self, length: int = 0, hit: PrefixHit | None = None, ttl: float = 0.0,
                     restore: list[tuple[bytes, Rows, str]] = ()) -> int:
        """A free slot for a sequence whose first `length` tokens must fit: on the best rank, or
        on the hit's, holding its pages, then `restore`'s pages written back from the host or
        disk tier. The sequence's own full pages get `ttl` when published."""
        if hit is None:  # (restored pages come from the host: any rank takes them)
            rank = self._best_rank(max(length, len(restore) * self.layout.page_size))
        else:
            rank = hit.rank
        if rank is None or not self._free_slots[rank]:
            raise MemoryError("no free cache slot")
        slot = self._free_slots[rank].pop()
        self._owned[slot] = []
        self._ttl[slot], self._chain[slot] = ttl, (0, b"")
        if hit is not None:
            self.pages.ranks[rank].hold(hit.pages, ttl)
            self._owned[slot] = list(hit.pages)
            self.page_table[slot, :len(hit.pages)] = hit.pages
            self._chain[slot] = (len(hit.pages), hit.last_key)
        if restore:
            self._restore(slot, restore, ttl)
        return slot

    # -- prefix cache --
    def connect(self, page_io) -> None:
        """Keep evicted pages in the host (and disk) tier of the prefix config, read and written
        through `page_io` (`page_io.PageIO`)."""
        if self.prefix is None or not (self.prefix.host_pages or self.prefix.disk_dir):
            return
        disk = None if self.prefix.disk_dir is None else DiskPageStore(self.prefix.disk_dir,
                                                                       self.prefix.disk_max_bytes)
        self.store = HostPageStore(self.prefix.host_pages, self.prefix.clock, disk)
        self._page_io = page_io
        if self.prefix.host_pages:
            for rank, allocator in enumerate(self.pages.ranks):
                allocator.offload = partial(self._offload, rank)

    def flush_disk(self, block: bool = False) -> None:
        """Write the published pages whose bytes reached the host to the disk tier (all, blocking)."""
        if self.store is not None and self.store.disk is not None:
            self.store.disk.flush(block)

    def _offload(self, rank: int, evicted: list[tuple[int, bytes, float]]) -> None:
        batch = self._page_io.read_pages([page for page, _, _ in evicted], rank)
        for i, (_, key, deadline) in enumerate(evicted):
            self.store.put(key, batch, i, deadline)

    def _restore(self, slot: int, restore: list[tuple[bytes, Rows, str]], ttl: float) -> None:
        """Pages of the host or disk tier become the slot's next pages, published again."""
        rank = self.rank_of(slot)
        allocator = self.pages.ranks[rank]
        pages = allocator.alloc(len(restore))
        self._page_io.write_pages(pages, [rows for _, rows, _ in restore], rank)
        done = len(self._owned[slot])
        for depth, (page, (key, _, _)) in enumerate(zip(pages, restore), start=done):
            allocator.index.publish(page, key, depth, ttl)
            self.store.discard(key)
        self.page_table[slot, done:done + len(pages)] = pages
        self._owned[slot].extend(pages)
        self._chain[slot] = (done + len(pages), restore[-1][0])

    def find_prefix(self, tokens: np.ndarray) -> PrefixLookup:
        """The longest run of cached pages that starts `tokens` (full pages only) on a rank with
        a free slot, continued in the host and disk tiers, and whether a running sequence is
        computing the page after it."""
        keys = page_keys(tokens, self.layout.page_size, self._salt)
        best = None
        for rank, allocator in enumerate(self.pages.ranks):
            allocator.expire()
            pages = allocator.index.match(keys) if self._free_slots[rank] else []
            if pages and (best is None or len(pages) > len(best.pages)):
                best = PrefixHit(rank, pages, keys[len(pages) - 1])
        n = 0 if best is None else len(best.pages)
        restore = []
        # (the restored pages follow a device hit on its rank, else go to any rank with a slot)
        if self.store is not None and (best is not None or self.free_slots):
            for key in keys[n:]:
                found = self.store.get(key)
                if found is None:
                    break
                restore.append((key, *found))
        n += len(restore)
        return PrefixLookup(keys, best, n < len(keys) and keys[n] in self._claims, restore)

    def claim(self, slot: int, keys: list[bytes]) -> None:
        """`slot` will compute (and publish) the pages named `keys`: others that need them wait."""
        if self._ttl.get(slot, 0.0) > 0:
            for key in keys:
                self._claims.setdefault(key, slot)

    def _unclaim(self, slot: int, keys=None) -> None:
        for key in list(self._claims) if keys is None else keys:
            if self._claims.get(key) == slot:
                del self._claims[key]

    def can_admit(self, length: int, hit: PrefixHit) -> bool:
        """A slot on the hit's rank and the pages `length` tokens need beyond the hit's (whose
        idle pages stop being free once held)."""
        allocator = self.pages.ranks[hit.rank]
        idle = sum(1 for p in hit.pages if p in allocator.index.idle)
        need = self.pages_for(length) - len(hit.pages)
        return bool(self._free_slots[hit.rank]) and need <= allocator.free - idle

    def publish(self, slot: int, upto: int, ids) -> None:
        """Publish the slot's full pages below token `upto` (computed, and known to the host:
        no placeholder of a step in flight), whose ids `ids(start, end)` returns. A page whose
        tokens another page already holds stays private to the slot."""
        if self._ttl.get(slot, 0.0) <= 0:
            return
        done, parent = self._chain[slot]
        full = min(upto // self.layout.page_size, len(self._owned[slot]))
        if full <= done:
            return
        size = self.layout.page_size
        keys = page_keys(ids(done * size, full * size), size, self._salt, parent)
        index = self.pages.ranks[self.rank_of(slot)].index
        published = [(page, key) for depth, (page, key) in enumerate(zip(self._owned[slot][done:full], keys),
                                                                     start=done)
                     if index.publish(page, key, depth, self._ttl[slot])]
        if published and self.store is not None and self.store.disk is not None:
            batch = self._page_io.read_pages([page for page, _ in published], self.rank_of(slot))
            deadline = self.prefix.clock() + self._ttl[slot]
            for i, (_, key) in enumerate(published):
                self.store.disk.queue(key, batch, i, deadline)
        self._chain[slot] = (full, keys[-1])
        self._unclaim(slot, keys)

    def ensure(self, slot: int, length: int) -> None:
        """Own enough pages for `length` tokens (raises MemoryError if the pool is short)."""
        owned = self._owned[slot]
        need = self.pages_for(length) - len(owned)
        if need > 0:
            if len(owned) + need > self.layout.max_pages_per_slot:
                raise AdmissionError(f"sequence of {length} tokens exceeds max_model_len {self.layout.max_len}")
            new = self.pages.ranks[self.rank_of(slot)].alloc(need)
            self.page_table[slot, len(owned):len(owned) + need] = new
            owned.extend(new)

    def release(self, slot: int) -> None:
        self.pages.ranks[self.rank_of(slot)].release(self._owned.pop(slot))
        if self._ttl.pop(slot, 0.0) > 0:
            self._unclaim(slot)
        self._chain.pop(slot, None)
        self.page_table[slot] = -1
        self._free_slots[self.rank_of(slot)].append(slot)

    def owned_pages(self, slot: int) -> int:
        return len(self._owned.get(slot, []))
