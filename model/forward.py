"""The full-fidelity forward pass over whole sequences (all layers on every token, as the
official references do), for DeepSeek-V4.1 and DeepSeek-V4. The engine's chunked prefill and
decode steps are checked against this function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.attention import SequenceShards, attention_full
from deepinfer.model.config import ModelConfig
from deepinfer.model.engram import engram
from deepinfer.model.layers import gather_rows, linear, rms_norm
from deepinfer.model.mhc import hc_collapse, hc_expand, hc_mixes
from deepinfer.model.moe import moe
from deepinfer.model.params import compute_dtype
from deepinfer.pallas_kernels.registry import KernelConfig


def mixes(lp: dict, site: str, streams: jax.Array, config: ModelConfig, kernels: KernelConfig | None = None):
    return hc_mixes(streams, lp[f"hc_{site}_fn"], lp[f"hc_{site}_base"], lp[f"hc_{site}_scale"],
                    norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters,
                    kernels=kernels)


# The caller's attention over its context: `attend(layer, p, x)` -> y for the attention params `p`
# and the normed site input `x` [B, T, D] (the full sequence: `attention_full`; the engine step:
# the window ring, the chunk and the paged cache). None stops the walk after this input (compact
# prefill below the replay floor runs only the first decoder layer's KV path).
Attend = Callable[[int, dict, jax.Array], "jax.Array | None"]


@dataclass
class LayerWalk:
    """What a walk over the layer schedule leaves: the final streams `[B, T, hc, D]`, the last FFN
    site's `pre` (V4.1 collapses the output with it), the `stream_mean` of the streams entering
    each `capture` layer, and int32 `[layers, experts]` counts of the live tokens routed to each
    logical expert (rows of layers the walk did not reach stay 0)."""

    streams: jax.Array
    pre: jax.Array
    captured: dict[int, jax.Array]
    counts: jax.Array


def layer_forward(lp: dict, config: ModelConfig, layer: int, streams: jax.Array, pre: jax.Array,
                  token_ids: jax.Array, hash_ids: jax.Array | None, attend: Attend,
                  kernels: KernelConfig | None = None, *, live: jax.Array | None = None, ep=None):
    """One block: [Engram] -> attention site -> FFN site. Returns (streams, this FFN site's pre,
    routed counts), or None when `attend` stops the walk. `live` (bool `[B, T]`, None = all)
    marks the tokens that count: padding shuts Engram's gate and is not routed or counted.

    V4.1 (single-pass mHC) collapses each site with the PREVIOUS site's `pre`; V4 with its own."""
    if layer in config.engram_layer_ids:
        streams = engram(lp["engram"], config, streams, hash_ids[:, :, config.engram_layer_ids.index(layer)], live=live)
    a_pre, a_post, a_comb = mixes(lp, "attn", streams, config, kernels)
    x = rms_norm(hc_collapse(streams, a_pre if config.is_v4 else pre), lp["attn_norm"], config.rms_norm_eps)
    y = attend(layer, lp["attn"], x)
    if y is None:
        return None
    streams = hc_expand(y, streams, a_post, a_comb)
    f_pre, f_post, f_comb = mixes(lp, "ffn", streams, config, kernels)
    x = rms_norm(hc_collapse(streams, f_pre if config.is_v4 else a_pre), lp["ffn_norm"], config.rms_norm_eps)
    y, counts = moe(lp["ffn"], config, x, token_ids=token_ids, kernels=kernels, ep=ep, live=live, return_counts=True)
    return hc_expand(y, streams, f_post, f_comb), f_pre, counts


def walk_layers(params: dict, config: ModelConfig, token_ids: jax.Array, hash_ids: jax.Array | None,
                attend: Attend, kernels: KernelConfig | None = None, *,
                live: Callable[[int], "jax.Array | None"] = lambda layer: None, ep=None,
                capture: tuple[int, ...] = ()) -> LayerWalk:
    """THE layer schedule: embed `[B, T]` tokens into the hc streams and run every layer. The full
    forward, context-parallel prefill and the engine step differ only in `attend` (what the
    attention sees) and `live(layer)` (which tokens count at that layer)."""
    B, T = token_ids.shape
    streams = embed_streams(params, config, token_ids)
    pre = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), config.hc_mult, dtype=jnp.float32)
    counts = jnp.zeros((config.num_hidden_layers, config.n_routed_experts), jnp.int32)
    captured = {}
    for layer in range(config.num_hidden_layers):
        if layer in capture:
            captured[layer] = stream_mean(streams)
        with jax.named_scope(f"layer_{layer}"):
            out = layer_forward(params["layers"][layer], config, layer, streams, pre, token_ids, hash_ids, attend,
                                kernels, live=live(layer), ep=ep)
        if out is None:
            return LayerWalk(streams, pre, captured, counts)
        streams, pre, layer_counts = out
        counts = counts.at[layer].set(layer_counts)
    return LayerWalk(streams, pre, captured, counts)


