"""One engine step of DeepSeek-V4.1 over a batch of token chunks, reading and updating the cache.

The same function serves chunked prefill (a few rows, many tokens) and decode (many rows, one
token): each row is a run of consecutive positions of one sequence (`positions`, -1 = padding
after the run) in cache slot `slots[b]`, whose pages are `page_table[b]`. Per layer it

1. computes queries and the window KV of the chunk, attends over [ring ++ chunk] (the 128-token
   band), and writes the chunk's last 128 window rows into the ring (slot p % 128);
2. at KV sources, compresses the chunk (a ratio-2 pair may start in the previous step: its first
   token waits in `pending`) and writes the new entries and indexer keys into the pages FIRST,
   so cached and new entries are read back the same way (`model.paged`);
3. indexes and selects exactly as the full forward does (same functions), and attends.

Reads cost what a step needs, so a decode step is nearly flat in its context: the indexer scores
every visible key of its source's pages, but a Reindex layer reads only its candidate pool's keys
and the attention gathers and dequantizes only the entries its index source selected. A long
prefill chunk, whose queries together select more rows than its pages hold, reads every page
once instead; `read_all=True` forces that everywhere (the path the tests compare against).

With drafter rings in the layout, it also keeps the DSpark drafter's context: the stream means
entering the target layers become `main_x`, whose per-block window KV goes into the draft rings
(`model.drafter`), at the rows the decoder layers ran on.

`verify_body` is the step of speculative decoding: every token's logits, and what
`model.rollback.roll_back` needs to keep only the accepted tokens in the cache.

In full-fidelity mode this reproduces `forward.forward` position by position; the engine tests
check that for several chunkings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from deepinfer.model import compressor, indexer, qat
from deepinfer.model.attention import output_projection, query, window_kv_unquantized, window_mask
from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import context_input, context_kv
from deepinfer.model.forward import final_hidden, walk_layers
from deepinfer.model.invariant_attention import per_query_attention, window_by_offset
from deepinfer.model.kv_cache import FLOAT, CacheLayout, KVCache, decode, encode, pending_sources
from deepinfer.model.layers import compress_inv_freq, linear
from deepinfer.model.paged import PagedSource
from deepinfer.model.params import compute_dtype
from deepinfer.model.rollback import Undo, snapshot_rings
from deepinfer.ops.batch_invariant import batch_invariant
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    """Inputs of one step. B rows of T tokens; `positions` -1 marks padding after a row's run."""

    tokens: jax.Array  # [B, T] int32
    positions: jax.Array  # [B, T] int32
    slots: jax.Array  # [B] int32 cache slot per row
    # [B, n_pages] int32 physical page per logical page (-1 = none); n_pages is a bucket that
    # covers the longest row, so reading a sequence's entries costs O(its context)
    page_table: jax.Array
    hash_ids: jax.Array | None  # [B, T, n_engram_layers, n_cols] int32 (None without Engram)
    last_index: jax.Array  # [B] int32 index of the row's last valid token
    # decoder replay start (compact prefill, model-v4.1-flash.md §4.3): decoder layers run only
    # on positions >= floor and their window never reaches below it; 0 = full fidelity
    floor: jax.Array  # [B] int32
    # prefix cache (bounded replay, engine-features.md §6): global entries and indexer keys of
    # positions below this (a page boundary) are shared pages and never rewritten; a replayed
    # chunk recomputes them only to rebuild the window rings. None: every emitted row is written
    write_floor: jax.Array | None = None  # [B] int32


class _State:
    """Mutable-at-trace-time view of the cache and of what sources publish in this step."""

    def __init__(self, cache: KVCache):
        self.window = list(cache.window)
        self.window_pos = cache.window_pos
        self.entries = [list(e) for e in cache.entries]
        self.index_keys = [list(k) for k in cache.index_keys]
        self.pending = list(cache.pending)
        self.pair_inputs: list = [None] * len(cache.pending)
        self.shared: dict = {}

    def cache(self) -> KVCache:
        return KVCache(tuple(self.window), self.window_pos, tuple(tuple(e) for e in self.entries),
                       tuple(tuple(k) for k in self.index_keys), tuple(self.pending))


