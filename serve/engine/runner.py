"""The model runner: turns scheduled work into padded, bucketed `StepBatch`es, runs the jitted
steps on the device cache (donated), and logs the compile time of every new shape bucket.

It also owns the per-slot sampling state (`sampling_state.py`): the engine writes a slot's row when
it admits a request and clears it when the request leaves; a step run with `sample=` samples on
the device (`device_step.py`) and returns tokens, not logits.

Shapes are static per bucket: prefill steps are padded to a power-of-two number of rows per dp
rank (at most the rank's slots: `row_bucket`) of a power-of-two token count (from 128:
`token_bucket`); decode always runs all slots with one token each (inactive slots are padding
rows). The jitted steps are the engine configuration's (`programs.py`), held by the runner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import draft_from_cache, has_drafter
from deepinfer.model.engram_hash import hasher_for
from deepinfer.model.forward import engram_hash_ids
from deepinfer.model.kv_cache import CacheLayout, init_cache, padded_slot_ids, reset_slots
from deepinfer.model.step import StepBatch
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine import sampling_state
from deepinfer.serve.engine.device_step import model_rows, sampler_rows
from deepinfer.serve.engine.placeholders import PLACEHOLDER
from deepinfer.serve.engine.programs import engine_step, forward_step, step_programs
from deepinfer.serve.engine.sampler import SampleOutput, SampleRows, Sampler, prompt_logprobs
from deepinfer.serve.engine.speculative import DraftInputs, DraftProposal, VerifiedLogits, VerifyOutput
from deepinfer.sharding.distributed import host_value

log = logging.getLogger("deepinfer.engine")


@dataclass
class ChunkWork:
    """One row of a step: tokens [start, start+len) of a sequence in `slot`."""

    slot: int
    tokens: np.ndarray  # the chunk's token ids
    start: int  # position of tokens[0]
    # the tokens right before `start`, for the Engram look-back: only the last `lookback`
    # (`ModelRunner.lookback`) are read, and callers pass just those (O(1) per decode row)
    history: np.ndarray
    floor: int = 0  # decoder replay start of the sequence (compact prefill); 0 = full fidelity
    write_floor: int = 0  # no global KV is written below this position (prefix-cache pages)


class PendingSamples:
    """A sampling step's outputs while the device may still be computing them: the host copy
    starts as soon as they exist (non-blocking), `fetch()` waits for it (once) and returns the
    rows in the work's order, adding the step's routed-token counts to the runner's
    `expert_load`. Asynchronous scheduling fetches a step after dispatching the next one."""

    def __init__(self, runner: ModelRunner, out: SampleOutput, counts, row_of: list[int]):
        self._runner, self._out, self._counts, self._row_of = runner, out, counts, row_of
        self._rows: SampleOutput | None = None
        for leaf in jax.tree.leaves((out, counts)):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()

    def fetch(self) -> SampleOutput:
        if self._rows is None:
            out, counts = jax.device_get((self._out, self._counts))  # one transfer: tokens, no logits
            self._runner.expert_load += counts
            self._rows = jax.tree.map(lambda a: a[self._row_of], out)
            self._out = self._counts = None
        return self._rows


class SplitStep:
    """A decode step whose model half is dispatched (`ModelRunner.run_split`) and whose sampler
    is not yet: `sample(settings)` dispatches it and returns the `PendingSamples`."""

    def __init__(self, runner: ModelRunner, logits, counts, slots, position: np.ndarray, row_of: list[int],
                 n_pages: int):
        self._runner, self._logits, self._counts, self._slots = runner, logits, counts, slots
        self._position, self._row_of, self._n_pages = position, row_of, n_pages

    def sample(self, sample: StepSampling) -> PendingSamples:
        runner, B = self._runner, len(self._position)
        emit = np.zeros((B,), np.bool_)
        emit[self._row_of] = sample.emit
        rows = SampleRows(emit, self._position, None, sample.allowed_rows(self._row_of, B))
        head = Sampler(sample.num_logprobs)
        kind = "decode/sampler" + ("+masks" if sample.allowed is not None else "")
        key = step_key(kind, B, 1, self._n_pages, False, True, head)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(kind):
            if runner.mesh_step is not None:
                runner.sampling, out = runner.mesh_step.sample(head, self._logits, runner.sampling, self._slots,
                                                               sampler_rows(rows))
            else:
                runner.sampling, out = runner._programs.sample_logits(self._logits, runner.sampling, self._slots,
                                                                      jax.tree.map(jnp.asarray, rows), head=head)
        runner._record(key, start)
        pending = PendingSamples(runner, out, self._counts, self._row_of)
        self._logits = self._counts = None
        return pending


@dataclass(frozen=True)
class _VerifyInputs:
    """A verify step's device inputs (batch, sampler rows, draft inputs) and padding."""

    inputs: tuple
    row_of: list[int]
    rows: int
    pages: int
    head: Sampler