def hc_head(p: dict, config: ModelConfig, streams: jax.Array) -> jax.Array:
    """V4's learned final collapse: sigmoid mix of the normalized flattened streams."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + config.rms_norm_eps)
    mix = jnp.einsum("...i,mi->...m", flat, p["hc_head_fn"].astype(jnp.float32))
    pre = jax.nn.sigmoid(mix * p["hc_head_scale"].astype(jnp.float32) + p["hc_head_base"].astype(jnp.float32))
    return hc_collapse(streams, pre + config.hc_eps)


def final_hidden(params: dict, config: ModelConfig, streams: jax.Array, pre: jax.Array) -> jax.Array:
    """Collapse the streams (V4.1: the last FFN site's `pre`; V4: `hc_head`), then `norm`."""
    h = hc_head(params, config, streams) if config.is_v4 else hc_collapse(streams, pre)
    return rms_norm(h, params["norm"], config.rms_norm_eps)


def embed_streams(params: dict, config: ModelConfig, token_ids: jax.Array) -> jax.Array:
    emb = gather_rows(params["embed"], token_ids, compute_dtype(config))
    return jnp.broadcast_to(emb[..., None, :], (*token_ids.shape, config.hc_mult, config.hidden_size))


def stream_mean(streams: jax.Array) -> jax.Array:
    """The mean of the hc residual streams `[..., hc, D]` -> `[..., D]` (fp32 sum): what the
    DSpark drafter reads of the target layers it listens to."""
    return jnp.mean(streams.astype(jnp.float32), axis=-2).astype(streams.dtype)


def backbone(params: dict, config: ModelConfig, token_ids: jax.Array, hash_ids: jax.Array | None,
             kernels: KernelConfig | None = None, *, positions: jax.Array | None = None,
             seq: SequenceShards | None = None,
             capture: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """All layers over `[B, T]` tokens at positions 0..T-1, attending over the whole sequence:
    (streams `[B, T, hc, D]`, last pre, `stream_mean` of the streams entering each layer in
    `capture`, in that order).

    Context parallel passes this rank's `positions` (-1 = padding) and `seq` (`attention_full`)."""
    B, T = token_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    shared: dict = {}

    def attend(layer: int, p: dict, x: jax.Array) -> jax.Array:
        return attention_full(p, config, layer, x, positions, shared, kernels, seq)

    walk = walk_layers(params, config, token_ids, hash_ids, attend, kernels, capture=capture)
    return walk.streams, walk.pre, [walk.captured[layer] for layer in capture]


@partial(jax.jit, static_argnames=("config", "kernels", "return_streams"))
def forward_jit(params: dict, config: ModelConfig, token_ids: jax.Array, hash_ids: jax.Array | None,
                kernels: KernelConfig | None = None, return_streams: bool = False):
    """token_ids int32 `[B, T]` at positions 0..T-1 -> fp32 logits `[B, T, vocab]` (and, with
    `return_streams`, the final residual streams, the MTP block's input)."""
    streams, pre, _ = backbone(params, config, token_ids, hash_ids, kernels)
    logits = linear(final_hidden(params, config, streams, pre), params["head"]).astype(jnp.float32)
    return (logits, streams) if return_streams else logits


def engram_hash_ids(config: ModelConfig, token_ids: np.ndarray) -> np.ndarray | None:
    """Host-side Engram hash ids `[B, T, n_engram_layers, n_cols]` (None without Engram layers)."""
    if not config.engram_layer_ids:
        return None
    from deepinfer.model.engram_hash import hasher_for

    hasher = hasher_for(config)
    return np.stack([hasher.hash_ids(np.asarray(row)) for row in token_ids])


def forward(params: dict, config: ModelConfig, token_ids, *, hash_ids=None, kernels: KernelConfig | None = None,
            return_streams: bool = False):
    """Logits of whole sequences. `token_ids` is `[T]` or `[B, T]` (positions start at 0).

    Engram hash ids are computed on the host from the token ids unless given
    (`[B, T, n_engram_layers, n_cols]` int32)."""
    ids = np.asarray(token_ids)
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    if hash_ids is None:
        hash_ids = engram_hash_ids(config, ids)
    out = forward_jit(params, config, jnp.asarray(ids, jnp.int32),
                      None if hash_ids is None else jnp.asarray(hash_ids, jnp.int32), kernels, return_streams)
    if squeeze:
        out = jax.tree.map(lambda a: a[0], out)
    return out


@partial(jax.jit, static_argnames=("config", "kernels"))
def mtp_logits(params: dict, config: ModelConfig, streams: jax.Array, next_ids: jax.Array,
               kernels: KernelConfig | None = None) -> jax.Array:
    """V4's MTP block over whole sequences: at position i it joins the main model's final streams
    `h_i` `[B, T, hc, D]` with the embedding of the NEXT token `t_{i+1}` (`next_ids [B, T]`) and
    predicts `t_{i+2}`: `x = e_proj(enorm(embed(t))) + h_proj(hnorm(h))` (per stream), one
    window-only block at layer id `num_hidden_layers`, then its own `hc_head`, `norm` and the
    shared head."""
    mp = params["mtp"][0]
    B, T = next_ids.shape
    dtype = compute_dtype(config)
    e = rms_norm(gather_rows(params["embed"], next_ids, dtype), mp["enorm"], config.rms_norm_eps)
    h = rms_norm(streams.astype(dtype), mp["hnorm"], config.rms_norm_eps)
    x = linear(e, mp["e_proj"])[..., None, :] + linear(h, mp["h_proj"])
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    pre = jnp.zeros((B, T, config.hc_mult), jnp.float32)  # unused: V4 collapses with each site's own pre
    def attend(layer: int, p: dict, x: jax.Array) -> jax.Array:
        return attention_full(p, config, layer, x, positions, {}, kernels)

    x, _, _ = layer_forward(mp, config, config.num_hidden_layers, x, pre, next_ids, None, attend, kernels)
    h = rms_norm(hc_head(mp, config, x), mp["norm"], config.rms_norm_eps)
    return linear(h, params["head"]).astype(jnp.float32)
