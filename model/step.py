"""One engine step of DeepSeek-V4.1 over a batch of token chunks, reading and updating the cache.

The same function serves chunked prefill (a few rows, many tokens) and decode (many rows, one
token): each row is a run of consecutive positions of one sequence (`positions`, -1 = padding
after the run) in cache slot `slots[b]`, whose pages are `page_table[b]`. Per layer it

1. computes queries and the window KV of the chunk, attends over [ring ++ chunk] (the 128-token
   band), and writes the chunk's last 128 window rows into the ring (slot p % 128);
2. at KV sources, compresses the chunk (a ratio-2 pair may start in the previous step: its first
   token waits in `pending`), writes the new entries and indexer keys into the pages FIRST, then
   reads the sequence's entries back, so cached and new entries are used the same way;
3. indexes and selects exactly as the full forward does (same functions), and attends.

In full-fidelity mode this reproduces `forward.forward` position by position; the engine tests
check that for several chunkings.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from deepinfer.model import compressor, indexer, qat
from deepinfer.model.attention import index_layer, output_projection, query, window_kv_unquantized, window_mask
from deepinfer.model.config import ModelConfig
from deepinfer.model.engram import engram
from deepinfer.model.forward import embed_streams, final_hidden, mixes
from deepinfer.model.kv_cache import FLOAT, CacheLayout, KVCache, decode, encode, pending_sources
from deepinfer.model.layers import apply_rope, compress_inv_freq, linear, rms_norm
from deepinfer.model.mhc import hc_collapse, hc_expand
from deepinfer.model.moe import moe
from deepinfer.model.params import compute_dtype
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


class _State:
    """Mutable-at-trace-time view of the cache and of what sources publish in this step."""

    def __init__(self, cache: KVCache):
        self.window = list(cache.window)
        self.window_pos = cache.window_pos
        self.entries = [list(e) for e in cache.entries]
        self.index_keys = [list(k) for k in cache.index_keys]
        self.pending = list(cache.pending)
        self.shared: dict = {}

    def cache(self) -> KVCache:
        return KVCache(tuple(self.window), self.window_pos, tuple(tuple(e) for e in self.entries),
                       tuple(tuple(k) for k in self.index_keys), tuple(self.pending))


def _write_rows(pool: list[jax.Array], rows: tuple[jax.Array, ...], *index) -> None:
    for i, (array, values) in enumerate(zip(pool, rows)):
        pool[i] = array.at[index].set(values.astype(array.dtype), mode="drop")


def _gather_pages(pool: list[jax.Array], page_table: jax.Array) -> tuple[jax.Array, ...]:
    """A sequence's rows in logical order: `[B, max_pages * per_page, ...]`."""
    table = jnp.maximum(page_table, 0)
    out = []
    for array in pool:
        rows = array[table]  # [B, max_pages, per_page, ...]
        out.append(rows.reshape(rows.shape[0], -1, *rows.shape[3:]))
    return tuple(out)