def _source_step(p: dict, config: ModelConfig, layout: CacheLayout, layer: int, x: jax.Array,
                 batch: StepBatch, valid: jax.Array, st: _State, kernels: KernelConfig | None = None) -> None:
    """Compress the chunk at a KV source, store the new entries and indexer keys into the pages
    FIRST (the registry's `compress_store`; a ratio-2 pair may start in the previous step: its
    first token waits in `pending`), then publish the source's pages for the layers that read
    them (`PagedSource`)."""
    ratio = config.compress_ratios[layer]
    src = config.kv_source_layer_ids.index(layer)
    k = pending_sources(config).index(layer) if ratio > 1 else None
    kv, gate = compressor.project(p["compressor"], x, ratio)
    if k is not None:  # a verify step rolls the pending token back to a kept one (`model.rollback`)
        st.pair_inputs[k] = jnp.stack([kv, gate], axis=2)
    store = get_kernel("compress_store", kernels)
    entries, keys, pending = store(
        kv, gate, batch.positions, valid, _write_table(batch, layout), tuple(st.entries[src]), tuple(st.index_keys[src]),
        None if k is None else st.pending[k], batch.slots, batch.last_index,
        ratio=ratio, norm=p["compressor"]["norm"], wk=p["indexer"]["wk"], k_norm=p["indexer"]["k_norm"],
        inv_freq=compress_inv_freq(config), eps=config.rms_norm_eps, dtype=x.dtype, storage=layout.storage,
        fake_quant=config.fake_quant)
    st.entries[src], st.index_keys[src] = list(entries), list(keys)
    if k is not None:
        st.pending[k] = pending
    st.shared["source", layer] = PagedSource(tuple(entries), tuple(keys), batch.page_table, compute_dtype(config))


def _write_table(batch: StepBatch, layout: CacheLayout) -> jax.Array:
    """The page table the chunk's new entries are stored through: pages wholly below the row's
    `write_floor` are -1 (the store drops those rows), the rest as read."""
    if batch.write_floor is None:
        return batch.page_table
    page_end = (jnp.arange(batch.page_table.shape[1], dtype=jnp.int32) + 1) * layout.page_size
    return jnp.where(page_end[None, :] <= batch.write_floor[:, None], -1, batch.page_table)


def _index_step(p: dict, config: ModelConfig, layer: int, x: jax.Array, q_residual: jax.Array, positions: jax.Array,
                st: _State, kernels: KernelConfig | None, read_all: bool) -> None:
    """An index source's top-k (and, at the candidate source, the candidate pool) from the paged
    keys: every key of the pages, a chunk of pages at a time (`index_topk_paged`), except at a
    Reindex layer whose queries' candidate pools hold fewer rows than the pages (decode), which
    scores only those (`indexer.select_in_pool`)."""
    source = st.shared["source", config.kv_source(layer)]
    ratio, k = config.compress_ratios[layer], config.index_topk
    q, weights = indexer.index_queries(p["indexer"], config, x, q_residual, positions)
    ids = st.shared.get("candidate_ids") if config.uses_candidates(layer) else None
    if ids is not None and not read_all and ids.shape[1] * ids.shape[2] < source.capacity:
        B, T, C = ids.shape
        keys = source.keys_at(ids.reshape(B, T * C)).reshape(B, T, C, -1)
        st.shared["topk", layer] = indexer.select_in_pool(get_kernel("index_topk", kernels), q, weights, keys, ids,
                                                          positions, ratio, k)
        return
    candidates = st.shared["candidates"] if config.uses_candidates(layer) else None
    pool_args = indexer.candidate_pool(config, layer)
    if read_all:
        topk, pool = get_kernel("index_topk", kernels)(q, weights, source.all_keys, positions, ratio, k, candidates,
                                                       pool_args)
    else:
        topk, pool = get_kernel("index_topk_paged", kernels)(q, weights, source.read_keys, source.n_pages,
                                                             source.per_page, positions, ratio, k, candidates,
                                                             pool_args)
    if pool is not None:
        st.shared["candidates"] = pool
        st.shared["candidate_ids"] = indexer.pool_ids(pool, config.candidate_block_size, config.candidate_topk_blocks)
    st.shared["topk", layer] = topk


