"""The engine step on a device mesh: attention data parallel for the cache and the attention,
expert parallel for the MoE (DeepSeek's "DP attention + EP MoE").

Each `dp` rank owns `num_slots / dp` slots and `num_pages / dp` pages of the cache (rank-major
shares). A step's rows are grouped by rank and carry LOCAL slot and page ids, so a sequence's
attention never leaves its rank. Ranks along `cp` and `tp` hold the same rows (the attention is
replicated there) except in prefill: with `cp` > 1 a prefill chunk's queries are split over the
`cp` ranks by the zigzag scheme (rank r holds blocks r and 2*cp-1-r, equal causal work; a chunk
whose length is no multiple of 2*cp is padded with position -1 tokens first), the
window keys, ring writes and compressor run on the gathered chunk (`model.step._Chunk`); not with
`kernels.batch_invariant` (deterministic mode), whose step, and sampler, run in fixed tiles
(`ops.batch_invariant`) on whole rows. The MoE
spreads every rank's tokens over all devices, which hold `experts / devices` experts each,
through `ExpertParallel`. The logits are gathered over `dp` so
every process (multi-host included) sees all rows, and the expert counts are summed over `dp`.
A sampling step is two programs, as on one device (`serve.engine.device_step`): `step_logits`
(placeholder tokens resolved from the per-slot state, then the model) leaves each rank's
last-token logits on its devices, and `sample` runs the engine's sampler on them and the rank's
per-slot state, gathering only its per-row outputs (sampled tokens) over dp. So the model is
compiled once per step shape: asking for log-probabilities or structured-output masks selects
another small sampler program, never another copy of the model.

All device inputs are built as global arrays with `make_array_from_callback`, which is what
JAX's multi-controller runtime needs: every process runs the same host code on the same data.
"""

from __future__ import annotations

import collections
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from deepinfer.model.config import ModelConfig
from deepinfer.model.kv_cache import CacheLayout, KVCache, init_cache, padded_slot_ids, reset_slots
from deepinfer.model.step import StepBatch, step_body
from deepinfer.ops.batch_invariant import batch_invariant, compiler_options
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.sharding.context_parallel import zigzag_slots
from deepinfer.sharding.cp_forward import ZigzagShards
from deepinfer.sharding.distributed import barrier
from deepinfer.sharding.expert_parallel import ExpertParallel
from deepinfer.sharding.mesh import AXES

EP_AXES = AXES  # experts shard over every device


def _is_expert_leaf(path) -> bool:
    keys = [getattr(k, "key", None) for k in path]
    return "experts" in keys and "shared_experts" not in keys


def params_specs(params) -> dict:
    """Routed-expert weights split their leading (physical expert) dim over all devices; every
    other parameter is replicated."""
    return jax.tree_util.tree_map_with_path(lambda path, _: P(EP_AXES) if _is_expert_leaf(path) else P(), params)


def cache_specs(cache: KVCache) -> KVCache:
    """Window rings `[L, S, ...]` split their slot dim, everything else its leading dim, over dp."""
    return KVCache(
        window=tuple(P(None, "dp") for _ in cache.window),
        window_pos=P("dp"),
        entries=tuple(tuple(P("dp") for _ in e) for e in cache.entries),
        index_keys=tuple(tuple(P("dp") for _ in k) for k in cache.index_keys),
        pending=tuple(P("dp") for _ in cache.pending),
    )


def batch_specs(batch: StepBatch, split: bool) -> StepBatch:
    """Rows over dp; with `split` (context-parallel prefill) the token axis of the per-token
    fields over cp as well."""
    tokens = P("dp", "cp") if split else P("dp")
    per_token = {"tokens", "positions", "hash_ids"}
    return StepBatch(**{f.name: None if getattr(batch, f.name) is None else (tokens if f.name in per_token else P("dp"))
                        for f in dataclasses.fields(batch)})


