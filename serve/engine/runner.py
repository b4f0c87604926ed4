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
    history: np.ndarray  # the sequence's tokens before `start` (for Engram look-back)
    floor: int = 0  # decoder replay start of the sequence (compact prefill); 0 = full fidelity


def token_bucket(n: int, minimum: int = 128) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


class ModelRunner:
    """Owns the params and the device cache; every step donates and replaces the cache."""

    def __init__(self, params: dict, config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None = None):
        self.params = params
        self.config = config
        self.layout = layout
        self.kernels = kernels
        self.cache = init_cache(config, layout)
        self._compiled: set = set()
        self.compile_seconds: dict[tuple, float] = {}

    def reset(self, slots: list[int]) -> None:
        if slots:
            self.cache = reset_slots(self.cache, jnp.asarray(slots, jnp.int32))

    def _hash_ids(self, work: list[ChunkWork], T: int) -> np.ndarray | None:
        if not self.config.engram_layer_ids:
            return None
        lookback = self.config.engram_max_ngram_size - 1
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
        """Run one step over `work` padded to `rows` x `tokens`; returns fp32 logits
        `[len(work), vocab]` at each row's last token (or `[len(work), tokens, vocab]`); None for
        a compact-prefill chunk below the replay floor (`decoder=False`)."""
        B, T = rows, tokens
        longest = max(w.start + len(w.tokens) for w in work)
        n_pages = min(self.layout.max_pages_per_slot,
                      token_bucket(-(-longest // self.layout.page_size), minimum=1))
        tok = np.zeros((B, T), np.int32)
        pos = np.full((B, T), -1, np.int32)
        slots = np.zeros((B,), np.int32)
        last = np.zeros((B,), np.int32)
        floor = np.zeros((B,), np.int32)
        table = np.full((B, n_pages), -1, np.int32)
        used = set()
        for b, w in enumerate(work):
            n = len(w.tokens)
            tok[b, :n] = w.tokens
            pos[b, :n] = np.arange(w.start, w.start + n)
            slots[b] = w.slot
            last[b] = n - 1
            floor[b] = w.floor
            table[b] = page_table[w.slot, :n_pages]
            used.add(w.slot)
        # padding rows point at an unused slot with no pages: they write nothing (positions -1)
        spare = next((s for s in range(self.layout.num_slots) if s not in used), 0)
        slots[len(work):] = spare
        hash_ids = self._hash_ids(work, T)
        if hash_ids is not None and len(work) < B:
            hash_ids = np.concatenate([hash_ids, np.zeros((B - len(work), *hash_ids.shape[1:]), np.int32)])
        batch = StepBatch(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(slots), jnp.asarray(table),
                          None if hash_ids is None else jnp.asarray(hash_ids), jnp.asarray(last), jnp.asarray(floor))
        key = ("prefill" if T > 1 else "decode", B, T, n_pages, all_logits, decoder)
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(key[0]):
            self.cache, logits = forward_step(self.params, self.config, self.layout, self.cache, batch,
                                              all_logits=all_logits, decoder=decoder, kernels=self.kernels)
            logits = None if logits is None else np.asarray(logits[: len(work)])
            if logits is None:
                jax.block_until_ready(self.cache)
        if key not in self._compiled:
            self._compiled.add(key)
            self.compile_seconds[key] = time.perf_counter() - start
            log.info("compiled %s step for %d rows x %d tokens x %d pages%s in %.2f s (first call, incl. run)",
                     key[0], B, T, n_pages, "" if decoder else " (encoder + decoder KV path)",
                     self.compile_seconds[key])
        return logits

    def runner_cache_entries(self) -> list[np.ndarray]:
        """Host copies of every source's compressed entries (first codec array), for tests."""
        return [np.asarray(e[0]) for e in self.cache.entries]