def _selected_entries(config: ModelConfig, layer: int, st: _State, read_all: bool) -> tuple[jax.Array, jax.Array]:
    """`(entries, topk)` for a compressed-branch layer's attention: the rows its index source
    selected, gathered and decoded from the pages, with the top-k renumbered into them; or
    every entry of the pages with the top-k as it is when the chunk's selections add up to no
    fewer rows (a long prefill chunk) or `read_all`. Layers sharing a KV and an index source
    share one read."""
    src, isrc = config.kv_source(layer), config.index_source(layer)
    if ("selected", src, isrc) not in st.shared:
        source, topk = st.shared["source", src], st.shared["topk", isrc]
        B, T, K = topk.shape
        if read_all or T * K >= source.capacity:
            selected = source.all_entries, topk
        else:
            slots = jnp.arange(T * K, dtype=jnp.int32).reshape(1, T, K)
            selected = source.entries_at(topk.reshape(B, T * K)), jnp.where(topk >= 0, slots, -1)
        st.shared["selected", src, isrc] = selected
    return st.shared["selected", src, isrc]


class _Chunk:
    """The step's tokens as this device holds them (`batch`) and as a whole (`whole`: natural
    order). They differ only under context parallel (`seq`, see `model.attention.SequenceShards`),
    where a device holds a zigzag share of each prefill chunk's queries: the window keys, the ring
    writes and the compressor then work on the gathered chunk, the queries on the local share."""

    def __init__(self, batch: StepBatch, seq=None):
        self.batch, self.seq = batch, seq
        self.whole = batch if seq is None else dataclasses.replace(batch, positions=seq.gather(batch.positions))

    def gather(self, a: jax.Array) -> jax.Array:
        return a if self.seq is None else self.seq.gather(a)


def _attention_step(p: dict, config: ModelConfig, layout: CacheLayout, layer: int, x: jax.Array,
                    chunk: _Chunk, valid: jax.Array, ring_pos: jax.Array, write_idx: jax.Array, st: _State,
                    kernels: KernelConfig | None, kv_valid: jax.Array, read_all: bool = False) -> jax.Array:
    """`valid`: (local) rows this layer runs on; `kv_valid`: (whole-chunk) rows whose compressed KV
    it produces (the decoder source produces it for every prompt row, even below the replay
    floor); `write_idx`: ring slots of the whole chunk's rows."""
    batch = chunk.batch
    positions = batch.positions
    q, q_residual = query(p, config, layer, x, positions)
    kv_raw = chunk.gather(window_kv_unquantized(p, config, layer, x, positions))  # one gather: the
    kv = qat.window_kv(kv_raw, config)  # fake-quant works per row, before or after it alike
    dtype = compute_dtype(config)
    ring = decode("window", tuple(w[layer, batch.slots] for w in st.window), dtype)
    invariant = kernels is not None and kernels.batch_invariant
    if invariant:  # the chunk's keys as the ring will give them back, so every key reads alike
        kv = decode("window", encode("window", kv if layout.storage == FLOAT else kv_raw, layout.storage), dtype)
    keys = jnp.concatenate([ring, kv.astype(dtype)], axis=1)
    key_pos = jnp.concatenate([ring_pos, chunk.whole.positions], axis=1)
    floor = _floor(config, layer, batch)
    if invariant:
        keys, key_pos = window_by_offset(keys, key_pos, positions, config.sliding_window)
        mask = (key_pos >= 0) & valid[:, :, None] & (key_pos >= floor[:, None, None])
    else:
        mask = window_mask(positions, key_pos, config.sliding_window)
        mask = mask & valid[:, :, None] & (key_pos >= floor[:, None])[:, None, :]
    _write_ring(st, layout, layer, batch.slots, write_idx, kv_raw, kv)

    B, T, _ = x.shape
    entries = jnp.zeros((B, 0, config.head_dim), dtype)
    topk = jnp.zeros((B, T, 0), jnp.int32)
    kind = config.layer_kind(layer)
    if kind == "full":
        _source_step(p, config, layout, layer, chunk.gather(x), chunk.whole, kv_valid, st, kernels)
    if kind in ("full", "reindex"):
        _index_step(p, config, layer, x, q_residual, positions, st, kernels, read_all)
    if kind != "swa":
        entries, topk = _selected_entries(config, layer, st, read_all)
    attend = get_kernel("sparse_attention", kernels)
    if invariant:
        o = per_query_attention(attend, q, keys, mask, entries, topk, p["attn_sink"], config.head_dim ** -0.5)
    else:
        o = attend(q, keys, mask, entries, topk, p["attn_sink"], config.head_dim ** -0.5)
    return output_projection(p, config, layer, o, positions)


