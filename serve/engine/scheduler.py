"""Continuous batching: which requests get a slot, which prefill chunks and decodes run in the
next step, and who is preempted when the page pool runs short.

Policy: first come, first served. Every step may run one prefill step (up to `prefill_rows`
chunks per data-parallel rank of waiting or partly prefilled requests) and one decode step (every request that has a
token to feed and nothing else). Prefill chunks start at multiples of 128 (a chunk is a
multiple of 128 tokens except a prompt's last), so compression groups and candidate blocks
cross chunk boundaries only through the cache. When a decode needs a page and none is free, the
most recently admitted running request is preempted: its slot and pages are freed and it goes
back to the front of the queue, to be recomputed from its tokens (prompt + output so far).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from deepinfer.serve.engine.cache import CacheManager
from deepinfer.serve.engine.request import Request, Status


@dataclass
class PrefillPass:
    """Prefill chunks that run in one runner step: `decoder` False for chunks wholly below their
    sequence's replay floor (compact prefill: encoder only); `rows` per dp rank, a power of two."""

    decoder: bool
    chunks: list[tuple[Request, int]]
    rows: int


def prefill_passes(prefill: list[tuple[Request, int]], cache: CacheManager) -> list[PrefillPass]:
    """A plan's prefill chunks as the steps that run them: the encoder-only pass first. Split
    before either runs, since the encoder-only pass advances `computed`."""
    groups = {False: [], True: []}
    for r, n in prefill:
        groups[r.computed + n > r.floor].append((r, n))
    passes = []
    for decoder, chunks in groups.items():
        if chunks:
            per_rank = np.bincount([cache.rank_of(r.slot) for r, _ in chunks]).max()
            passes.append(PrefillPass(decoder, chunks, 1 << (int(per_rank) - 1).bit_length()))
    return passes


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, cache: CacheManager, *, prefill_chunk: int = 512, prefill_rows: int = 1):
        if prefill_chunk % 128:
            raise ValueError(f"prefill_chunk must be a multiple of 128, got {prefill_chunk}")
        self.cache = cache
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = prefill_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self.cache.release(request.slot)
            request.slot = None

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self.cache.release(request.slot)
            request.slot = None

    def _preempt(self, plan: StepPlan, keep: Request) -> bool:
        """Free the pages of `keep`'s data-parallel rank: only a sequence there can give them."""
        rank = self.cache.rank_of(keep.slot)
        victims = [r for r in self.running if r is not keep and self.cache.rank_of(r.slot) == rank]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.arrival_order)
        self.running.remove(victim)
        self.cache.release(victim.slot)
        victim.slot, victim.computed, victim.status = None, 0, Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        if victim in plan.decode:
            plan.decode.remove(victim)
        plan.preempted.append(victim)
        return True

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # decodes first: a running request that only needs its last sampled token fed
        for request in sorted(self.running, key=lambda r: r.arrival_order):
            if request.to_feed != 1 or request not in self.running:
                continue
            while not self.cache.can_allocate(request.length, request.slot):
                if not self._preempt(plan, keep=request):
                    break
            if self.cache.can_allocate(request.length, request.slot):
                self.cache.ensure(request.slot, request.length)
                plan.decode.append(request)
        # admit waiting requests while a slot and the pages of their first chunk are free
        while self.waiting and self.cache.free_slots:
            request = self.waiting[0]
            first = min(request.length, self.prefill_chunk)
            if not self.cache.can_allocate(first):
                break
            self.waiting.popleft()
            request.slot = self.cache.acquire_slot(first)
            request.status = Status.RUNNING
            self.running.append(request)
            plan.admitted.append(request)
        # prefill chunks of running requests that have more than one token to feed, at most
        # `prefill_rows` per data-parallel rank
        rows = [0] * self.cache.layout.dp
        for request in sorted(self.running, key=lambda r: r.arrival_order):
            rank = self.cache.rank_of(request.slot)
            if request.to_feed <= 1 or rows[rank] >= self.prefill_rows:
                continue
            chunk = min(request.to_feed, self.prefill_chunk)
            if not self.cache.can_allocate(request.computed + chunk, request.slot):
                continue
            self.cache.ensure(request.slot, request.computed + chunk)
            plan.prefill.append((request, chunk))
            rows[rank] += 1
        if not plan.prefill and not plan.decode:
            self._unblock_prefill(plan)
        return plan

    def _unblock_prefill(self, plan: StepPlan) -> None:
        """Nothing can run: every running request is mid-prefill and waits for pages the others
        hold. Preempt the newest ones until the oldest can take its next chunk."""
        for request in sorted(self.running, key=lambda r: r.arrival_order):
            if request.to_feed <= 1:
                continue
            chunk = min(request.to_feed, self.prefill_chunk)
            while not self.cache.can_allocate(request.computed + chunk, request.slot):
                if not self._preempt(plan, keep=request):
                    return
            self.cache.ensure(request.slot, request.computed + chunk)
            plan.prefill.append((request, chunk))
            return

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