@dataclass(frozen=True)
class ProposedDrafts:
    """A verify step whose drafts exist and are verified (`ModelRunner.propose`) but not yet
    accepted: `drafts [len(work), K]` on the host, in the work's order; the drafter's and the
    target's outputs stay on the device for `ModelRunner.check`."""

    drafts: np.ndarray
    step: _VerifyInputs
    proposal: DraftProposal
    verified: VerifiedLogits
    counts: jax.Array


# the scores of a scored chunk on a mesh (on one device: `StepPrograms.prompt_logprobs`)
_mesh_prompt_logprobs = jax.jit(prompt_logprobs, static_argnames=("num_logprobs",))


@dataclass(frozen=True)
class StepSampling:
    """Sample in the step: `emit[i]` says whether work row i's token is kept (it ends its
    sequence's input); `num_logprobs` (None: none) as in `sampler.sample`."""

    emit: list[bool]
    num_logprobs: int | None = None
    # int32 [len(emit), ceil(V / 32)]: each work row's structured-output bitmask (all ones for an
    # unconstrained row); None when no row is constrained
    allowed: np.ndarray | None = None

    def allowed_rows(self, row_of: list[int], B: int) -> np.ndarray | None:
        """`allowed` scattered to the step's `B` padded rows (padding rows allow everything)."""
        if self.allowed is None:
            return None
        full = np.full((B, self.allowed.shape[1]), -1, np.int32)
        full[row_of] = self.allowed
        return full


def token_bucket(n: int, minimum: int = 128) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


_reset_slots = jax.jit(reset_slots, donate_argnums=0)


def row_bucket(n: int, slots_per_rank: int) -> int:
    """Rows per dp rank of a prefill step of `n` chunks on a rank: the next power of two, at most
    the rank's slots (a padding row needs a slot no real row uses)."""
    return min(1 << (n - 1).bit_length(), slots_per_rank)


# The narrowest page table a step reads covers this many tokens by default: below it a narrower
# table saves little reading (a decode step reads the pages' indexer keys and its selected
# entries) but costs a program of its own, compiled at warm-up or in the middle of a stream.
MIN_PAGE_BUCKET_TOKENS = 2048