def _write_ring(st: _State, layout: CacheLayout, ring: int, slots: jax.Array, write_idx: jax.Array,
                kv_raw: jax.Array, kv: jax.Array) -> None:
    """Store window KV rows into ring `ring` (a layer's, or a draft block's after them) at
    `write_idx` (W = dropped): packed rows encode `kv_raw` (the codec quantizes), float rows keep
    the fake-quantized `kv`."""
    stored = encode("window", kv if layout.storage == FLOAT else kv_raw, layout.storage)
    for i, (array, values) in enumerate(zip(st.window, stored)):
        st.window[i] = array.at[ring, slots[:, None], write_idx].set(values.astype(array.dtype), mode="drop")


def _write_draft_rings(params: dict, config: ModelConfig, layout: CacheLayout, means: list[jax.Array],
                       chunk: _Chunk, write_idx: jax.Array, st: _State) -> None:
    """The drafter's context KV of the chunk (from the target layers' stream `means`) into the
    draft rings, which follow the layers' rings in `window`."""
    main_x = context_input(params, config, means)
    for i in range(layout.draft_rings):
        raw = chunk.gather(context_kv(params, config, i, main_x, chunk.batch.positions))
        kv = qat.window_kv(raw, config) if layout.storage == FLOAT else raw  # packed: the codec quantizes
        _write_ring(st, layout, config.num_hidden_layers + i, chunk.batch.slots, write_idx, raw, kv)


def _floor(config: ModelConfig, layer: int, batch: StepBatch) -> jax.Array:
    return batch.floor if layer >= config.decoder_start else jnp.zeros_like(batch.floor)


def _write_index(positions: jax.Array, valid: jax.Array, W: int) -> jax.Array:
    """Ring slot of each row token among its row's last W valid ones; W (dropped) otherwise."""
    last_pos = jnp.max(jnp.where(valid, positions, -1), axis=1)
    return jnp.where(valid & (positions > last_pos[:, None] - W), positions % W, W)


