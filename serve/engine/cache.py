"""Host-side cache management: slots, pages, admission and memory accounting.

The device cache (`deepinfer.model.kv_cache.KVCache`) has a fixed number of slots (each holds a
sequence's bounded state: window rings, pending compressor token) and a pool of pages (each
holds `page_size` tokens of global compressed KV for every source). This module decides which
sequence owns which slot and pages; the device arrays are only touched by the jitted steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.model.kv_cache import PACKED, CacheLayout, bytes_per_token, slot_bytes


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
    """A free list of physical pages."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} pages requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class RankedPages:
    """One page allocator per data-parallel rank (page ids are local to the rank)."""

    def __init__(self, num_pages: int, dp: int):
        self.ranks = [PageAllocator(num_pages // dp) for _ in range(dp)]

    @property
    def free(self) -> int:
        return sum(a.free for a in self.ranks)


class CacheManager:
    """Slots and page tables of the running sequences. Slot ids are global and rank-major
    (rank = slot // slots_per_rank); a slot's pages come from its rank's share."""

    def __init__(self, config: ModelConfig, layout: CacheLayout):
        self.config = config
        self.layout = layout
        self.pages = RankedPages(layout.num_pages, layout.dp)
        per_rank = layout.slots_per_rank
        self._free_slots = [list(range((r + 1) * per_rank - 1, r * per_rank - 1, -1)) for r in range(layout.dp)]
        self.page_table = np.full((layout.num_slots, layout.max_pages_per_slot), -1, np.int32)
        self._owned: dict[int, list[int]] = {}

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

    def acquire_slot(self, length: int = 0) -> int:
        """A free slot on the best rank for a sequence whose first `length` tokens must fit."""
        rank = self._best_rank(length)
        if rank is None:
            raise MemoryError("no free cache slot")
        slot = self._free_slots[rank].pop()
        self._owned[slot] = []
        return slot

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
        self.page_table[slot] = -1
        self._free_slots[self.rank_of(slot)].append(slot)

    def owned_pages(self, slot: int) -> int:
        return len(self._owned.get(slot, []))
