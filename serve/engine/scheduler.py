"""Continuous batching: which requests get a slot, which prefill chunks and decodes run in the
next step, and who is preempted when the page pool runs short.

Policy: first come, first served. Every step runs the decode of every request that has one token
to feed, and prefill chunks of several waiting or partly prefilled requests under a token budget
per data-parallel rank (vLLM's `max_num_batched_tokens`): the decode tokens plus the chunks'
tokens never exceed it, and neither do the prefill step's padded rows x tokens
(`Scheduler._fit_chunk`), so a burst of short prompts is admitted in a few steps while the set of
compiled step shapes stays bounded (rows and tokens are powers of two: `runner.row_bucket`,
`runner.token_bucket`; several rows only of GRANULE-token chunks). Prefill chunks start at
multiples of GRANULE (a chunk is a multiple of it except a prompt's last), so compression groups
and candidate blocks cross chunk boundaries only through the cache. When a decode needs a page
and none is free, the most recently admitted running request is preempted: its slot and pages
are freed and it goes back to the front of the queue, to be recomputed from its tokens (prompt +
output so far).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from deepinfer.serve.engine.cache import CacheManager
from deepinfer.serve.engine.prefix_cache import replay_start
from deepinfer.serve.engine.request import Request, Status
from deepinfer.serve.engine.runner import row_bucket, token_bucket

GRANULE = 128  # a prefill chunk that is not a prompt's last is a multiple of this
# the longest chunk of a step of several prefill rows: one row takes up to `prefill_chunk` tokens,
# several rows share the budget in GRANULE-token chunks. The tokens per step are the same, but the
# step shapes are (rows, GRANULE) and (1, tokens) only: every shape is a program to compile and
# keep (on XLA's CPU backend, ~600-900 memory maps each: `programs.py`)
MULTI_ROW_TOKENS = GRANULE


@dataclass
class PrefillPass:
    """Prefill chunks that run in one runner step: `decoder` False for chunks wholly below their
    sequence's replay floor (compact prefill: encoder only); `rows` per dp rank (`row_bucket`)."""

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
            passes.append(PrefillPass(decoder, chunks, row_bucket(int(per_rank), cache.layout.slots_per_rank)))
    return passes


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, cache: CacheManager, *, prefill_chunk: int = 512, max_num_batched_tokens: int = 2048,
                 lookahead: Callable[[Request], int] = lambda request: 0, replay_tokens: int = 0):
        """`lookahead(request)`: the drafts a decoding request's next step would verify
        (speculative decoding), whose pages it reserves besides the anchor's; `replay_tokens`:
        tokens recomputed below a prefix-cache hit (`PrefixCacheConfig.replay_tokens`)."""
        if prefill_chunk % GRANULE:
            raise ValueError(f"prefill_chunk must be a multiple of {GRANULE}, got {prefill_chunk}")
        check_token_budget(max_num_batched_tokens, cache.layout.slots_per_rank)
        self.cache = cache
        self.prefill_chunk = prefill_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.replay_tokens = replay_tokens
        # vLLM's prefix-cache counters, in tokens: prompts looked up, and found cached
        # (all tiers; `hits_host` / `hits_disk`: of them, brought back from the host or disk tier)
        self.prefix_stats = {"queries": 0, "hits": 0, "hits_host": 0, "hits_disk": 0}

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
        """`request` takes no more steps: its slot and pages are free (a preempted request whose
        pending token ended it leaves the queue)."""
        self.abort(request)

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
            request.lookahead = self.lookahead(request)
            if request.lookahead and not self.cache.can_allocate(request.length + request.lookahead, request.slot):
                request.lookahead = 0  # no pages for verifying drafts: it decodes one token
            need = request.length + request.lookahead
            while not self.cache.can_allocate(need, request.slot):
                if not self._preempt(plan, keep=request):
                    break
            if self.cache.can_allocate(need, request.slot):
                self.cache.ensure(request.slot, need)
                plan.decode.append(request)
        self._admit(plan)
        # prefill chunks of running requests that have more than one token to feed, under each
        # dp rank's token budget (what its decodes left)
        used = [0] * self.cache.layout.dp
        chunks: list[list[int]] = [[] for _ in range(self.cache.layout.dp)]  # chunk lengths per rank
        for request in plan.decode:
            used[self.cache.rank_of(request.slot)] += 1 + request.lookahead
        for request in sorted(self.running, key=lambda r: r.arrival_order):
            if request.to_feed <= 1:
                continue
            rank = self.cache.rank_of(request.slot)
            chunk = self._fit_chunk(request, chunks[rank], self.max_num_batched_tokens - used[rank])
            if not chunk or not self.cache.can_allocate(request.computed + chunk, request.slot):
                continue
            self.cache.ensure(request.slot, request.computed + chunk)
            plan.prefill.append((request, chunk))
            chunks[rank].append(chunk)
            used[rank] += chunk
        if not plan.prefill and not plan.decode:
            self._unblock_prefill(plan)
        return plan

    def _admit(self, plan: StepPlan) -> None:
        """Admit waiting requests, in order, while a slot and the pages of their first chunk are
        free. With a prefix cache a request starts on the cached pages of its longest hit and
        computes from its replay start; one whose next pages another running request is computing
        waits for them (16 prompts with one long prefix compute it once), letting later ones by."""
        i = 0
        while i < len(self.waiting) and self.cache.free_slots:
            request = self.waiting[i]
            if request.pending:  # preempted with a token in flight: its prefill needs that token
                break
            lookup = self._lookup(request)
            if lookup is not None and lookup.waits:
                i += 1
                continue
            size = self.cache.layout.page_size
            hit, restore = (None, []) if lookup is None else (lookup.hit, lookup.restore)
            cached = 0 if lookup is None else lookup.pages
            start = replay_start(cached * size, self.replay_tokens, GRANULE)
            if start == 0:
                # no hit, or one no longer than the replay: recomputing is cheaper
                hit, restore, cached = None, [], 0
            first = start + min(request.length - start, self.prefill_chunk)
            held = max(first, cached * size)  # (pages restored from the host tier are held from the start)
            if not (self.cache.can_allocate(held) if hit is None else self.cache.can_admit(held, hit)):
                break
            del self.waiting[i]
            ttl = 0.0 if lookup is None else self.cache.prefix.ttl(
                request.params.cache_ttl_class or self.cache.prefix.default_ttl_class)
            request.slot = self.cache.acquire_slot(first, hit, ttl, restore)
            request.computed = start
            request.write_floor = cached * size
            if lookup is not None:
                self.cache.claim(request.slot, lookup.keys[cached:])
                self.prefix_stats["queries"] += request.length
                self.prefix_stats["hits"] += cached * size
                for _, _, tier in restore:
                    self.prefix_stats[f"hits_{tier}"] += size
            request.status = Status.RUNNING
            self.running.append(request)
            plan.admitted.append(request)

    def publish(self, request: Request) -> None:
        """Offer the request's newly computed full pages to the prefix cache (the engine, and the
        warm-up's dry run, after each step they dispatch). Pages are named once the step that
        writes them is dispatched: a later step that reads them runs after it."""
        if self.cache.prefix is not None and request.slot is not None:
            self.cache.publish(request.slot, min(request.computed, request.known), request.ids)

    def _lookup(self, request: Request):
        """The prefix cache's answer for `request`'s full pages before its last token (which
        must be computed to sample), None without a prefix cache or for prompt logprobs."""
        if self.cache.prefix is None or request.params.prompt_logprobs is not None:  # (it scores every token)
            return None
        size = self.cache.layout.page_size
        return self.cache.find_prefix(request.ids(0, (request.length - 1) // size * size))

    def _fit_chunk(self, request: Request, chunks: list[int], room: int) -> int:
        """The longest next chunk of `request` (0: none) that fits beside `chunks` (this step's
        other chunks on its rank): at most `room` tokens, and the step's padded rows x tokens
        within the budget. Cut short, a chunk stays a multiple of GRANULE."""
        widest = widest_tokens(row_bucket(len(chunks) + 1, self.cache.layout.slots_per_rank),
                               self.max_num_batched_tokens)
        if not widest or (chunks and token_bucket(max(chunks)) > widest):
            return 0
        chunk = min(request.to_feed, self.prefill_chunk, room)
        if chunk < request.to_feed:
            chunk -= chunk % GRANULE
        if token_bucket(chunk) > widest:
            chunk = widest  # a bucket: a multiple of GRANULE
        return max(chunk, 0)

    def _unblock_prefill(self, plan: StepPlan) -> None:
        """Nothing can run: every running request is mid-prefill and waits for pages the others
        hold. Preempt the newest ones until the oldest can take its next chunk."""
        for request in sorted(self.running, key=lambda r: r.arrival_order):
            if request.to_feed <= 1:
                continue
            chunk = self._fit_chunk(request, [], self.max_num_batched_tokens)
            while not self.cache.can_allocate(request.computed + chunk, request.slot):
                if not self._preempt(plan, keep=request):
                    return
            self.cache.ensure(request.slot, request.computed + chunk)
            plan.prefill.append((request, chunk))
            return

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def widest_bucket(tokens: int) -> int:
    """The longest token bucket (GRANULE x a power of two) of at most `tokens` tokens; 0: none."""
    if tokens < GRANULE:
        return 0
    return GRANULE << ((tokens // GRANULE).bit_length() - 1)


def widest_tokens(rows: int, max_num_batched_tokens: int) -> int:
    """The longest token bucket of a prefill step of `rows` rows per rank under the budget (0:
    none): several rows run GRANULE-token chunks at most."""
    widest = widest_bucket(max_num_batched_tokens // rows)
    return widest if rows == 1 else min(widest, MULTI_ROW_TOKENS)


def check_token_budget(max_num_batched_tokens: int, slots_per_rank: int) -> None:
    """A budget that always leaves one GRANULE-token prefill chunk room beside the decodes of
    every other slot of a dp rank (else a waiting prompt could wait for decodes to finish)."""
    need = GRANULE + slots_per_rank - 1
    if max_num_batched_tokens < need:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must leave room for a {GRANULE}-token "
                         f"prefill chunk beside the decodes of the other {slots_per_rank - 1} sequences of a "
                         f"data-parallel rank: at least {need}")