def step_body(params: dict, cache: KVCache, batch: StepBatch, *, config: ModelConfig, layout: CacheLayout,
              all_logits: bool = False, decoder: bool = True, kernels: KernelConfig | None = None,
              ep=None, seq=None, read_all: bool = False) -> tuple[KVCache, jax.Array | None, jax.Array]:
    """The step on one device's share (unjitted: `forward_step` jits it, the mesh step runs it
    under `shard_map` with `ep` doing the MoE's expert-parallel exchange). Returns the updated
    cache, fp32 logits (`[B, vocab]` at each row's last token, or `[B, T, vocab]` with
    `all_logits`; None when `decoder=False`) and int32 `[layers, experts]` counts of the live
    tokens routed to each logical expert (for EPLB).

    `decoder=False` (a prefill chunk entirely below the replay floor) runs the encoder layers
    and only the compressed-KV path of the first decoder layer.

    `seq` (context parallel, prefill): `batch`'s tokens, positions and hash ids are this device's
    zigzag share of every row; `seq.gather` restores whole rows (see `_Chunk`).

    `read_all`: read every page of every source (no selected-row reads; see the module
    docstring), the same result by another path.

    With `kernels.batch_invariant` every token's result is independent of the rest of the
    step (see `_invariant`)."""
    step = partial(_step, config=config, layout=layout, all_logits=all_logits, decoder=decoder, kernels=kernels,
                   ep=ep, seq=seq)
    if not _invariant(kernels, seq, ep):
        return step(params, cache, batch, read_all=read_all)
    run = batch_invariant(partial(step, read_all=True))
    if batch.tokens.shape != (1, 1):
        return run(params, cache, batch)
    # one token: computed as one of two rows (`_with_padding_row`)
    cache, logits, counts = run(params, cache, _with_padding_row(batch, layout))
    return cache, None if logits is None else logits[:1], counts


def _with_padding_row(batch: StepBatch, layout: CacheLayout) -> StepBatch:
    """`batch` (one row of one token) with a second, padding row. XLA simplifies the all-1
    dimensions of a one-token step away and compiles another program (reductions to scalars,
    among others), whose token came out up to 4.5e-6 off the same token in any wider invariant
    step; as one of two rows it gets their bits. The padding row attends to nothing (positions
    -1) and its slot is one past the rank's last, so each of its writes is dropped."""
    pad = lambda a, fill: None if a is None else jnp.concatenate([a, jnp.full_like(a, fill)])
    return StepBatch(pad(batch.tokens, 0), pad(batch.positions, -1), pad(batch.slots, layout.slots_per_rank),
                     pad(batch.page_table, -1), pad(batch.hash_ids, 0), pad(batch.last_index, 0), pad(batch.floor, 0),
                     pad(batch.write_floor, 0))


def _step(params: dict, cache: KVCache, batch: StepBatch, *, config: ModelConfig, layout: CacheLayout,
          all_logits: bool, decoder: bool, kernels: KernelConfig | None, ep, seq,
          read_all: bool) -> tuple[KVCache, jax.Array | None, jax.Array]:
    st, logits, counts = _run(params, cache, batch, config, layout, all_logits, decoder, kernels, ep, seq, read_all)
    return st.cache(), logits, counts


def _invariant(kernels: KernelConfig | None, seq, ep) -> bool:
    """Whether to run the batch-invariant step: products in fixed tiles (`ops.batch_invariant`),
    every page read (`read_all`: shapes fixed by the engine's page count, not by the step's
    selections) and the attention keys per query (`model.invariant_attention`). On one device
    or one rank of a mesh (the expert exchange included); not under context-parallel prefill,
    which the mesh step does not split in this mode."""
    if kernels is None or not kernels.batch_invariant:
        return False
    if seq is not None:
        raise NotImplementedError("KernelConfig(batch_invariant=True) does not run context-parallel prefill "
                                  "in this version")
    return True


def verify_body(params: dict, cache: KVCache, batch: StepBatch, *, config: ModelConfig, layout: CacheLayout,
                kernels: KernelConfig | None = None, ep=None) -> tuple[KVCache, jax.Array, jax.Array, Undo]:
    """`step_body` over rows that each hold an anchor and its drafts, with fp32 logits at every
    token `[B, T, vocab]` and the `Undo` that `model.rollback.roll_back` takes to keep only the
    accepted tokens in the cache (on one device's share; not under context parallel)."""
    if _invariant(kernels, None, ep):
        body = partial(_verify, config=config, layout=layout, kernels=kernels, ep=ep, read_all=True)
        return batch_invariant(body)(params, cache, batch)
    return _verify(params, cache, batch, config=config, layout=layout, kernels=kernels, ep=ep, read_all=False)


