"""The full-fidelity forward pass over whole sequences (all layers on every token, as the
official references do), for DeepSeek-V4.1 and DeepSeek-V4. The engine's chunked prefill and
decode steps are checked against this function."""

from __future__ import annotations

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


def layer_forward(lp: dict, config: ModelConfig, layer: int, streams: jax.Array, pre: jax.Array,
                  positions: jax.Array, token_ids: jax.Array, hash_ids: jax.Array | None, shared: dict,
                  kernels: KernelConfig | None, seq: SequenceShards | None = None) -> tuple[jax.Array, jax.Array]:
    """One block: [Engram] -> attention site -> FFN site. Returns (streams, this FFN site's pre).
    `seq`: context-parallel shards (see `attention_full`); only attention mixes tokens.

    V4.1 (single-pass mHC) collapses each site with the PREVIOUS site's `pre`; V4 with its own."""
    if layer in config.engram_layer_ids:
        streams = engram(lp["engram"], config, streams, hash_ids[:, :, config.engram_layer_ids.index(layer)])
    a_pre, a_post, a_comb = mixes(lp, "attn", streams, config, kernels)
    x = rms_norm(hc_collapse(streams, a_pre if config.is_v4 else pre), lp["attn_norm"], config.rms_norm_eps)
    y = attention_full(lp["attn"], config, layer, x, positions, shared, kernels, seq)
    streams = hc_expand(y, streams, a_post, a_comb)
    f_pre, f_post, f_comb = mixes(lp, "ffn", streams, config, kernels)
    x = rms_norm(hc_collapse(streams, f_pre if config.is_v4 else a_pre), lp["ffn_norm"], config.rms_norm_eps)
    y = moe(lp["ffn"], config, x, token_ids=token_ids, kernels=kernels)
    return hc_expand(y, streams, f_post, f_comb), f_pre


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
    """All layers over `[B, T]` tokens at positions 0..T-1: (streams `[B, T, hc, D]`, last pre,
    `stream_mean` of the streams entering each layer in `capture`, in that order).

    Context parallel passes this rank's `positions` (-1 = padding) and `seq` (`attention_full`)."""
    B, T = token_ids.shape
    streams = embed_streams(params, config, token_ids)
    pre = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), config.hc_mult, dtype=jnp.float32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    shared: dict = {}
    captured = {}
    for layer in range(config.num_hidden_layers):
        if layer in capture:
            captured[layer] = stream_mean(streams)
        with jax.named_scope(f"layer_{layer}"):
            streams, pre = layer_forward(params["layers"][layer], config, layer, streams, pre, positions,
                                         token_ids, hash_ids, shared, kernels, seq)
    return streams, pre, [captured[layer] for layer in capture]


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
    x, _ = layer_forward(mp, config, config.num_hidden_layers, x, pre, positions, next_ids, None, {}, kernels)
    h = rms_norm(hc_head(mp, config, x), mp["norm"], config.rms_norm_eps)
    return linear(h, params["head"]).astype(jnp.float32)
