"""The model runner: turns scheduled work into padded, bucketed `StepBatch`es, runs the jitted
steps on the device cache (donated), and logs the compile time of every new shape bucket.

Shapes are static per bucket: prefill rows are padded to a power-of-two token count (from 128),
decode always runs all slots with one token each (inactive slots are padding rows).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import draft_from_cache, has_drafter
from deepinfer.model.forward import engram_hash_ids
from deepinfer.model.kv_cache import CacheLayout, init_cache, reset_slots
from deepinfer.model.step import StepBatch, forward_step
from deepinfer.pallas_kernels.registry import KernelConfig

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


def token_bucket(n: int, minimum: int = 128) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


def _device_of(params: dict):
    """The one device all of `params` live on, or None (JAX's default device)."""
    devices = {d for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}
    return devices.pop() if len(devices) == 1 else None


class ModelRunner:
    """Owns the params and the device cache; every step donates and replaces the cache.

    With a `mesh`, the step runs shard-mapped over it (`sharding.engine_step.MeshStep`): rows
    are grouped by their slot's dp rank and carry local slot ids. It also accumulates how many
    tokens each layer routed to each expert (`expert_load`, for EPLB)."""

    def __init__(self, params: dict, config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None = None,
                 mesh=None, keep_logical_experts: bool = False):
        self.config = config
        self.layout = layout
        self.kernels = kernels
        self.mesh_step = None
        if layout.draft_rings and not has_drafter(params, config):
            raise ValueError("the cache layout keeps drafter rings (draft_rings > 0) but the params have no DSpark "
                             "drafter (`mtp.*` of a DeepSeek-V4.1 checkpoint)")
        # what EPLB layouts are built from (kept only when asked: a second copy of the experts)
        self._logical_ffn = [lp["ffn"] for lp in params["layers"]] if keep_logical_experts else None
        if mesh is not None:
            from deepinfer.sharding.engine_step import MeshStep

            self.mesh_step = MeshStep(mesh, config, layout, kernels)
            self.params = self.mesh_step.place_params(params)
            self.cache = self.mesh_step.init_cache()
        else:
            self.params = params
            with jax.default_device(_device_of(params)):  # the cache goes where the params are
                self.cache = init_cache(config, layout)
        self.expert_load = np.zeros((config.num_hidden_layers, config.n_routed_experts), np.int64)
        self._compiled: set = set()
        self.compile_seconds: dict[tuple, float] = {}

    def reset(self, slots: list[int]) -> None:
        if not slots:
            return
        if self.mesh_step is not None:
            self.cache = self.mesh_step.reset(self.cache, slots)  # global slot ids are rank-major
        else:
            self.cache = reset_slots(self.cache, jnp.asarray(slots, jnp.int32))

    @property
    def lookback(self) -> int:
        """Tokens before a chunk that its Engram hashes read (N-1 of the n-grams; 0 without Engram)."""
        return self.config.engram_max_ngram_size - 1 if self.config.engram_layer_ids else 0

    def _hash_ids(self, work: list[ChunkWork], T: int) -> np.ndarray | None:
        if not self.config.engram_layer_ids:
            return None
        lookback = self.lookback
        rows = []
        for w in work:
            # the n-grams ending in the chunk reach back `lookback` tokens; a shorter history is
            # the sequence start, where the hasher pads (sticky), as in the full forward
            context = np.concatenate([w.history[max(0, len(w.history) - lookback):], w.tokens])
            ids = engram_hash_ids(self.config, context[None])[0][len(context) - len(w.tokens):]
            pad = np.zeros((T - len(w.tokens), *ids.shape[1:]), np.int32)
            rows.append(np.concatenate([ids, pad]))
        return np.stack(rows)

    def run(self, work: list[ChunkWork], page_table: np.ndarray, *, rows: int, tokens: int,
            all_logits: bool = False, decoder: bool = True) -> np.ndarray | None:
        """Run one step over `work` padded to `rows` rows PER dp RANK x `tokens`; returns fp32
        logits `[len(work), vocab]` at each row's last token (or `[len(work), tokens, vocab]`),
        in `work`'s order; None for a compact-prefill chunk below the replay floor
        (`decoder=False`)."""
        T, per_rank, dp = tokens, self.layout.slots_per_rank, self.layout.dp
        B = rows * dp
        longest = max(w.start + len(w.tokens) for w in work)
        n_pages = min(self.layout.max_pages_per_slot,
                      token_bucket(-(-longest // self.layout.page_size), minimum=1))
        tok = np.zeros((B, T), np.int32)
        pos = np.full((B, T), -1, np.int32)
        slots = np.zeros((B,), np.int32)
        last = np.zeros((B,), np.int32)
        floor = np.zeros((B,), np.int32)
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
            table[b] = page_table[w.slot, :n_pages]
            used[rank].add(local)
        # padding rows point at a slot of their rank that no row uses: they write nothing
        # (positions -1) and never race a real row's scatter into the same slot
        for rank in range(dp):
            spare = next((s for s in range(per_rank) if s not in used[rank]), 0)
            slots[rank * rows + filled[rank]:(rank + 1) * rows] = spare
        hash_ids = self._hash_ids(work, T)
        if hash_ids is not None:
            full = np.zeros((B, *hash_ids.shape[1:]), np.int32)
            full[row_of] = hash_ids
            hash_ids = full
        batch = StepBatch(tok, pos, slots, table, hash_ids, last, floor)
        key = ("prefill" if T > 1 else "decode", B, T, n_pages, all_logits, decoder)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(key[0]):
            if self.mesh_step is not None:
                self.cache, logits, counts = self.mesh_step(self.params, self.cache, batch,
                                                            all_logits=all_logits, decoder=decoder)
            else:
                batch = jax.tree.map(jnp.asarray, batch)
                self.cache, logits, counts = forward_step(self.params, self.config, self.layout, self.cache, batch,
                                                          all_logits=all_logits, decoder=decoder, kernels=self.kernels)
            # pulling the results to the host each step also keeps the CPU backend's collectives
            # from queueing up (they deadlock when too many are in flight)
            self.expert_load += np.asarray(counts)
            logits = None if logits is None else np.asarray(logits)[row_of]
        if key not in self._compiled:
            self._compiled.add(key)
            self.compile_seconds[key] = time.perf_counter() - start
            log.info("compiled %s step for %d rows x %d tokens x %d pages%s in %.2f s (first call, incl. run)",
                     key[0], B, T, n_pages, "" if decoder else " (encoder + decoder KV path)",
                     self.compile_seconds[key])
        return logits

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