def _verify(params: dict, cache: KVCache, batch: StepBatch, *, config: ModelConfig, layout: CacheLayout,
            kernels: KernelConfig | None, ep, read_all: bool) -> tuple[KVCache, jax.Array, jax.Array, Undo]:
    W = config.sliding_window
    rings = snapshot_rings(cache, batch.slots, _write_index(batch.positions, batch.positions >= 0, W))
    st, logits, counts = _run(params, cache, batch, config, layout, True, True, kernels, ep, None, read_all)
    return st.cache(), logits, counts, Undo(rings, tuple(st.pair_inputs))


def _run(params: dict, cache: KVCache, batch: StepBatch, config: ModelConfig, layout: CacheLayout, all_logits: bool,
         decoder: bool, kernels: KernelConfig | None, ep, seq, read_all: bool) -> tuple[_State, jax.Array | None,
                                                                                         jax.Array]:
    chunk = _Chunk(batch, seq)
    positions, whole = batch.positions, chunk.whole.positions
    valid, whole_valid = positions >= 0, whole >= 0
    W = config.sliding_window
    ring_pos = cache.window_pos[batch.slots]
    write_idx = _write_index(whole, whole_valid, W)
    decoder_valid = valid & (positions >= batch.floor[:, None])
    decoder_write = _write_index(whole, whole_valid & (whole >= batch.floor[:, None]), W)
    st = _State(cache)
    B = batch.tokens.shape[0]

    def attend(layer: int, p: dict, x: jax.Array) -> jax.Array | None:
        if layer >= config.decoder_start and not decoder:  # compact prefill below the floor: the KV path only
            _source_step(p, config, layout, layer, chunk.gather(x), chunk.whole, whole_valid, st, kernels)
            return None
        in_decoder = layer >= config.decoder_start
        return _attention_step(p, config, layout, layer, x, chunk, decoder_valid if in_decoder else valid, ring_pos,
                               decoder_write if in_decoder else write_idx, st, kernels, whole_valid, read_all)

    def live(layer: int) -> jax.Array:
        return decoder_valid if layer >= config.decoder_start else valid

    capture = config.dspark_target_layer_ids if layout.draft_rings else ()
    walk = walk_layers(params, config, batch.tokens, batch.hash_ids, attend, kernels, live=live, ep=ep,
                       capture=capture)
    streams, pre, counts = walk.streams, walk.pre, walk.counts
    if decoder and layout.draft_rings:
        with jax.named_scope("draft_rings"):
            _write_draft_rings(params, config, layout, [walk.captured[t] for t in capture], chunk, decoder_write, st)
    st.window_pos = st.window_pos.at[batch.slots[:, None], write_idx].set(whole, mode="drop")
    if not decoder:
        return st, None, counts
    rows = jnp.arange(B)
    if seq is not None:  # the rows' last tokens live on some rank: gather the final hidden states
        hidden = chunk.gather(final_hidden(params, config, streams, pre))
        hidden = hidden if all_logits else hidden[rows, batch.last_index][:, None]
    else:
        if not all_logits:
            streams, pre = streams[rows, batch.last_index][:, None], pre[rows, batch.last_index][:, None]
        hidden = final_hidden(params, config, streams, pre)
    logits = linear(hidden, params["head"]).astype(jnp.float32)
    return st, (logits if all_logits else logits[:, 0]), counts


@partial(jax.jit, static_argnames=("config", "layout", "all_logits", "decoder", "kernels", "read_all"),
         donate_argnames=("cache",))
def forward_step(params: dict, config: ModelConfig, layout: CacheLayout, cache: KVCache, batch: StepBatch,
                 all_logits: bool = False, decoder: bool = True, kernels: KernelConfig | None = None,
                 read_all: bool = False) -> tuple[KVCache, jax.Array | None, jax.Array]:
    """`step_body` on one device, jitted with the cache donated."""
    return step_body(params, cache, batch, config=config, layout=layout, all_logits=all_logits,
                     decoder=decoder, kernels=kernels, read_all=read_all)