def zigzag_rows(batch: StepBatch, cp: int) -> StepBatch:
    """Each row's tokens in rank-major zigzag order (`context_parallel.zigzag_slots`), the rows
    first padded to a multiple of 2*cp with token 0 at position -1: like a row's own padding,
    those tokens attend to nothing, are seen by nothing and write nothing to the cache."""
    T = batch.tokens.shape[1]
    order = zigzag_slots(T, cp)

    def permute(a: np.ndarray | None, fill: int) -> np.ndarray | None:
        if a is None:
            return None
        padded = np.full((a.shape[0], len(order), *a.shape[2:]), fill, a.dtype)
        padded[:, :T] = a
        return padded[:, order]

    return dataclasses.replace(batch, tokens=permute(batch.tokens, 0), positions=permute(batch.positions, -1),
                               hash_ids=permute(batch.hash_ids, 0))


def to_global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds in full."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class MeshStep:
    """Places params and cache on `mesh` and runs the jitted, shard-mapped step."""

    def __init__(self, mesh: Mesh, config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None = None,
                 ep_method: str | None = None):
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"the engine mesh must have axes {AXES}, got {tuple(mesh.axis_names)}")
        if layout.dp != mesh.shape["dp"]:
            raise ValueError(f"cache layout dp={layout.dp} differs from the mesh's dp={mesh.shape['dp']}")
        self.mesh, self.config, self.layout, self.kernels = mesh, config, layout, kernels
        self.invariant = kernels is not None and kernels.batch_invariant  # deterministic mode
        # the XLA options of the step's programs (the batch-invariant ones': `compiler_options`)
        self.options = (compiler_options(mesh.devices.flat[0].platform) or None) if self.invariant else None
        on_cpu = mesh.devices.flat[0].platform == "cpu"  # the mesh's accelerator, not JAX's default one
        method = ep_method or ("all_to_all" if on_cpu else "ragged_all_to_all")
        self.ep = ExpertParallel(axes=EP_AXES, method=method, replicated_axes=("cp", "tp"))
        self.cp = mesh.shape["cp"]
        self.ep_cp = ExpertParallel(axes=EP_AXES, method=method, replicated_axes=("tp",))
        self._replicated = NamedSharding(mesh, P())
        self._take_last = jax.jit(_take_last, out_shardings=NamedSharding(mesh, P("dp")))
        self._steps: dict[tuple, object] = {}
        # prefill row length -> query tokens per cp rank of the last such step
        self.queries_per_rank: dict[int, int] = {}

    # ---- placement ----------------------------------------------------------------------
    def place_params(self, params: dict) -> dict:
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):  # the layers' and the drafter's
            if _is_expert_leaf(path) and np.shape(leaf)[0] % self.mesh.size:
                raise ValueError(f"{np.shape(leaf)[0]} routed experts ({jax.tree_util.keystr(path)}) cannot be split "
                                 f"over {self.mesh.size} devices (expert parallelism needs a multiple of the device count)")
        specs = params_specs(params)
        return jax.tree.map(lambda x, spec: to_global(np.asarray(x), NamedSharding(self.mesh, spec)), params, specs)

    def replicate(self, tree):
        """Host values (the same in every process) as global arrays replicated over the mesh."""
        return jax.tree.map(lambda a: to_global(a, self._replicated), tree)

    def place_rows(self, tree):
        """Host values whose leaves lead with a step's rows (grouped by rank) as global arrays
        split over dp."""
        return jax.tree.map(lambda a: to_global(a, NamedSharding(self.mesh, P("dp"))), tree)

    def per_slot_shardings(self, tree):
        """Shardings of a pytree whose leaves' leading dim is the (global, rank-major) slot: split
        over dp like the cache's slots."""
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P("dp")), tree)

    def init_cache(self) -> KVCache:
        abstract = jax.eval_shape(partial(init_cache, self.config, self.layout))
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), cache_specs(abstract))
        return jax.jit(partial(init_cache, self.config, self.layout), out_shardings=shardings)()

    def reset(self, cache: KVCache, slots: list[int]) -> KVCache:
        return _reset(cache, to_global(padded_slot_ids(slots, self.layout.num_slots), self._replicated))

    # ---- the step -----------------------------------------------------------------------
    def __call__(self, params: dict, cache: KVCache, batch: StepBatch, *, all_logits: bool, decoder: bool):
        """`batch` holds host arrays, rows grouped by dp rank, local slot and page ids. Returns
        `(cache, logits gathered over dp or None without the decoder, counts)`."""
        T, split = batch.tokens.shape[1], self._split(batch)
        key = (all_logits, decoder, split, jax.tree.map(np.shape, batch))
        batch = self._place(batch, split)
        if key not in self._steps:
            args = (params, cache, batch)
            self._steps[key] = self.compile(self._build(all_logits, decoder, split, args), args,
                                            f"deepinfer step {all_logits} {decoder} {batch.tokens.shape}")
        cache, logits, counts = self._steps[key](params, cache, batch)
        if split and all_logits:
            logits = logits[:, :T]  # the padding columns
        return cache, (logits if decoder else None), counts

    def step_logits(self, params: dict, cache: KVCache, batch: StepBatch, state, rows, *, resolve):
        """The model half of a sampling step: `resolve(batch, state, rows, config)` fills the
        placeholder tokens from the per-slot `state` (leaves `[slots, ...]` split over dp, placed
        by `per_slot_shardings`; read only), then the model. `rows` are host arrays `[B, ...]`
        grouped like `batch`'s rows. Returns `(cache, last-token logits [B, vocab] split over dp
        and left on the devices, counts)` for `sample`."""
        split = self._split(batch)
        key = ("logits", split, resolve, jax.tree.map(np.shape, batch), jax.tree.map(np.shape, rows))
        batch, rows = self._place(batch, split), self.place_rows(rows)
        args = (params, cache, batch, state, rows)
        if key not in self._steps:
            self._steps[key] = self.compile(self._build(False, True, split, args, resolve=resolve), args,
                                            f"deepinfer step logits {batch.tokens.shape}")
        return self._steps[key](*args)

    def sample(self, head, logits: jax.Array, state, slots: np.ndarray, rows):
        """The sampler half: `head(logits, state, slots, rows) -> (state, outputs)` on each rank's
        rows (`slots`: the step batch's local slot ids, host `[B]`; `rows`: host arrays `[B, ...]`),
        `state` donated; returns `(state, outputs gathered over dp)`."""
        key = ("sample", head, logits.shape, jax.tree.map(np.shape, rows))
        args = (logits, state, self.place_rows(slots), self.place_rows(rows))
        if key not in self._steps:
            # in deterministic mode the sampler runs in fixed tiles too
            run = batch_invariant(head) if self.invariant else head

            def body(logits, state, slots, rows):  # every (cp, tp) replica of a rank runs it alike
                state, out = run(logits, state, slots, rows)
                return state, jax.tree.map(lambda a: jax.lax.all_gather(a, "dp", axis=0, tiled=True), out)

            rank = lambda tree: jax.tree.map(lambda _: P("dp"), tree)
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(P("dp"), rank(state), P("dp"), rank(args[3])),
                                   out_specs=(rank(state), P()), check_vma=False)
            jitted = jax.jit(mapped, donate_argnums=(1,), compiler_options=self.options)
            self._steps[key] = self.compile(jitted, args, f"deepinfer sampler {head} {logits.shape}")
        return self._steps[key](*args)

    def take_row(self, logits: jax.Array, row: int) -> jax.Array:
        """Row `row` of a step's gathered logits `[B, T, vocab]` as `[1, T, vocab]`, replicated."""
        return _take_row(logits, self.replicate(np.int32(row)))

    def last_logits(self, logits: jax.Array, last_index: np.ndarray) -> jax.Array:
        """Each row's logits at its `last_index` from a step's gathered logits `[B, T, vocab]`,
        split over dp as `step_logits` leaves them (for `sample`)."""
        return self._take_last(logits, self.replicate(last_index))

    def program_counts(self) -> dict[str, int]:
        """How many programs this mesh step compiled, by kind: "step" (logits to the host),
        "logits" (the model half of a sampling step) and "sample" (its sampler half)."""
        return dict(collections.Counter(key[0] if isinstance(key[0], str) else "step" for key in self._steps))

    def _split(self, batch: StepBatch) -> bool:
        """Whether the step splits its tokens over cp: prefill with cp > 1; the batch-invariant
        step has no context-parallel path (`model.step._invariant`): its prefill chunks run
        whole on every cp replica, as decode steps do."""
        return self.cp > 1 and batch.tokens.shape[1] > 1 and not self.invariant

    def _place(self, batch: StepBatch, split: bool) -> StepBatch:
        T = batch.tokens.shape[1]
        if split:
            batch = zigzag_rows(batch, self.cp)
        specs = batch_specs(batch, split)
        batch = jax.tree.map(lambda a, spec: to_global(a, NamedSharding(self.mesh, spec)), batch, specs)
        if split:  # what each device really got (the tests check the work is split)
            self.queries_per_rank[T] = batch.tokens.addressable_shards[0].data.shape[1]
        return batch

    def compile(self, jitted, args: tuple, label: str):
        """`jitted` compiled for `args` ahead of its first run; with many processes, wait for all
        of them before it runs (a process still compiling would leave the others' first
        collective waiting past the CPU collectives' 30 s rendezvous deadline)."""
        compiled = jitted.lower(*args).compile()
        barrier(label)
        return compiled

    def _build(self, all_logits: bool, decoder: bool, split: bool, args: tuple, resolve=None):
        """The jitted, shard-mapped model step over `args` (params, cache, batch, and with
        `resolve` the per-slot state and rows it fills the placeholder tokens from): returns the
        cache, the logits (with `resolve`: split over dp; else gathered) and the expert counts."""
        config, layout, kernels = self.config, self.layout, self.kernels
        ep, seq = (self.ep_cp, ZigzagShards(self.cp)) if split else (self.ep, None)

        def body(params, cache, batch, *extra):
            if resolve is not None:  # placeholder tokens from the rank's own slots' last samples
                batch = resolve(batch, *extra, config)
            cache, logits, counts = step_body(params, cache, batch, config=config, layout=layout,
                                              all_logits=all_logits, decoder=decoder, kernels=kernels, ep=ep,
                                              seq=seq)
            # counts: tokens differ over dp (and over cp when split), are replicated elsewhere
            counts = jax.lax.psum(counts, ("dp", "cp") if split else "dp")
            if resolve is not None:  # the rank's rows, for `sample` (every cp, tp replica alike)
                return cache, logits, counts
            if logits is None:
                logits = jnp.zeros((0,), jnp.float32)
            else:
                logits = jax.lax.all_gather(logits, "dp", axis=0, tiled=True)
            return cache, logits, counts

        params, cache, batch, *extra = args
        in_specs = (params_specs(params), cache_specs(cache), batch_specs(batch, split))
        in_specs += tuple(jax.tree.map(lambda _: P("dp"), tree) for tree in extra)
        out_specs = (cache_specs(cache), P("dp") if resolve is not None else P(), P())
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        return jax.jit(mapped, donate_argnums=(1,), compiler_options=self.options)


@jax.jit
def _take_row(logits: jax.Array, row: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(logits, row, axis=0, keepdims=True)


def _take_last(logits: jax.Array, last_index: jax.Array) -> jax.Array:
    return logits[jnp.arange(logits.shape[0]), last_index]


@partial(jax.jit, donate_argnums=(0,))
def _reset(cache: KVCache, slots: jax.Array) -> KVCache:
    return reset_slots(cache, slots)
