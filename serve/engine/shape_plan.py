"""The step shapes a known set of requests will use: a dry run of the scheduler.

Offline jobs (`LLM.generate`, `deepinfer generate` and `run-batch`) know their requests before
the first step, so they need not compile every shape their lengths could reach (`warmup.step_shapes`:
every row count, token bucket and page bucket: 13 shapes for one 1,357-token prompt at the
defaults, where it uses 3). `planned_shapes` runs the engine's own scheduler on copies of the cache
bookkeeping and of the requests, and applies the same bucketing as `LLMEngine.step` and
`ModelRunner.run`, without touching the device, until only decodes are left: the prefill
shapes that come out are what the real steps will ask for, provided every request runs to its
`max_tokens` (or the context); a request that asked for prompt logprobs adds its scored chunks'
one-row shapes (`ModelRunner.run_scored`). The decode shapes are the page buckets each request's decodes
cross (`_decode_buckets`), so early stops never miss one.

A request that stops early (EOS, a stop string) frees its slot sooner, which can move the
admission of a queued request to a step with a different mix of prefill rows: such a prefill
shape compiles when it is first used (logged by the runner; the persistent compilation cache
keeps it for the next run).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque

from deepinfer.serve.engine.prompt_logprobs import scores_chunk
from deepinfer.serve.engine.runner import page_bucket, token_bucket
from deepinfer.serve.engine.scheduler import GRANULE, Scheduler, prefill_passes
from deepinfer.serve.engine.warmup import StepShape, step_shapes

__all__ = ["planned_shapes"]


def _final_length(request, max_len: int) -> int:
    """Where a request that never stops early ends (`Request.check_stop`)."""
    limit = request.params.max_tokens
    return max_len if limit is None else min(max_len, len(request.prompt_token_ids) + limit)


def _wants_logprobs(requests) -> bool:
    return any(r.params.logprobs is not None for r in requests)


def _only_decodes_left(scheduler: Scheduler, max_len: int) -> bool:
    """No prefill chunk can come any more: nothing waits, every running request only decodes,
    and the pages for every running request's final length are free (no preemption)."""
    if scheduler.waiting or any(r.to_feed != 1 for r in scheduler.running):
        return False
    cache = scheduler.cache
    need = [0] * cache.layout.dp
    for r in scheduler.running:
        need[cache.rank_of(r.slot)] += cache.pages_for(_final_length(r, max_len)) - cache.owned_pages(r.slot)
    return all(n <= cache.pages.ranks[rank].free for rank, n in enumerate(need))


def _decode_buckets(requests, layout, max_len: int, min_page_tokens: int) -> dict[bool, set[int]]:
    """The page buckets of the decode steps, by whether the step returns logprobs. A request
    decodes with its sequence ending from its prompt + 1 (the first sample comes from its
    prefill) to its final length - 1; a step's page bucket is that of its longest row, which is
    one of its rows, so it lies in the union of its requests' ranges whoever stopped early. A
    step returns logprobs when one of its rows asks, and its longest row may be any request's."""
    buckets: dict[bool, set[int]] = {}
    for logprobs in (False, True):
        own = [r for r in requests if (r.params.logprobs is not None) == logprobs]
        for r in (requests if logprobs and own else own):
            low, high = len(r.prompt_token_ids) + 1, _final_length(r, max_len) - 1
            if low <= high:
                found = buckets.setdefault(logprobs, set())
                found.update(page_bucket(layout, n, min_page_tokens) for n in range(low, high, layout.page_size))
                found.add(page_bucket(layout, high, min_page_tokens))
    return buckets


def planned_shapes(engine, max_steps: int = 20_000) -> list[StepShape]:
    """The shapes of the steps that run the engine's current requests to their end (see the
    module docstring), in the order they first occur. The engine is not changed. A dry run that
    has not reached its last prefill after `max_steps` steps (a long queue behind generations of
    thousands of tokens) adds every shape the requests' lengths can reach instead."""
    layout, ec = engine.cache.layout, engine.engine_config
    # (the prefix cache's index is copied, its host and disk tiers and the device pages are not:
    # the dry run finds the device hits the engine would and never moves a page)
    cache = copy.deepcopy(engine.cache, memo={id(engine.config): engine.config, id(layout): layout,
                                              id(engine.cache.store): None, id(engine.runner): None})
    for allocator in cache.pages.ranks:
        allocator.offload = None
    scheduler = Scheduler(cache, prefill_chunk=ec.prefill_chunk, max_num_batched_tokens=ec.max_num_batched_tokens,
                          replay_tokens=engine.scheduler.replay_tokens)
    shadow = {id(r): dataclasses.replace(r, output_ids=list(r.output_ids) + [0] * r.pending, pending=0,
                                         detokenizer=None, logprobs=None)
              for r in (*engine.scheduler.waiting, *engine.scheduler.running)}
    scheduler.waiting = deque(shadow[id(r)] for r in engine.scheduler.waiting)
    scheduler.running = [shadow[id(r)] for r in engine.scheduler.running]
    max_len = layout.max_len
    shapes: dict[StepShape, None] = {}
    for _ in range(max_steps):
        if not scheduler.has_work or _only_decodes_left(scheduler, max_len):
            break
        plan = scheduler.schedule()
        for r in plan.admitted:
            r.floor = engine.replay_floor(r)
        sampled = list(plan.decode)
        for step in prefill_passes(plan.prefill, cache):
            # (as `LLMEngine._dispatch`: a chunk scored for prompt logprobs is a step of its own)
            group = [(r, n) for r, n in step.chunks if not scores_chunk(r)]
            for r, n in step.chunks:
                if scores_chunk(r):
                    ends = r.computed + n == r.length
                    shapes[StepShape("scored", 1, token_bucket(n, GRANULE), page_bucket(
                        layout, r.computed + n, engine.runner.min_page_tokens), True,
                        logprobs=ends and r.params.logprobs is not None, prompt_logprobs=r.params.prompt_logprobs,
                        samples=ends)] = None
            if group:
                emitting = [r for r, n in group if r.computed + n == r.length]
                furthest = max(r.computed + n for r, n in group)
                shapes[StepShape("prefill", step.rows, token_bucket(max(n for _, n in group)),
                                 page_bucket(layout, furthest, engine.runner.min_page_tokens), step.decoder,
                                 logprobs=step.decoder and _wants_logprobs(emitting))] = None
            for r, n in step.chunks:
                r.computed += n
                scheduler.publish(r)
                if r.to_feed == 0:
                    sampled.append(r)
        for r in plan.decode:
            r.computed += 1
            scheduler.publish(r)
        for r in sampled:
            r.output_ids.append(0)
            if r.length >= _final_length(r, max_len):
                scheduler.finish(r)
        if not plan.prefill and not plan.decode:  # `LLMEngine._finish_stuck`
            for r in [r for r in scheduler.running if r.to_feed == 1]:
                scheduler.finish(r)
    else:  # a queue behind very long generations: every shape the requests' lengths can reach
        reach = max(_final_length(r, max_len) for r in shadow.values())
        reachable = step_shapes(engine, reach)
        if _wants_logprobs(shadow.values()):
            reachable += [dataclasses.replace(s, logprobs=True) for s in reachable if s.decoder]
        shapes.update(dict.fromkeys(reachable))

    for logprobs, buckets in _decode_buckets(list(shadow.values()), layout, max_len,
                                             engine.runner.min_page_tokens).items():
        for pages in sorted(buckets):
            shapes[StepShape("decode", layout.slots_per_rank, 1, pages, True, logprobs=logprobs)] = None
    return list(shapes)