def _source_step(p: dict, config: ModelConfig, layout: CacheLayout, layer: int, x: jax.Array,
                 batch: StepBatch, valid: jax.Array, st: _State) -> None:
    """Compress the chunk at a KV source, store new entries and keys, publish the sequence's."""
    ratio = config.compress_ratios[layer]
    src = config.kv_source_layer_ids.index(layer)
    positions = batch.positions
    if ratio == 1:
        kv, _ = compressor.project(p["compressor"], x, 1)
        latent = rms_norm(kv, p["compressor"]["norm"], config.rms_norm_eps)
        emit, entry_idx, entry_pos = valid, positions, positions
    else:
        k = pending_sources(config).index(layer)
        kv, gate = compressor.project(p["compressor"], x, ratio)
        held = st.pending[k][batch.slots]  # [B, 2, hd]
        prev_kv = jnp.concatenate([held[:, None, 0], kv[:, :-1]], axis=1)
        prev_gate = jnp.concatenate([held[:, None, 1], gate[:, :-1]], axis=1)
        pair_kv = jnp.stack([prev_kv, kv], axis=2)
        weights = jax.nn.softmax(jnp.stack([prev_gate, gate], axis=2), axis=2)
        latent = rms_norm(jnp.sum(pair_kv * weights, axis=2).astype(x.dtype), p["compressor"]["norm"],
                          config.rms_norm_eps)
        emit = valid & (positions % 2 == 1)
        entry_idx, entry_pos = positions // 2, positions - 1
        rows = jnp.arange(kv.shape[0])
        last_pos = positions[rows, batch.last_index]
        newest = jnp.stack([kv[rows, batch.last_index], gate[rows, batch.last_index]], axis=1)
        st.pending[k] = st.pending[k].at[batch.slots].set(
            jnp.where((last_pos % 2 == 0)[:, None, None], newest, held))
    inv_freq = compress_inv_freq(config)
    entries = apply_rope(latent, entry_pos, inv_freq)
    keys = apply_rope(rms_norm(linear(latent, p["indexer"]["wk"]), p["indexer"]["k_norm"], config.rms_norm_eps),
                      entry_pos, inv_freq)
    if layout.storage == FLOAT:  # store exactly what the attention uses
        entries, keys = qat.compressed_kv(entries, config), qat.index_vector(keys, config)
    per_page = layout.page_size // ratio
    logical = jnp.clip(entry_idx // per_page, 0, batch.page_table.shape[1] - 1)
    page = batch.page_table[jnp.arange(kv.shape[0])[:, None], logical]
    page = jnp.where(emit & (page >= 0), page, layout.num_pages)  # out of range: dropped
    offset = entry_idx % per_page
    _write_rows(st.entries[src], encode("entry", entries, layout.storage), page, offset)
    _write_rows(st.index_keys[src], encode("index", keys, layout.storage), page, offset)
    dtype = compute_dtype(config)
    st.shared["entries", layer] = decode("entry", _gather_pages(st.entries[src], batch.page_table), dtype)
    st.shared["index_keys", layer] = decode("index", _gather_pages(st.index_keys[src], batch.page_table), dtype)


def _attention_step(p: dict, config: ModelConfig, layout: CacheLayout, layer: int, x: jax.Array,
                    batch: StepBatch, valid: jax.Array, ring_pos: jax.Array, write_idx: jax.Array, st: _State,
                    kernels: KernelConfig | None, kv_valid: jax.Array) -> jax.Array:
    """`valid`: rows this layer runs on; `kv_valid`: rows whose compressed KV it produces (the
    decoder source produces it for every prompt row, even below the replay floor)."""
    positions = batch.positions
    q, q_residual = query(p, config, layer, x, positions)
    kv_raw = window_kv_unquantized(p, config, layer, x, positions)
    kv = qat.window_kv(kv_raw, config)
    dtype = compute_dtype(config)
    ring = decode("window", tuple(w[layer, batch.slots] for w in st.window), dtype)
    keys = jnp.concatenate([ring, kv.astype(dtype)], axis=1)
    key_pos = jnp.concatenate([ring_pos, positions], axis=1)
    mask = window_mask(positions, key_pos, config.sliding_window)
    mask = mask & valid[:, :, None] & (key_pos >= _floor(config, layer, batch)[:, None])[:, None, :]
    stored = encode("window", kv if layout.storage == FLOAT else kv_raw, layout.storage)
    for i, (array, values) in enumerate(zip(st.window, stored)):
        st.window[i] = array.at[layer, batch.slots[:, None], write_idx].set(values.astype(array.dtype), mode="drop")

    B, T, _ = x.shape
    entries = jnp.zeros((B, 0, config.head_dim), dtype)
    topk = jnp.zeros((B, T, 0), jnp.int32)
    kind = config.layer_kind(layer)
    if kind == "full":
        _source_step(p, config, layout, layer, x, batch, kv_valid, st)
    if kind in ("full", "reindex"):
        index_layer(p, config, layer, x, q_residual, positions, st.shared)
    if kind != "swa":
        entries = st.shared["entries", config.kv_source(layer)]
        topk = st.shared["topk", config.index_source(layer)]
    attend = get_kernel("sparse_attention", kernels)
    o = attend(q, keys, mask, entries, topk, p["attn_sink"], config.head_dim ** -0.5)
    return output_projection(p, config, layer, o, positions)


def _floor(config: ModelConfig, layer: int, batch: StepBatch) -> jax.Array:
    return batch.floor if layer >= config.decoder_start else jnp.zeros_like(batch.floor)


def _write_index(positions: jax.Array, valid: jax.Array, W: int) -> jax.Array:
    """Ring slot of each row token among its row's last W valid ones; W (dropped) otherwise."""
    last_pos = jnp.max(jnp.where(valid, positions, -1), axis=1)
    return jnp.where(valid & (positions > last_pos[:, None] - W), positions % W, W)


@partial(jax.jit, static_argnames=("config", "layout", "all_logits", "decoder", "kernels"),
         donate_argnames=("cache",))
def forward_step(params: dict, config: ModelConfig, layout: CacheLayout, cache: KVCache, batch: StepBatch,
                 all_logits: bool = False, decoder: bool = True,
                 kernels: KernelConfig | None = None) -> tuple[KVCache, jax.Array | None]:
    """Run the layers on the batch's chunks; returns the updated cache (donated) and fp32 logits:
    `[B, vocab]` at each row's last token, or `[B, T, vocab]` with `all_logits`.

    `decoder=False` (a prefill chunk entirely below the replay floor) runs the encoder layers
    and only the compressed-KV path of the first decoder layer, and returns no logits."""
    positions = batch.positions
    valid = positions >= 0
    W = config.sliding_window
    ring_pos = cache.window_pos[batch.slots]
    write_idx = _write_index(positions, valid, W)
    decoder_valid = valid & (positions >= batch.floor[:, None])
    decoder_write = _write_index(positions, decoder_valid, W)
    st = _State(cache)
    streams = embed_streams(params, config, batch.tokens)
    B, T = batch.tokens.shape
    pre = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), config.hc_mult, dtype=jnp.float32)
    for layer in range(config.num_hidden_layers):
        lp = params["layers"][layer]
        in_decoder = layer >= config.decoder_start
        with jax.named_scope(f"layer_{layer}"):
            if layer in config.engram_layer_ids:
                ids = batch.hash_ids[:, :, config.engram_layer_ids.index(layer)]
                streams = engram(lp["engram"], config, streams, ids, live=valid)
            a_pre, a_post, a_comb = mixes(lp, "attn", streams, config, kernels)
            x = rms_norm(hc_collapse(streams, pre), lp["attn_norm"], config.rms_norm_eps)
            if in_decoder and not decoder:  # compact prefill below the floor: the KV path only
                _source_step(lp["attn"], config, layout, layer, x, batch, valid, st)
                break
            y = _attention_step(lp["attn"], config, layout, layer, x, batch,
                                decoder_valid if in_decoder else valid, ring_pos,
                                decoder_write if in_decoder else write_idx, st, kernels, valid)
            streams = hc_expand(y, streams, a_post, a_comb)
            f_pre, f_post, f_comb = mixes(lp, "ffn", streams, config, kernels)
            x = rms_norm(hc_collapse(streams, a_pre), lp["ffn_norm"], config.rms_norm_eps)
            streams = hc_expand(moe(lp["ffn"], config, x, token_ids=batch.tokens, kernels=kernels), streams,
                                f_post, f_comb)
            pre = f_pre
    st.window_pos = st.window_pos.at[batch.slots[:, None], write_idx].set(positions, mode="drop")
    if not decoder:
        return st.cache(), None
    if not all_logits:
        rows = jnp.arange(B)
        streams, pre = streams[rows, batch.last_index][:, None], pre[rows, batch.last_index][:, None]
    logits = linear(final_hidden(params, config, streams, pre), params["head"]).astype(jnp.float32)
    return st.cache(), (logits if all_logits else logits[:, 0])
