"""Prefix cache: full pages of global KV shared between sequences by their tokens.

What a page holds (model-v4.1-flash.md §3, DESIGN.md §4): `page_size` tokens of every KV source's
compressed entries and indexer keys, a function of the tokens up to the page's end only. So a
page is named by a chain hash of its tokens and of every token before it (and of what changes
the bytes: the model and the cache layout, `salt`), and a sequence whose first pages hash the
same reuses them. What is per sequence (the window rings, the ratio-2 pending token, the Engram
look-back) is not cached: on a hit the engine rebuilds it by *replay*, recomputing the tokens
from a replay start below the hit (engine-features.md §6):

- "bounded" (V4.1's encoder-side bounded replay): the hit's last `sliding_window` tokens, so the
  window rings hold what a cold run's would, but computed from a window that starts empty; outputs
  differ from a cold run's, by how much depends on the weights: on the trained tiny model a mean
  KL of 8.7e-5 nats (README), on the random-weight tiny-v4.1-short log-probabilities up to 0.42
  apart (a 460-token prompt hitting 384 tokens; its first token changed where the cold run's top
  two were 0.056 apart: tests/sharding/test_engine_mesh.py);
- "exact": the whole dependency halo of the window chain, `window + (layers - 1) * (window - 1)`
  tokens, after which every value equals a cold run's up to the rounding of another chunking.

Pages are only shared whole and never written by a sharer (the step's `write_floor`). A page no
sequence holds stays cached until it is needed for another or its time to live runs out
(`ttl_seconds` of its class, counted from its last use on the injectable `clock`): under memory
pressure the page whose TTL ends first goes first, which is LRU within a class.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

REPLAY_MODES = ("bounded", "exact")
DAY = 86400.0
# DeepSeek's service keeps chat prefixes 7 days and agent prefixes 3 days; "none": not kept
DEFAULT_TTL_SECONDS = (("chat", 7 * DAY), ("agent", 3 * DAY), ("none", 0.0))


@dataclass(frozen=True)
class PrefixCacheConfig:
    """How the engine shares prompt pages (`EngineConfig.prefix_cache`; None: no sharing)."""

    replay: str = "bounded"
    # the class of a request that names none (`SamplingParams.cache_ttl_class`)
    default_ttl_class: str = "chat"
    ttl_seconds: tuple[tuple[str, float], ...] = DEFAULT_TTL_SECONDS
    clock: Callable[[], float] = field(default=time.time, compare=False)
    # tiers below the device (`page_store.py`): pages evicted from the device go to host memory
    # (at most `host_pages` of them) and, with `disk_dir`, to files there (at most `disk_max_bytes`
    # of them, least recently used deleted first; None: no limit); on one device or
    # a mesh of one process's devices (each dp rank evicts its own pages; any rank restores them)
    host_pages: int = 0
    disk_dir: str | None = None
    disk_max_bytes: int | None = None

    def __post_init__(self):
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"prefix_cache.replay must be one of {REPLAY_MODES}, got {self.replay!r}")
        if not isinstance(self.host_pages, int) or self.host_pages < 0:
            raise ValueError(f"prefix_cache.host_pages must be a non-negative int, got {self.host_pages!r}")
        if self.disk_max_bytes is not None and (isinstance(self.disk_max_bytes, bool)
                                                or not isinstance(self.disk_max_bytes, int) or self.disk_max_bytes < 1):
            raise ValueError(f"prefix_cache.disk_max_bytes must be a positive int or None, got {self.disk_max_bytes!r}")
        bad = [(name, s) for name, s in self.ttl_seconds if not s >= 0]
        if bad:
            raise ValueError(f"prefix_cache.ttl_seconds: {bad[0][0]!r} has a negative or NaN TTL ({bad[0][1]})")
        self.ttl(self.default_ttl_class)

    def ttl(self, ttl_class: str) -> float:
        """Seconds a released page of `ttl_class` stays cached; ValueError naming an unknown class."""
        for name, seconds in self.ttl_seconds:
            if name == ttl_class:
                return seconds
        raise ValueError(f"cache_ttl_class: must be one of {[n for n, _ in self.ttl_seconds]}, got {ttl_class!r}")

    def replay_tokens(self, sliding_window: int, num_layers: int) -> int:
        """Tokens recomputed below a hit to rebuild the per-sequence state."""
        if self.replay == "bounded":
            return sliding_window
        return sliding_window + (num_layers - 1) * (sliding_window - 1)


def replay_start(hit_tokens: int, replay_tokens: int, granule: int) -> int:
    """Where a sequence with `hit_tokens` cached starts computing: `replay_tokens` below the hit,
    down to a multiple of `granule` (prefill chunks start there); 0 = the hit is not worth it."""
    return max(0, (hit_tokens - replay_tokens) // granule * granule)


def page_keys(tokens: np.ndarray, page_size: int, salt: bytes, parent: bytes = b"") -> list[bytes]:
    """Chain hashes of the full pages of `tokens` (which start at a page boundary whose chain
    hash is `parent`, b"" at position 0): key i names tokens [0, (i + 1) * page_size)."""
    keys = []
    tokens = np.asarray(tokens, np.int32)
    for i in range(len(tokens) // page_size):
        parent = hashlib.blake2b(parent + tokens[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16,
                                 key=salt).digest()
        keys.append(parent)
    return keys


@dataclass
class _Entry:
    key: bytes
    depth: int  # the page's place in its chain: among equal deadlines, deeper pages go first
    ttl: float
    last_used: float

    @property
    def deadline(self) -> float:
        return self.last_used + self.ttl


class PrefixIndex:
    """One data-parallel rank's published pages: key -> page, and the pages no sequence holds
    (evictable, by deadline). Reference counts are the allocator's (`cache.PageAllocator`)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.page_of: dict[bytes, int] = {}
        self.entry: dict[int, _Entry] = {}
        self.idle: set[int] = set()  # published pages with no holder

    def __len__(self) -> int:
        return len(self.page_of)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys` from the first that is cached and alive."""
        now, pages = self.clock(), []
        for key in keys:
            page = self.page_of.get(key)
            if page is None or (page in self.idle and self.entry[page].deadline <= now):
                break
            pages.append(page)
        return pages

    def publish(self, page: int, key: bytes, depth: int, ttl: float) -> bool:
        """Name a held page (the `depth`-th of its sequence) by `key`; False (the page stays
        private) if another page has it."""
        if key in self.page_of or page in self.entry:
            return False
        self.page_of[key] = page
        self.entry[page] = _Entry(key, depth, ttl, self.clock())
        return True

    def adopt(self, page: int, ttl: float) -> None:
        """A sequence takes `page`: it is no longer evictable, and keeps the longer TTL."""
        self.idle.discard(page)
        entry = self.entry[page]
        entry.ttl, entry.last_used = max(entry.ttl, ttl), self.clock()

    def park(self, page: int, now: float) -> bool:
        """The last holder let go of `page` at `now` (one time for all pages a sequence lets go
        of, so its chain's tail is evicted before its head): True if it stays cached
        (published, TTL > 0)."""
        entry = self.entry.get(page)
        if entry is None:
            return False
        if entry.ttl <= 0:
            self.drop(page)
            return False
        entry.last_used = now
        self.idle.add(page)
        return True

    def drop(self, page: int) -> None:
        entry = self.entry.pop(page)
        del self.page_of[entry.key]
        self.idle.discard(page)

    def expired(self) -> list[int]:
        now = self.clock()
        return [p for p in self.idle if self.entry[p].deadline <= now]

    def evict(self, n: int) -> list[tuple[int, bytes, float]]:
        """Unpublish the `n` idle pages whose TTL ends first, a chain's tail before its head:
        (page, key, deadline) each (the caller frees the pages, and may keep their bytes)."""
        if n > len(self.idle):
            raise MemoryError(f"{n} pages to evict, {len(self.idle)} evictable")
        pages = heapq.nsmallest(n, self.idle, key=lambda p: (self.entry[p].deadline, -self.entry[p].depth, p))
        evicted = [(page, self.entry[page].key, self.entry[page].deadline) for page in pages]
        for page in pages:
            self.drop(page)
        return evicted


def salt_of(*parts) -> bytes:
    """The hash key of an engine's pages: what besides the tokens decides their bytes."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


