"""The attention sublayer of every V4.1 layer, for a whole sequence.

Every layer computes its own low-rank query and its own sliding-window KV (one 512-d latent,
K == V, FP8 fake-quantized). Layers with a compressed branch also attend to up to `index_topk`
compressed entries of their KV source, chosen by their index source:

- Full (KV source): runs the compressor and publishes entries and indexer keys, then indexes;
- Reindex: scores its own queries against the source's keys inside the candidate pool;
- Reuse: takes both the entries and the selection of the latest source.

`shared` carries what sources publish to later layers within one forward (entries, keys, top-k,
candidate pool), keyed by the publishing layer id.

Context parallel: with `seq` given, x and positions hold only this rank's tokens (any order,
padding at position -1) and `seq.gather` restores the whole sequence in natural order. The
window keys and the compressor/indexer-key input are gathered; queries, index scores, top-k and
the attention stay local.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from deepinfer.model import compressor, indexer, qat
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import apply_rope, compress_inv_freq, dequantize, layer_inv_freq, linear, rms_norm
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


class SequenceShards(Protocol):
    """This rank's share of a sequence split along the token axis (context parallel).

    `gather(a)`: `a [B, T_local, ...]` -> `[B, T_padded, ...]`, every rank's tokens in natural
    position order (padding slots last). Duck-typed so model/ never imports the sharding code."""

    def gather(self, a: jax.Array) -> jax.Array: ...


@jax.named_scope("attention")
def query(p: dict, config: ModelConfig, layer: int, x: jax.Array, positions: jax.Array):
    """q `[B, T, H, hd]` (rotated) and q_residual `[B, T, q_lora]` (the indexer's input)."""
    B, T, _ = x.shape
    q_residual = rms_norm(linear(x, p["wq_a"]), p["q_norm"], config.rms_norm_eps)
    q = linear(q_residual, p["wq_b"]).reshape(B, T, config.num_attention_heads, config.head_dim)
    if config.is_v4:  # V4 normalizes each head (no weight); V4.1 does not
        q = rms_norm(q, None, config.rms_norm_eps)
    return apply_rope(q, positions, layer_inv_freq(config, layer)), q_residual


@jax.named_scope("attention")
def window_kv_unquantized(p: dict, config: ModelConfig, layer: int, x: jax.Array, positions: jax.Array):
    """The layer's window KV `[B, T, hd]` before the QAT fake-quant (what packed caches encode)."""
    kv = rms_norm(linear(x, p["wkv"]), p["kv_norm"], config.rms_norm_eps)
    return apply_rope(kv, positions, layer_inv_freq(config, layer))


def query_and_window_kv(p: dict, config: ModelConfig, layer: int, x: jax.Array, positions: jax.Array):
    """q `[B, T, H, hd]` (rotated), q_residual `[B, T, q_lora]`, window kv `[B, T, hd]`."""
    q, q_residual = query(p, config, layer, x, positions)
    kv = qat.window_kv(window_kv_unquantized(p, config, layer, x, positions), config)
    return q, q_residual, kv


@jax.named_scope("attention")
def output_projection(p: dict, config: ModelConfig, layer: int, o: jax.Array, positions: jax.Array) -> jax.Array:
    """Undo the query rotation on the output's rope slice, then the grouped low-rank projection."""
    o = apply_rope(o, positions, layer_inv_freq(config, layer), inverse=True)
    B, T, H, hd = o.shape
    G = config.o_groups
    grouped = o.reshape(B, T, G, H * hd // G)
    w = dequantize(p["wo_a"], o.dtype).reshape(G, config.o_lora_rank, H * hd // G)
    # the tokens as the product's rows (lhs): `jnp.einsum` would make the weight the lhs, and a
    # batch-invariant program tiles the rows only (`ops.batch_invariant`)
    mid = jax.lax.dot_general(grouped, w, (((3,), (2,)), ((2,), (0,))))  # [G, B, T, r]
    mid = jnp.transpose(mid, (1, 2, 0, 3)).reshape(B, T, G * config.o_lora_rank)
    return linear(mid, p["wo_b"])


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """bool `[B, T, S]`: key visible iff 0 <= q_pos - k_pos < window (k_pos < 0 = empty slot)."""
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    return (delta >= 0) & (delta < window) & (k_pos[:, None, :] >= 0)


def publish_source(p: dict, config: ModelConfig, layer: int, x: jax.Array, shared: dict) -> None:
    """A layer that owns a compressor compresses the whole sequence and publishes its entries
    and (when it has an indexer) its index keys."""
    ratio = config.compress_ratios[layer]
    if config.is_v4:
        rows, entry_pos = compressor.compress_full_v4(p["compressor"], config, x, ratio)
        shared["entries", layer] = compressor.cache_entries(config, rows, entry_pos)
        if config.layer_kind(layer) == "csa":
            keys, key_pos = compressor.compress_full_v4(p["indexer"]["compressor"], config, x, ratio)
            shared["index_keys", layer] = qat.index_vector(
                apply_rope(keys, key_pos, compress_inv_freq(config)), config)
        return
    latent, entry_pos = compressor.compress_full(p["compressor"], config, x, ratio)
    shared["entries", layer] = compressor.cache_entries(config, latent, entry_pos)
    shared["index_keys", layer] = indexer.index_keys(p["indexer"], config, latent, entry_pos)


def index_layer(p: dict, config: ModelConfig, layer: int, x: jax.Array, q_residual: jax.Array,
                positions: jax.Array, shared: dict, kernels: KernelConfig | None = None) -> None:
    """An index-source layer publishes its top-k selection (and, at the candidate source, the
    candidate pool), through the `index_topk` kernel op (`kernels=None`: the platform default)."""
    topk, pool = indexer.select(p["indexer"], config, layer, x, q_residual, positions, shared, kernels)
    if pool is not None:
        shared["candidates"] = pool
    shared["topk", layer] = topk


@jax.named_scope("attention")
def attention_full(p: dict, config: ModelConfig, layer: int, x: jax.Array, positions: jax.Array, shared: dict,
                   kernels: KernelConfig | None = None, seq: SequenceShards | None = None) -> jax.Array:
    """Attention sublayer over a whole sequence: x `[B, T, D]` (attn-normed), positions `[B, T]`.

    With `seq` (context parallel) x/positions are this rank's tokens: the window keys and their
    positions are gathered (the mask is position-based, so local queries see exactly their
    window), and the compressor/indexer keys are computed from the gathered natural-order x,
    replicated on every rank. That recomputation is exact and cheap next to attention; the
    price is one all-gather of x and of the window KV per layer."""
    q, q_residual, kv = query_and_window_kv(p, config, layer, x, positions)
    B, T, _ = x.shape
    k_pos = positions
    if seq is not None:
        kv, k_pos = seq.gather(kv), seq.gather(positions)
    entries = jnp.zeros((B, 0, config.head_dim), kv.dtype)
    topk = jnp.zeros((B, T, 0), jnp.int32)
    kind = config.layer_kind(layer)
    if config.owns_compressor(layer):
        publish_source(p, config, layer, x if seq is None else seq.gather(x), shared)
    if kind in ("full", "reindex", "csa"):
        index_layer(p, config, layer, x, q_residual, positions, shared, kernels)
    if kind != "swa":
        entries = shared["entries", config.kv_source(layer)]
        if kind == "hca":
            topk = indexer.dense_selection(positions, entries.shape[1], config.compress_ratios[layer])
        else:
            topk = shared["topk", config.index_source(layer)]
    attend = get_kernel("sparse_attention", kernels)
    o = attend(q, kv, window_mask(positions, k_pos, config.sliding_window), entries, topk,
               p["attn_sink"], config.head_dim ** -0.5)
    return output_projection(p, config, layer, o, positions)
