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


def make_layout(config: ModelConfig, budget: CacheBudget, storage: str | None = None) -> CacheLayout:
    storage = storage or (PACKED if config.fake_quant else "float")
    max_pages = math.ceil(budget.max_model_len / budget.page_size)
    probe = CacheLayout(budget.num_slots, budget.page_size, 1, max_pages, storage)
    if budget.memory_bytes is not None:
        free = budget.memory_bytes - budget.num_slots * slot_bytes(config, probe)
        per_page = bytes_per_token(config, probe) * budget.page_size
        num_pages = int(free // per_page)
        if num_pages < 1:
            raise AdmissionError(f"memory budget {budget.memory_bytes} B holds no page after {budget.num_slots} slots")
    else:
        num_pages = budget.num_pages or budget.num_slots * max_pages
    return CacheLayout(budget.num_slots, budget.page_size, num_pages, max_pages, storage)


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


class CacheManager:
    """Slots and page tables of the running sequences."""

    def __init__(self, config: ModelConfig, layout: CacheLayout):
        self.config = config
        self.layout = layout
        self.pages = PageAllocator(layout.num_pages)
        self._free_slots = list(range(layout.num_slots - 1, -1, -1))
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
        return len(self._free_slots)

    def usage(self) -> float:
        return 1.0 - self.pages.free / self.layout.num_pages

    def pages_for(self, length: int) -> int:
        return math.ceil(length / self.layout.page_size)

    def check_admissible(self, prompt_len: int, max_len: int) -> None:
        """Raise if the prompt can never run, whatever else is in the cache."""
        if prompt_len < 1:
            raise AdmissionError("prompt is empty")
        if prompt_len > self.layout.max_len or prompt_len >= max_len:
            raise AdmissionError(
                f"prompt of {prompt_len} tokens does not fit the context ({min(self.layout.max_len, max_len)} tokens)"
            )
        if self.pages_for(prompt_len) > self.layout.num_pages:
            raise AdmissionError(f"prompt of {prompt_len} tokens needs more pages than the whole cache holds")

    # -- ownership --
    def can_allocate(self, length: int, slot: int | None = None) -> bool:
        have = len(self._owned.get(slot, [])) if slot is not None else 0
        need = self.pages_for(length) - have
        return (slot is not None or self._free_slots) and need <= self.pages.free

    def acquire_slot(self) -> int:
        if not self._free_slots:
            raise MemoryError("no free cache slot")
        slot = self._free_slots.pop()
        self._owned[slot] = []
        return slot

    def ensure(self, slot: int, length: int) -> None:
        """Own enough pages for `length` tokens (raises MemoryError if the pool is short)."""
        owned = self._owned[slot]
        need = self.pages_for(length) - len(owned)
        if need > 0:
            if len(owned) + need > self.layout.max_pages_per_slot:
                raise AdmissionError(f"sequence of {length} tokens exceeds max_model_len {self.layout.max_len}")
            new = self.pages.alloc(need)
            self.page_table[slot, len(owned):len(owned) + need] = new
            owned.extend(new)

    def release(self, slot: int) -> None:
        self.pages.release(self._owned.pop(slot))
        self.page_table[slot] = -1
        self._free_slots.append(slot)

    def owned_pages(self, slot: int) -> int:
        return len(self._owned.get(slot, []))