def page_bucket(layout: CacheLayout, longest: int, min_tokens: int = MIN_PAGE_BUCKET_TOKENS) -> int:
    """Page-table columns of a step whose furthest row ends at sequence position `longest`:
    the power of two of its pages, at least the pages of `min_tokens`, at most a slot's."""
    smallest = token_bucket(-(-min_tokens // layout.page_size), minimum=1)
    return min(layout.max_pages_per_slot, token_bucket(-(-longest // layout.page_size), minimum=smallest))


def page_buckets(layout: CacheLayout, min_tokens: int = MIN_PAGE_BUCKET_TOKENS) -> list[int]:
    """Every page-table width `page_bucket` gives, narrowest first."""
    return sorted({page_bucket(layout, n * layout.page_size, min_tokens)
                   for n in range(1, layout.max_pages_per_slot + 1)})


def step_key(kind: str, rows: int, tokens: int, pages: int, all_logits: bool, decoder: bool,
             head: Sampler | None) -> tuple:
    """What a compiled step program is keyed on (`ModelRunner.compile_seconds`)."""
    return (kind, rows, tokens, pages, all_logits, decoder, head)


def scored_key(num_logprobs: int, rows: int, tokens: int, pages: int, head: Sampler | None) -> tuple:
    """The `step_key` of a scored prompt chunk (`ModelRunner.run_scored`), whose scores'
    program depends on the number of prompt logprobs."""
    return step_key(f"prefill+prompt_logprobs={num_logprobs}", rows, tokens, pages, True, True, head)


def _device_of(params: dict):
    """The one device all of `params` live on, or None (JAX's default device)."""
    devices = {d for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}
    return devices.pop() if len(devices) == 1 else None


def _placed_like_params(cache, params: dict):
    """The new cache (or sampling state) placed as a step returns it: committed to the params'
    one device, NamedSharding-ed when the params are (loaded onto a one-device mesh by
    `load_checkpoint`). A jitted program is keyed on its inputs' shardings and on whether they
    are committed, so a cache left as created would compile a step shape a second time,
    mid-stream, once the warm-up's steps have passed their own outputs on."""
    leaf = next((x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)), None)
    if leaf is None or len(leaf.sharding.device_set) != 1:
        return cache
    if isinstance(leaf.sharding, NamedSharding):
        return jax.device_put(cache, NamedSharding(leaf.sharding.mesh, PartitionSpec()))
    return jax.device_put(cache, leaf.sharding)


class ModelRunner:
    """Owns the params and the device cache; every step donates and replaces the cache.

    With a `mesh`, the step runs shard-mapped over it (`sharding.engine_step.MeshStep`): rows
    are grouped by their slot's dp rank and carry local slot ids. It also accumulates how many
    tokens each layer routed to each expert (`expert_load`, for EPLB)."""

    def __init__(self, params: dict, config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None = None,
                 mesh=None, keep_logical_experts: bool = False, max_logit_bias: int = 128, max_bans: int = 33,
                 min_page_tokens: int = MIN_PAGE_BUCKET_TOKENS):
        self.config = config
        self.layout = layout
        self.min_page_tokens = min_page_tokens  # the narrowest page table covers this many tokens
        self.kernels = kernels
        self.mesh_step = None
        if layout.draft_rings and not has_drafter(params, config):
            raise ValueError("the cache layout keeps drafter rings (draft_rings > 0) but the params have no DSpark "
                             "drafter (`mtp.*` of a DeepSeek-V4.1 checkpoint)")
        # what EPLB layouts are built from (kept only when asked: a second copy of the experts)
        self._logical_ffn = [lp["ffn"] for lp in params["layers"]] if keep_logical_experts else None
        if mesh is not None:
            from deepinfer.serve.engine.mesh_speculative import MeshVerifyPrograms
            from deepinfer.sharding.engine_step import MeshStep

            self.mesh_step = MeshStep(mesh, config, layout, kernels)
            self.params = self.mesh_step.place_params(params)
            self.cache = self.mesh_step.init_cache()
            self._verify_programs = MeshVerifyPrograms(self.mesh_step)  # DSpark's verify step, shard-mapped
        else:
            self.params = params
            self._programs = step_programs(config, layout, kernels)  # held: they live while this runner does
            self._verify_programs = self._programs
            with jax.default_device(_device_of(params)):  # the cache goes where the params are
                self.cache = _placed_like_params(init_cache(config, layout), params)
        self.max_logit_bias, self.max_bans = max_logit_bias, max_bans
        make_state = partial(sampling_state.init_state, layout.num_slots, config.vocab_size, max_logit_bias, max_bans)
        if mesh is not None:  # every slot's row on its dp rank, like the slot's cache
            shardings = self.mesh_step.per_slot_shardings(jax.eval_shape(make_state))
            self.sampling = jax.jit(make_state, out_shardings=shardings)()
            self._write_slot, self._clear_slots = sampling_state.jitted_writers(shardings)
        else:
            with jax.default_device(_device_of(params)):
                self.sampling = _placed_like_params(make_state(), params)
            self._write_slot, self._clear_slots = sampling_state.write_slot, sampling_state.clear_slots
        self.expert_load = np.zeros((config.num_hidden_layers, config.n_routed_experts), np.int64)
        self._unread_counts: list = []  # of deferred encoder-only passes (`read_counts`)
        self._compiled: set = set()
        self.compile_seconds: dict[tuple, float] = {}

    def reset(self, slots: list[int]) -> None:
        if not slots:
            return
        if self.mesh_step is not None:
            self.cache = self.mesh_step.reset(self.cache, slots)  # global slot ids are rank-major
        else:
            self.cache = _reset_slots(self.cache, padded_slot_ids(slots, self.layout.num_slots))

    def write_sampling(self, slot: int, row: sampling_state.SlotRow) -> None:
        """Slot `slot` (global id) samples with `row` from the next step on."""
        args = (np.int32(slot), row)
        if self.mesh_step is not None:  # global inputs, as every process's runtime needs them
            args = self.mesh_step.replicate(args)
        self.sampling = self._write_slot(self.sampling, *args)

    def clear_sampling(self, slots: list[int]) -> None:
        """Slots whose request left go back to neutral (greedy, nothing biased or counted)."""
        if slots:
            padded = padded_slot_ids(slots, self.layout.num_slots)
            if self.mesh_step is not None:
                padded = self.mesh_step.replicate(padded)
            self.sampling = self._clear_slots(self.sampling, padded)

    @property
    def lookback(self) -> int:
        """Tokens before a chunk that its Engram hashes read (N-1 of the n-grams; 0 without Engram)."""
        return self.config.engram_max_ngram_size - 1 if self.config.engram_layer_ids else 0

    def _hash_ids(self, work: list[ChunkWork], T: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The rows' Engram hash ids `[len(work), T, ...]` and, for a decode step (T = 1), the
        look-back folds `[len(work), ...]` that hash a placeholder token on the device
        (`placeholders.py`; the hash ids of such a row are zeros)."""
        if not self.config.engram_layer_ids:
            return None, None
        hasher = hasher_for(self.config)
        lookback = self.lookback
        rows, folds = [], []
        for w in work:
            # the n-grams ending in the chunk reach back `lookback` tokens; a shorter history is
            # the sequence start, where the hasher pads (sticky), as in the full forward
            history = w.history[max(0, len(w.history) - lookback):]
            pending = len(w.tokens) and w.tokens[0] == PLACEHOLDER
            if T == 1:  # only a placeholder row's folds are read (`placeholders.resolve`)
                folds.append(hasher.pending_folds(hasher.compress(history)) if pending
                             else np.zeros((hasher.n_layers, hasher.lookback_len, 2), np.uint32))
            if pending:
                rows.append(np.zeros((T, hasher.n_layers, hasher.n_cols), np.int32))
                continue
            context = np.concatenate([history, w.tokens])
            ids = engram_hash_ids(self.config, context[None])[0][len(context) - len(w.tokens):]
            pad = np.zeros((T - len(w.tokens), *ids.shape[1:]), np.int32)
            rows.append(np.concatenate([ids, pad]))
        return np.stack(rows), (np.stack(folds) if T == 1 else None)

    def _batch(self, work: list[ChunkWork], page_table: np.ndarray, rows: int,
               T: int) -> tuple[StepBatch, list[int], np.ndarray | None, int]:
        """The padded host `StepBatch` of `work` (`rows` per dp rank x `T` tokens), each work
        row's batch row, the Engram look-back folds of a decode step and the page bucket."""
        per_rank, dp = self.layout.slots_per_rank, self.layout.dp
        B = rows * dp
        longest = max(w.start + len(w.tokens) for w in work)
        n_pages = page_bucket(self.layout, longest, self.min_page_tokens)
        if self.kernels is not None and self.kernels.batch_invariant:  # every read the same width
            n_pages = self.layout.max_pages_per_slot
        tok = np.zeros((B, T), np.int32)
        pos = np.full((B, T), -1, np.int32)
        slots = np.zeros((B,), np.int32)
        last = np.zeros((B,), np.int32)
        floor = np.zeros((B,), np.int32)
        write_floor = np.zeros((B,), np.int32)
        table = np.full((B, n_pages), -1, np.int32)
        row_of = []
        filled = [0] * dp
        used: list[set[int]] = [set() for _ in range(dp)]
        for w in work:
            rank, local = divmod(w.slot, per_rank)
            if filled[rank] == rows:
                raise ValueError(f"more than {rows} rows for dp rank {rank} in one step")
            b = rank * rows + filled[rank]
            filled[rank] += 1
            row_of.append(b)
            n = len(w.tokens)
            tok[b, :n] = w.tokens
            pos[b, :n] = np.arange(w.start, w.start + n)
            slots[b] = local
            last[b] = n - 1
            floor[b] = w.floor
            write_floor[b] = w.write_floor
            table[b] = page_table[w.slot, :n_pages]
            used[rank].add(local)
        # padding rows point at a slot of their rank that no row uses: they write nothing
        # (positions -1) and never race a real row's scatter into the same slot
        for rank in range(dp):
            spare = next((s for s in range(per_rank) if s not in used[rank]), 0)
            slots[rank * rows + filled[rank]:(rank + 1) * rows] = spare
        hash_ids, folds = self._hash_ids(work, T)
        if hash_ids is not None:
            full = np.zeros((B, *hash_ids.shape[1:]), np.int32)
            full[row_of] = hash_ids
            hash_ids = full
        batch = StepBatch(tok, pos, slots, table, hash_ids, last, floor, write_floor)
        return batch, row_of, folds, n_pages

    def run(self, work: list[ChunkWork], page_table: np.ndarray, *, rows: int, tokens: int,
            all_logits: bool = False, decoder: bool = True, sample: StepSampling | None = None,
            defer: bool = False) -> np.ndarray | SampleOutput | PendingSamples | None:
        """Run one step over `work` padded to `rows` rows PER dp RANK x `tokens`; returns fp32
        logits `[len(work), vocab]` at each row's last token (or `[len(work), tokens, vocab]`),
        in `work`'s order; None for a compact-prefill chunk below the replay floor
        (`decoder=False`). With `sample`, the step samples on the device instead and returns the
        rows' `SampleOutput` (numpy, `work`'s order), or with `defer` the `PendingSamples` to
        fetch them from later; the logits stay there. A decode row (`tokens` 1) of a sampling
        step may have the PLACEHOLDER token: its slot's last sample, which the device fills in."""
        if sample is not None and (all_logits or not decoder or len(sample.emit) != len(work)):
            raise ValueError("a sampling step needs the decoder, last-token logits and one emit flag per work row")
        if any(PLACEHOLDER in w.tokens for w in work) and (sample is None or tokens != 1):
            raise ValueError("a placeholder token can only be a decode row's input in a sampling step")
        T = tokens
        batch, row_of, folds, n_pages = self._batch(work, page_table, rows, T)
        B, pos = batch.tokens.shape[0], batch.positions
        head = None
        if sample is not None:
            head = Sampler(sample.num_logprobs)
            emit = np.zeros((B,), np.bool_)
            emit[row_of] = sample.emit
            if folds is not None:
                full = np.zeros((B, *folds.shape[1:]), np.uint32)
                full[row_of] = folds
                folds = full
            # the position each row samples
            sample_rows = SampleRows(emit, pos.max(axis=1) + 1, folds, sample.allowed_rows(row_of, B))
        kind = ("prefill" if T > 1 else "decode") + ("+masks" if sample is not None and sample.allowed is not None else "")
        key = step_key(kind, B, T, n_pages, all_logits, decoder, head)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(key[0]):
            if head is not None:
                if self.mesh_step is not None:  # the same two programs as `engine_step`'s, shard-mapped
                    self.cache, logits, counts = self.mesh_step.step_logits(
                        self.params, self.cache, batch, self.sampling, model_rows(sample_rows), resolve=Sampler.resolve)
                    self.sampling, out = self.mesh_step.sample(head, logits, self.sampling, batch.slots,
                                                               sampler_rows(sample_rows))
                else:
                    batch, sample_rows = jax.tree.map(jnp.asarray, (batch, sample_rows))
                    self.cache, self.sampling, out, counts = engine_step(
                        self.params, self.cache, self.sampling, batch, sample_rows, config=self.config,
                        layout=self.layout, kernels=self.kernels, head=head)
                pending = PendingSamples(self, out, counts, row_of)
                logits = pending if defer else pending.fetch()
            elif self.mesh_step is not None:
                self.cache, logits, counts = self.mesh_step(self.params, self.cache, batch,
                                                            all_logits=all_logits, decoder=decoder)
            else:
                batch = jax.tree.map(jnp.asarray, batch)
                self.cache, logits, counts = forward_step(self.params, self.config, self.layout, self.cache, batch,
                                                          all_logits=all_logits, decoder=decoder, kernels=self.kernels)
            # pulling the results to the host each step (or, deferred, one step later) also keeps
            # the CPU backend's collectives from queueing up (they deadlock when too many are in
            # flight)
            if head is None:
                if defer and logits is None and isinstance(counts, jax.Array):  # an encoder-only pass
                    counts.copy_to_host_async()
                    self._unread_counts.append(counts)
                else:
                    self.expert_load += np.asarray(counts)
                    logits = None if logits is None else np.asarray(logits)[row_of]
        self._record(key, start, "" if decoder else " (encoder + decoder KV path)")
        return logits

    def run_scored(self, work: ChunkWork, page_table: np.ndarray, *, tokens: int, targets: np.ndarray,
                   num_logprobs: int, sample: StepSampling | None) -> tuple[PendingSamples | None, PendingSamples]:
        """A prefill chunk of one request that asked for prompt logprobs: the model
        step with logits at every position (`forward`, all logits), their scores against the
        next prompt tokens `targets [len(work.tokens)]` (`sampler.prompt_logprobs`) and, with
        `sample` (the chunk ends the request's input), the sampler on its last position. Returns
        the samples (None without `sample`) and the scores (`SampleOutput` fields `[1, tokens,
        ...]`), both on their way to the host; only scores and samples leave the device."""
        batch, row_of, _, n_pages = self._batch([work], page_table, 1, tokens)
        padded = np.zeros((1, tokens), np.int32)
        padded[0, :len(targets)] = targets
        head = None if sample is None else Sampler(sample.num_logprobs)
        key = scored_key(num_logprobs, len(batch.slots), tokens, n_pages, head)
        start = time.perf_counter()
        if self.mesh_step is not None:
            samples, scores = self._run_scored_on_mesh(batch, row_of, padded, num_logprobs, sample, head)
            self._record(key, start)
            return samples, scores
        programs = self._programs
        with jax.profiler.TraceAnnotation(key[0]):
            batch = jax.tree.map(jnp.asarray, batch)
            self.cache, logits, counts = programs.forward(self.params, self.cache, batch, all_logits=True,
                                                          decoder=True)
            scores = PendingSamples(self, programs.prompt_logprobs(logits, jnp.asarray(padded),
                                                                   num_logprobs=num_logprobs), counts, row_of)
            samples = None
            if sample is not None:
                rows = SampleRows(jnp.asarray(sample.emit, jnp.bool_), batch.positions.max(axis=1) + 1, None,
                                  None if sample.allowed is None else jnp.asarray(sample.allowed_rows(row_of, 1)))
                last = logits[jnp.arange(1), batch.last_index]
                self.sampling, out = programs.sample_logits(last, self.sampling, batch.slots, rows, head=head)
                # (the step's expert counts come with the scores: none here, so they count once)
                samples = PendingSamples(self, out, np.zeros_like(self.expert_load), row_of)
        self._record(key, start)
        return samples, scores

    def _run_scored_on_mesh(self, batch: StepBatch, row_of: list[int], targets: np.ndarray, num_logprobs: int,
                            sample: StepSampling | None, head: Sampler | None):
        """`run_scored` on a mesh: the mesh step with every position's logits (gathered over dp),
        the scores of the request's row, and with `sample` the mesh sampler on the rows' last
        positions (split over dp again, `MeshStep.last_logits`)."""
        mesh = self.mesh_step
        with jax.profiler.TraceAnnotation("prefill+prompt_logprobs"):
            self.cache, logits, counts = mesh(self.params, self.cache, batch, all_logits=True, decoder=True)
            row = mesh.take_row(logits, row_of[0])
            scores = _mesh_prompt_logprobs(row, mesh.replicate(targets), num_logprobs=num_logprobs)
            scores = PendingSamples(self, scores, counts, [0])
            samples = None
            if sample is not None:
                B = len(batch.slots)
                emit = np.zeros((B,), np.bool_)
                emit[row_of] = sample.emit
                rows = SampleRows(emit, batch.positions.max(axis=1) + 1, None, sample.allowed_rows(row_of, B))
                self.sampling, out = mesh.sample(head, mesh.last_logits(logits, batch.last_index), self.sampling,
                                                 batch.slots, sampler_rows(rows))
                samples = PendingSamples(self, out, np.zeros_like(self.expert_load), row_of)
        return samples, scores

    def _record(self, key: tuple, start: float, note: str = "") -> None:
        """Log the first run (the compilation) of a step shape."""
        if key not in self._compiled:
            self._compiled.add(key)
            self.compile_seconds[key] = time.perf_counter() - start
            log.info("compiled %s step for %d rows x %d tokens x %d pages%s in %.2f s (first call, incl. run)",
                     key[0], key[1], key[2], key[3], note, self.compile_seconds[key])

    def run_split(self, work: list[ChunkWork], page_table: np.ndarray) -> SplitStep:
        """Dispatch a decode step's model half (`device_step.step_logits`: every slot a row, one
        token each, placeholders allowed) without sampling; `SplitStep.sample` then dispatches
        its sampler, with settings (masks) the host may build meanwhile. On a mesh the same two
        programs shard-mapped (`MeshStep.step_logits`, `MeshStep.sample`)."""
        batch, row_of, folds, n_pages = self._batch(work, page_table, self.layout.slots_per_rank, 1)
        B = batch.tokens.shape[0]
        if folds is not None:
            full = np.zeros((B, *folds.shape[1:]), np.uint32)
            full[row_of] = folds
            folds = full
        position = batch.positions.max(axis=1) + 1
        rows = SampleRows(np.ones((B,), np.bool_), position, folds)
        key = step_key("decode/model", B, 1, n_pages, False, True, None)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation("decode/model"):
            if self.mesh_step is not None:
                self.cache, logits, counts = self.mesh_step.step_logits(self.params, self.cache, batch, self.sampling,
                                                                        rows, resolve=Sampler.resolve)
                slots = batch.slots
            else:
                batch_d, rows_d = jax.tree.map(jnp.asarray, (batch, rows))
                self.cache, logits, counts = self._programs.logits(self.params, self.cache, self.sampling, batch_d,
                                                                   rows_d)
                slots = batch_d.slots
        self._record(key, start)
        return SplitStep(self, logits, counts, slots, position, row_of, n_pages)

    def verify(self, work: list[ChunkWork], page_table: np.ndarray, num_drafts: list[int],
               host_drafts: list[list[int] | None], *, tokens: int, sample: StepSampling) -> VerifyOutput:
        """One DSpark verify step (`speculative`: propose, target, accept) over decode rows
        (`work`: each request's anchor), with `num_drafts` drafts each (the drafter's, or
        `host_drafts` where not None), padded to all slots x `tokens` (the anchor and room for
        the most drafts); waits for it and returns its `VerifyOutput` on the host, rows in
        `work`'s order."""
        step = self._verify_inputs(work, page_table, num_drafts, host_drafts, tokens, sample)
        key = step_key("verify" + ("+masks" if sample.allowed is not None else ""), step.rows, tokens, step.pages,
                       False, True, step.head)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation("verify"):
            proposal, verified, counts = self._propose_and_target(step)
            out = self._accept(step, proposal, verified, None)
        self._record(key, start)
        return self._verified(out, counts, step.row_of)

    def propose(self, work: list[ChunkWork], page_table: np.ndarray, num_drafts: list[int],
                host_drafts: list[list[int] | None], *, tokens: int, sample: StepSampling) -> ProposedDrafts:
        """A verify step whose acceptance waits for the host (`check`): the rows' drafts come
        to the host, for the masks it builds from them, while the target verifies them."""
        step = self._verify_inputs(work, page_table, num_drafts, host_drafts, tokens, sample)
        key = step_key("verify/propose", step.rows, tokens, step.pages, False, True, None)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation("verify/propose"):
            proposal, verified, counts = self._propose_and_target(step)
            drafts = host_value(proposal.drafts)[step.row_of]
        self._record(key, start)
        return ProposedDrafts(drafts, step, proposal, verified, counts)

    def check(self, proposed: ProposedDrafts, masks: np.ndarray) -> VerifyOutput:
        """Accept `proposed`'s drafts with each row's structured-output bitmask per verify
        position (`masks i32[len(work), tokens, W]`, all ones for unconstrained rows and
        positions); waits and returns the `VerifyOutput`."""
        step = proposed.step
        full = np.full((step.rows, *masks.shape[1:]), -1, np.int32)
        full[step.row_of] = masks
        T = full.shape[1]
        key = step_key("verify/check+masks", step.rows, T, step.pages, False, True, step.head)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation("verify/check"):
            out = self._accept(step, proposed.proposal, proposed.verified, self._device_rows(full))
        self._record(key, start)
        return self._verified(out, proposed.counts, step.row_of)

    def _propose_and_target(self, step: _VerifyInputs):
        """Dispatch the drafter's and the target's programs of a verify step (cache donated to
        the target's); returns the device's `DraftProposal`, `VerifiedLogits` and expert counts."""
        batch, rows, drafts_in = step.inputs
        programs = self._verify_programs
        proposal = programs.propose(self.params, self.cache, self.sampling, batch, model_rows(rows), drafts_in)
        self.cache, verified, counts = programs.target(self.params, self.cache, batch, drafts_in, proposal)
        return proposal, verified, counts

    def _accept(self, step: _VerifyInputs, proposal, verified, masks):
        """Dispatch a verify step's acceptance (cache and sampling state donated: the rollback,
        the gained tokens counted); returns the device's `VerifyOutput`."""
        batch, rows, drafts_in = step.inputs
        self.cache, self.sampling, out = self._verify_programs.accept(
            self.cache, self.sampling, batch, rows, drafts_in, proposal, verified, masks, head=step.head)
        return out

    def _verified(self, out: VerifyOutput, counts, row_of: list[int]) -> VerifyOutput:
        out, counts = jax.device_get((out, counts))
        self.expert_load += counts
        return jax.tree.map(lambda a: a[row_of], out)

    def _verify_inputs(self, work: list[ChunkWork], page_table: np.ndarray, num_drafts: list[int],
                       host_drafts: list[list[int] | None], tokens: int, sample: StepSampling) -> _VerifyInputs:
        """A verify step's device inputs (`verify`'s arguments)."""
        if not self.layout.draft_rings:
            raise ValueError("speculative decoding needs the drafter rings (CacheLayout.draft_rings)")
        K = tokens - 1
        # each row: the anchor, then a stand-in for each draft (the device writes the drafts)
        rows_work = [ChunkWork(w.slot, np.concatenate([w.tokens[:1], np.zeros(n, np.int32)]), w.start, w.history,
                               w.floor) for w, n in zip(work, num_drafts)]
        batch, row_of, _, n_pages = self._batch(rows_work, page_table, self.layout.slots_per_rank, tokens)
        B = batch.tokens.shape[0]
        emit = np.zeros((B,), np.bool_)
        emit[row_of] = sample.emit
        drafts_in = DraftInputs(np.zeros((B,), np.int32), np.zeros((B, K), np.int32), np.zeros((B,), np.bool_),
                                self._draft_folds(work, row_of, B, K))
        for b, n, host in zip(row_of, num_drafts, host_drafts):
            drafts_in.num_drafts[b] = n
            if host is not None:
                if len(host) != n:
                    raise ValueError(f"{len(host)} host drafts for a row that verifies {n}")
                drafts_in.host_drafts[b, :n] = host
                drafts_in.use_host[b] = True
        # the anchor's next position; a constrained row that verifies no drafts samples under its mask
        rows = SampleRows(emit, batch.positions[:, 0] + 1, allowed=sample.allowed_rows(row_of, B))
        inputs = self._device_rows((batch, rows, drafts_in))
        return _VerifyInputs(inputs, row_of, B, n_pages, Sampler(sample.num_logprobs))

    def _device_rows(self, tree):
        """A verify step's host inputs on the device (on a mesh: global arrays, rows over dp)."""
        if self.mesh_step is not None:
            return self._verify_programs.place(tree)
        return jax.tree.map(jnp.asarray, tree)

    def _draft_folds(self, work: list[ChunkWork], row_of: list[int], B: int, K: int) -> np.ndarray | None:
        """The host's part of the Engram folds of K drafts after each row's anchor
        (`EngramHasher.draft_folds`), `[B, K, ...]`; None without Engram."""
        if not self.config.engram_layer_ids:
            return None
        hasher = hasher_for(self.config)
        folds = np.zeros((B, K, hasher.n_layers, hasher.max_ngram - 1, 2), np.uint32)
        for b, w in zip(row_of, work):
            context = np.concatenate([w.history, w.tokens[:1]])
            folds[b] = hasher.draft_folds(hasher.compress(context), K)
        return folds

    def read_counts(self) -> np.ndarray:
        """`expert_load` with the counts of deferred encoder-only passes added (waits for them)."""
        for counts in self._unread_counts:
            self.expert_load += np.asarray(counts)
        self._unread_counts.clear()
        return self.expert_load

    def draft(self, slots, anchors, anchor_positions, floors=None) -> dict[str, np.ndarray]:
        """Greedy DSpark drafts (`model.drafter.draft_from_cache`) for the sequences in global
        cache `slots`, whose target has processed positions < `anchor_positions` and sampled
        `anchors`: tokens, logits and confidence `[len(slots), block, ...]` on the host."""
        args = [jnp.asarray(a, jnp.int32) for a in (slots, anchors, anchor_positions)]
        out = draft_from_cache(self.params, self.config, self.layout, self.cache, *args,
                               None if floors is None else jnp.asarray(floors, jnp.int32), self.kernels)
        return {k: np.asarray(v) for k, v in out.items()}

    def apply_expert_layout(self, phy2log: np.ndarray, log2phy: np.ndarray, count: np.ndarray,
                            max_replicas: int) -> None:
        """Install an EPLB layout (`[layers, ...]` arrays) between steps: every layer's routed
        experts become physical slots built from the logical weights, placed like any experts."""
        from deepinfer.sharding.expert_placement import with_placement

        if self._logical_ffn is None:
            raise ValueError("this runner was built without keep_logical_experts=True: it cannot install EPLB layouts")
        layers = list(self.params["layers"])
        for layer, ffn in enumerate(self._logical_ffn):
            new = with_placement(ffn, phy2log[layer], log2phy[layer], count[layer], max_replicas)
            if self.mesh_step is not None:
                new = self.mesh_step.place_params({"layers": [{"ffn": new}]})["layers"][0]["ffn"]
            layers[layer] = {**layers[layer], "ffn": new}
        self.params = {**self.params, "layers": layers}

    def runner_cache_entries(self) -> list[np.ndarray]:
        """Host copies of every source's compressed entries (first codec array), for tests."""
        return [np.asarray(e[0]) for e in self.cache.entries]
