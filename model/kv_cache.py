"""The device-side cache of DeepSeek-V4.1 as a pytree, and how rows are stored in it.

What is cached (model-v4.1-flash.md §3):
- per slot (sequence), bounded: every layer's 128-token sliding-window ring, then (with
  `draft_rings`) one ring per DSpark draft block holding its context KV (`model.drafter`), one
  shared `window_pos` row of positions (-1 = empty), and the ratio-2 sources' pending unpaired
  token (its fp32 `kv` and `gate`);
- global, paged, growing with context: each KV source's compressed entries and indexer keys.
  A page holds `page_size` TOKENS of context, i.e. `page_size // ratio` entries of a source, so
  one page table per sequence addresses every source's pool (890 B per token for the release).

Rows are stored through a codec. With the QAT fake-quant on, every cached value already lies on
its low-precision grid, so the packed formats are lossless: FP8 e4m3 + UE8M0 per 32 for the
window (528 B per token and layer), FP4 e2m1 + e4m3 per 16 for entries (288 B), FP4 + UE8M0 per
32 for indexer keys (68 B). With it off (exact float tests) rows are kept in the compute dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.model.params import compute_dtype
from deepinfer.ops.cache_codec import FLOAT, PACKED, decode, encode, row_shapes  # noqa: F401  (the cache's codec)


@dataclass(frozen=True)
class CacheLayout:
    """Static shape of a cache (hashable: a jit static argument)."""

    num_slots: int
    page_size: int  # tokens per page
    num_pages: int
    max_pages_per_slot: int
    storage: str = PACKED  # PACKED (fake-quant on) or FLOAT
    # attention data-parallel ranks: slots and pages split into `dp` equal, rank-major shares;
    # a sequence's page table holds page ids LOCAL to its rank's share
    dp: int = 1
    # window rings of the DSpark draft blocks after the layers' (0: no drafter context kept)
    draft_rings: int = 0

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.dp

    @property
    def pages_per_rank(self) -> int:
        return self.num_pages // self.dp

    @property
    def max_len(self) -> int:
        return self.page_size * self.max_pages_per_slot


def check_layout(config: ModelConfig, layout: CacheLayout) -> None:
    if config.is_v4:
        raise NotImplementedError("the paged cache serves DeepSeek-V4.1; DeepSeek-V4 runs only the full forward")
    for s in config.kv_source_layer_ids:
        r = config.compress_ratios[s]
        if layout.page_size % (r * config.candidate_block_size):
            raise ValueError(f"page_size {layout.page_size} must be a multiple of ratio x candidate block "
                             f"({r} x {config.candidate_block_size})")
    if layout.dp < 1 or layout.num_slots % layout.dp or layout.num_pages % layout.dp:
        raise ValueError(f"num_slots ({layout.num_slots}) and num_pages ({layout.num_pages}) must be multiples "
                         f"of the data-parallel size dp={layout.dp}")
    if layout.draft_rings not in (0, config.num_nextn_predict_layers) or (
            layout.draft_rings and not config.dspark_target_layer_ids):
        raise ValueError(f"draft_rings must be 0 or the {config.num_nextn_predict_layers} DSpark blocks of a "
                         f"config with dspark_target_layer_ids, got {layout.draft_rings}")
    if layout.storage == PACKED and not config.fake_quant:
        raise ValueError("packed (FP8/FP4) cache rows are exact only with fake_quant on; use storage='float'")


# ---- the pytree ------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Device arrays; see the module docstring. Tuples are indexed by source order
    (`config.kv_source_layer_ids`); `pending` by ratio-2 sources in that order."""

    window: tuple[jax.Array, ...]  # each [L + draft_rings, S, W, ...]
    window_pos: jax.Array  # [S, W] int32
    entries: tuple[tuple[jax.Array, ...], ...]  # per source: each [P, page_size // ratio, ...]
    index_keys: tuple[tuple[jax.Array, ...], ...]
    pending: tuple[jax.Array, ...]  # per ratio-2 source: [S, 2, head_dim] f32 (kv, gate)


def pending_sources(config: ModelConfig) -> list[int]:
    return [s for s in config.kv_source_layer_ids if config.compress_ratios[s] > 1]


def init_cache(config: ModelConfig, layout: CacheLayout) -> KVCache:
    check_layout(config, layout)
    dtype = compute_dtype(config)
    L, S, W = config.num_hidden_layers + layout.draft_rings, layout.num_slots, config.sliding_window

    def zeros(shapes, lead):
        # e8m0 has no zero (0 casts to NaN): empty rows get scale 1 so they decode to finite 0
        return tuple(jnp.ones((*lead, *shape), dt) if dt == jnp.float8_e8m0fnu else jnp.zeros((*lead, *shape), dt)
                     for shape, dt in shapes)

    window = zeros(row_shapes("window", config.head_dim, layout.storage, dtype), (L, S, W))
    entries, keys = [], []
    for s in config.kv_source_layer_ids:
        per_page = layout.page_size // config.compress_ratios[s]
        entries.append(zeros(row_shapes("entry", config.head_dim, layout.storage, dtype), (layout.num_pages, per_page)))
        keys.append(zeros(row_shapes("index", config.index_head_dim, layout.storage, dtype),
                          (layout.num_pages, per_page)))
    pending = tuple(jnp.zeros((S, 2, config.head_dim), jnp.float32) for _ in pending_sources(config))
    return KVCache(window, jnp.full((S, W), -1, jnp.int32), tuple(entries), tuple(keys), pending)


def bytes_per_token(config: ModelConfig, layout: CacheLayout) -> float:
    """Global (paged) bytes per context token in this layout (890 for the release, packed)."""
    total = 0.0
    for s in config.kv_source_layer_ids:
        for kind, width in (("entry", config.head_dim), ("index", config.index_head_dim)):
            for shape, dt in row_shapes(kind, width, layout.storage, compute_dtype(config)):
                total += shape[0] * jnp.dtype(dt).itemsize / config.compress_ratios[s]
    return total


def slot_bytes(config: ModelConfig, layout: CacheLayout) -> int:
    """Bounded per-slot bytes: window rings of every layer (and draft block), their positions,
    pending state."""
    total = config.sliding_window * 4
    rings = config.num_hidden_layers + layout.draft_rings
    for shape, dt in row_shapes("window", config.head_dim, layout.storage, compute_dtype(config)):
        total += rings * config.sliding_window * shape[0] * jnp.dtype(dt).itemsize
    return total + len(pending_sources(config)) * 2 * config.head_dim * 4


def padded_slot_ids(slots, num_slots: int) -> np.ndarray:
    """int32 `[num_slots]`: `slots` then ids past the end (no-ops for `reset_slots` and the
    sampling-state writers), so one program serves any number of slots."""
    padded = np.full((num_slots,), num_slots, np.int32)
    padded[: len(slots)] = slots
    return padded


def reset_slots(cache: KVCache, slots: jax.Array) -> KVCache:
    """Forget the window and pending state of `slots` (a new sequence starts there); slot ids
    past the end are padding and change nothing."""
    return dataclasses.replace(cache, window_pos=cache.window_pos.at[slots].set(-1, mode="drop"),
                               pending=tuple(p.at[slots].set(0.0, mode="drop") for p in cache.pending))
