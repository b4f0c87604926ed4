"""Compile, before an engine serves, every step shape a request can ask it for.

The runner pads each step to a shape bucket (`runner.py`): prefill chunks are rows x tokens x
page-count buckets (rows x tokens within the engine's `max_num_batched_tokens`, several rows only
of GRANULE-token chunks: `scheduler.py`), with or without the decoder layers (compact prefill
runs chunks wholly below a prompt's replay floor encoder-only); decode runs all slots x 1 token x a page-count bucket. A
step with the decoder samples on the device: the model's program of the shape, then a small
sampler program (a request asking for logprobs compiles a second sampler on first use, in a
fraction of a second: `device_step.py`). The first request that needs a new
bucket waits for its compilation (tens of seconds for a real model), which looks like a hang;
`warm_up` runs each bucket once on dummy tokens instead, while the engine is idle.

With speculative decoding on, the decode shapes run as DSpark verify steps (all slots x the
anchor and its drafts), which is what such an engine's decodes are: one per width the engine
verifies (`LLMEngine.verify_widths`: with confidence-scheduled verification, 1 .. k drafts, and
a plain decode step for the steps where no draft pays).

`max_len` limits it to the shapes of sequences that end at or before that length (what a batch
of known requests can reach: `LLM` warms each call up to its longest prompt + max_tokens), and a
shape it compiled once is not run again, so calling it before every batch costs nothing once
the shapes are there: nothing compiles mid-stream, yet a short job does not wait for the shapes
of the whole context.

It leaves the engine as it found it: no slot or page is allocated (the dummy rows go
through the runner directly, on free slots and pages, and the touched slots are reset after; the
free pages they wrote hold stale values, as any released page does, and are overwritten before
they are read; the dummy rows keep no sampled token, so the slots' sampling state is untouched),
the engine's counters, seed generator and the runner's expert-load statistics are unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from deepinfer.serve.engine import sampling_state
from deepinfer.serve.engine.runner import (ChunkWork, StepSampling, page_buckets, row_bucket, scored_key, step_key,
                                          token_bucket)
from deepinfer.serve.engine.sampler import Sampler
from deepinfer.serve.engine.scheduler import GRANULE, widest_tokens
from deepinfer.serve.engine.types import MAX_LOGPROBS

__all__ = ["StepShape", "WarmupReport", "pending_shapes", "step_shapes", "warm_up"]

log = logging.getLogger("deepinfer.engine")


@dataclass(frozen=True)
class StepShape:
    """One compiled bucket. kind: "prefill" | "decode" | "scored" (a prompt chunk of a request
    that asked for prompt logprobs: one row, `ModelRunner.run_scored`); rows: prefill rows per
    dp rank (decode: all slots); tokens: chunk tokens (1 for decode); pages: page-table columns;
    decoder: the decoder layers run (prefill; and then the step samples)."""

    kind: str
    rows: int
    tokens: int = 1
    pages: int = 0
    decoder: bool = True
    logprobs: bool = False  # the sampler also returns logprobs and top-k (a program of its own)
    # a scored chunk: its prompt logprobs' k, and whether it samples (it ends the request's input)
    prompt_logprobs: int | None = None
    samples: bool = True

    def __str__(self) -> str:
        extra = ("" if self.decoder else ", encoder only") + (", with logprobs" if self.logprobs else "")
        if self.kind == "scored":
            extra += f", {self.prompt_logprobs} prompt logprobs" + ("" if self.samples else ", no sample")
        return f"{self.kind} {self.rows} rows x {self.tokens} tokens x {self.pages} pages{extra}"


@dataclass
class WarmupReport:
    shapes: list[StepShape] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per shape (compile + one run)

    @property
    def total_seconds(self) -> float:
        return float(sum(self.seconds))


def _chunk_ends(tokens: int, chunk: int, limit: int) -> list[tuple[int, int]]:
    """Where a prefill chunk of token bucket `tokens` can end: chunks start at multiples of
    GRANULE (a chunk cut short by the token budget, or one of several rows, is a multiple of it),
    hold (tokens/2, tokens] tokens (1..128 for the first bucket), at most `chunk` (the prefill
    chunk size), and end at or before `limit`. Intervals [first, last]."""
    shortest, longest = (1 if tokens == 128 else tokens // 2 + 1), min(tokens, chunk)
    return [(start + shortest, min(start + longest, limit)) for start in range(0, limit, GRANULE)
            if start + shortest <= limit]


def _ends_in(intervals: list[tuple[int, int]], low: int, high: int) -> bool:
    """Some end of `intervals` in (low, high]."""
    return any(first <= high and last > low for first, last in intervals)


def step_shapes(engine, max_len: int | None = None) -> list[StepShape]:
    """Every bucket the engine's scheduler can produce for sequences of at most `max_len` tokens
    (default: the context), in the order `warm_up` compiles them.

    A prefill step's token bucket is its longest chunk's, its page bucket its furthest-reaching
    row's: page bucket P covers sequence ends in ((P/2) * page_size, P * page_size] (the first
    from 0: `EngineConfig.min_page_bucket_tokens`; the last one up to the context). Encoder-only
    chunks end at or below the replay floor, at most context - keep_tokens. Shapes no request can produce are left out (`_chunk_ends`)."""
    layout, ec = engine.cache.layout, engine.engine_config
    ps, chunk = layout.page_size, ec.prefill_chunk
    max_len = layout.max_len if max_len is None else max(1, min(max_len, layout.max_len))
    pages = page_buckets(layout, engine.runner.min_page_tokens)
    low_end = {p: (0 if i == 0 else pages[i - 1] * ps) for i, p in enumerate(pages)}  # ends > this
    pages = [p for p in pages if low_end[p] < max_len]
    tokens = sorted({token_bucket(n) for n in range(1, chunk + 1)})
    rows = sorted({row_bucket(n, layout.slots_per_rank) for n in range(1, layout.slots_per_rank + 1)})
    decoders = (False, True) if ec.prefill_mode == "compact" else (True,)
    shapes = []
    for decoder in decoders:
        limit = max_len if decoder else max_len - ec.keep_tokens
        ends = {t: _chunk_ends(t, chunk, limit) for t in tokens}
        for r in rows:  # the token buckets the scheduler's budget allows r rows
            for t in [t for t in tokens if t <= widest_tokens(r, ec.max_num_batched_tokens)]:
                for p in pages:
                    low, high = low_end[p], min(p * ps, limit)
                    if r == 1:  # the one chunk ends in the page bucket
                        fits = _ends_in(ends[t], low, high)
                    else:  # the longest chunk ends there or before, a shorter or equal one in it
                        fits = (any(first <= high for first, _ in ends[t])
                                and any(_ends_in(ends[u], low, high) for u in tokens if u <= t))
                    if fits:
                        shapes.append(StepShape("prefill", r, t, p, decoder))
    shapes += [StepShape("decode", layout.slots_per_rank, 1, p) for p in pages]
    return shapes


def _run_step(engine, shape: StepShape) -> None:
    """One runner step of `shape` on dummy tokens in the first slots (and some pages) of rank 0:
    only the shape compiles, so the rows end at the last position of the page bucket and the
    chunk is as long as the token bucket allows."""
    layout, ec = engine.cache.layout, engine.engine_config
    end = min(shape.pages * layout.page_size, layout.max_len)
    n = min(shape.tokens, end, ec.prefill_chunk)
    floor = 0 if shape.decoder else end + ec.keep_tokens  # encoder-only: the chunk is below the floor
    table, work = _dummy_rows(engine, shape.rows, end, n, floor)
    sample = StepSampling([False] * len(work), _logprobs(shape)) if shape.decoder else None  # no token kept
    if shape.kind == "scored":
        engine.runner.run_scored(work[0], table, tokens=shape.tokens, targets=np.zeros(n, np.int32),
                                 num_logprobs=shape.prompt_logprobs, sample=sample if shape.samples else None)
        return
    if shape.kind == "decode" and engine.speculative is not None:  # decodes run as verify steps
        for width in engine.verify_widths():
            if not _verify_compiled(engine, shape, width):
                _dummy_verify(engine, table, work, end, width, sample)
        if not engine.decodes_plainly():  # (else plain decode steps too: below)
            return
    engine.runner.run(work, table, rows=shape.rows, tokens=shape.tokens, decoder=shape.decoder, sample=sample)


def _dummy_rows(engine, rows: int, end: int, n: int, floor: int) -> tuple[np.ndarray, list[ChunkWork]]:
    """A page table and `rows` rows in the first slots of rank 0, each a chunk of n dummy tokens
    that ends at `end` (on pages spread over the rank's pool)."""
    layout = engine.cache.layout
    needed = -(-end // layout.page_size)
    table = np.full((layout.num_slots, layout.max_pages_per_slot), -1, np.int32)
    work = []
    for slot in range(rows):
        table[slot, :needed] = (slot * needed + np.arange(needed)) % (layout.num_pages // layout.dp)
        work.append(ChunkWork(slot, np.ones(n, np.int32), end - n, np.ones(end - n, np.int32), floor))
    return table, work


def _dummy_verify(engine, table: np.ndarray, work: list[ChunkWork], end: int, width: int,
                  sample: StepSampling) -> None:
    """A verify step of `width` drafts per row whose rows end at `end` (`_run_step`'s rows, each
    turned into an anchor and its drafts)."""
    start = max(0, end - (width + 1))
    work = [dataclasses.replace(w, tokens=np.ones(1, np.int32), start=start, history=np.ones(start, np.int32))
            for w in work]
    engine.runner.verify(work, table, [end - start - 1] * len(work), [None] * len(work), tokens=width + 1,
                         sample=sample)


def time_decode_steps(engine, repeats: int = 3) -> list[float]:
    """Seconds of a plain decode step, then of a verify step per width W = 1 .. k drafts per row
    (all slots, the smallest page bucket), each the median of `repeats` runs after one that
    compiles: the step-cost curve of confidence-scheduled verification (`verify_schedule.py`).
    The engine must be idle; it is left as `warm_up` leaves it."""
    if engine.scheduler.running:
        raise RuntimeError("time_decode_steps needs an engine with no running request")
    layout = engine.cache.layout
    shape = StepShape("decode", layout.slots_per_rank, 1, page_buckets(layout, engine.runner.min_page_tokens)[0])
    end = min(shape.pages * layout.page_size, layout.max_len)
    table, work = _dummy_rows(engine, shape.rows, end, 1, 0)
    sample = StepSampling([False] * len(work), None)
    runner = engine.runner

    def median_seconds(run) -> float:
        runs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            run()
            runs.append(time.perf_counter() - t0)
        return float(np.median(runs[1:]))

    expert_load = runner.expert_load.copy()
    try:
        seconds = [median_seconds(lambda: runner.run(work, table, rows=shape.rows, tokens=1, sample=sample))]
        seconds += [median_seconds(lambda: _dummy_verify(engine, table, work, end, width, sample))
                    for width in engine.verify_widths()]
        runner.reset(list(range(layout.slots_per_rank)))
    finally:
        runner.expert_load = expert_load
    return seconds


def _logprobs(shape: StepShape) -> int | None:
    return MAX_LOGPROBS if shape.logprobs else None


def _is_compiled(engine, shape: StepShape) -> bool:
    """`shape` ran before: warmed up earlier, or a real step of the runner used it (a decode
    shape with speculative decoding on: a verify step of every width the engine runs)."""
    if shape in engine.warmed_shapes:
        return True
    if shape.kind == "decode" and engine.speculative is not None:
        if not all(_verify_compiled(engine, shape, width) for width in engine.verify_widths()):
            return False
        if not engine.decodes_plainly():
            return True
    head = Sampler(_logprobs(shape)) if shape.decoder else None
    if shape.kind == "scored":
        key = scored_key(shape.prompt_logprobs, engine.cache.layout.dp, shape.tokens, shape.pages,
                         head if shape.samples else None)
    else:
        key = step_key(shape.kind, shape.rows * engine.cache.layout.dp, shape.tokens, shape.pages, False,
                       shape.decoder, head)
    return key in engine.runner.compile_seconds


def _verify_compiled(engine, shape: StepShape, width: int) -> bool:
    key = step_key("verify", shape.rows * engine.cache.layout.dp, width + 1, shape.pages, False, True,
                   Sampler(_logprobs(shape)))
    return key in engine.runner.compile_seconds


def pending_shapes(engine, max_len: int | None = None, shapes: list[StepShape] | None = None) -> list[StepShape]:
    """The shapes of `shapes` (default: `step_shapes(engine, max_len)`) that have not run yet
    (what `warm_up` compiles)."""
    shapes = step_shapes(engine, max_len) if shapes is None else shapes
    kernels = engine.runner.kernels
    if kernels is not None and kernels.batch_invariant:  # every step reads all pages (`ModelRunner._batch`)
        shapes = list(dict.fromkeys(dataclasses.replace(s, pages=engine.cache.layout.max_pages_per_slot)
                                    for s in shapes))
    return [s for s in shapes if not _is_compiled(engine, s)]


def warm_up(engine, progress: Callable[[int, int, StepShape, float], None] | None = None,
            max_len: int | None = None, shapes: list[StepShape] | None = None) -> WarmupReport:
    """Compile the shapes of `shapes` (default: `step_shapes(engine, max_len)`; the shapes a
    known batch will use: `shape_plan.planned_shapes`) that have not run yet (see the module
    docstring); no request may be running (waiting ones hold no slot or page and stay queued).
    `progress(i, n, shape, seconds)` after each shape (default: a log line)."""
    if engine.scheduler.running:
        raise RuntimeError("warm_up needs an engine with no running request")
    if progress is None:
        def progress(i, n, shape, seconds):
            log.info("warm-up %d/%d: %s in %.2f s", i, n, shape, seconds)
    shapes = pending_shapes(engine, max_len, shapes)
    report = WarmupReport()
    if not shapes:
        return report
    runner = engine.runner
    expert_load = runner.expert_load.copy()
    try:
        for i, shape in enumerate(shapes, 1):
            t0 = time.perf_counter()
            _run_step(engine, shape)
            engine.warmed_shapes.add(shape)
            report.shapes.append(shape)
            report.seconds.append(time.perf_counter() - t0)
            progress(i, len(shapes), shape, report.seconds[-1])
        # the engine resets the slots it admits (one program, padded), which also leaves the
        # slots the dummy rows wrote to (rank 0) as new
        runner.reset(list(range(engine.cache.layout.slots_per_rank)))
        # admission writes a slot's sampling row, a request leaving clears it: two small programs
        # that would otherwise compile in the first real step (slot 0 ends neutral, as it began)
        runner.write_sampling(0, sampling_state.slot_row(
            None, seed=0, vocab_size=engine.config.vocab_size, max_logit_bias=runner.max_logit_bias,
            max_bans=runner.max_bans, eos_token_id=engine.config.eos_token_id))
        runner.clear_sampling([0])
    finally:
        runner.expert_load = expert_load
    log.info("warm-up: %d shapes compiled in %.1f s", len(report.shapes), report.total_seconds)
    return report
