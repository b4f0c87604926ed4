"""The full-fidelity forward pass of DeepSeek-V4.1 over whole sequences (all layers on every
token, as the official reference does). The engine's chunked prefill and decode steps are
checked against this function."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.attention import attention_full
from deepinfer.model.config import ModelConfig
from deepinfer.model.engram import engram
from deepinfer.model.layers import gather_rows, linear, rms_norm
from deepinfer.model.mhc import hc_collapse, hc_expand, hc_mixes
from deepinfer.model.moe import moe
from deepinfer.model.params import compute_dtype
from deepinfer.pallas_kernels.registry import KernelConfig


def mixes(lp: dict, site: str, streams: jax.Array, config: ModelConfig):
    return hc_mixes(streams, lp[f"hc_{site}_fn"], lp[f"hc_{site}_base"], lp[f"hc_{site}_scale"],
                    norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters)


def layer_forward(lp: dict, config: ModelConfig, layer: int, streams: jax.Array, pre: jax.Array,
                  positions: jax.Array, hash_ids: jax.Array | None, shared: dict,
                  kernels: KernelConfig | None) -> tuple[jax.Array, jax.Array]:
    """One block: [Engram] -> attention site -> FFN site. Returns (streams, this FFN site's pre)."""
    if layer in config.engram_layer_ids:
        streams = engram(lp["engram"], config, streams, hash_ids[:, :, config.engram_layer_ids.index(layer)])
    a_pre, a_post, a_comb = mixes(lp, "attn", streams, config)
    x = rms_norm(hc_collapse(streams, pre), lp["attn_norm"], config.rms_norm_eps)
    y = attention_full(lp["attn"], config, layer, x, positions, shared, kernels)
    streams = hc_expand(y, streams, a_post, a_comb)
    f_pre, f_post, f_comb = mixes(lp, "ffn", streams, config)
    x = rms_norm(hc_collapse(streams, a_pre), lp["ffn_norm"], config.rms_norm_eps)
    streams = hc_expand(moe(lp["ffn"], config, x, kernels=kernels), streams, f_post, f_comb)
    return streams, f_pre


@partial(jax.jit, static_argnames=("config", "kernels"))
def forward_jit(params: dict, config: ModelConfig, token_ids: jax.Array, hash_ids: jax.Array | None,
                kernels: KernelConfig | None = None) -> jax.Array:
    """token_ids int32 `[B, T]` at positions 0..T-1 -> fp32 logits `[B, T, vocab]`."""
    B, T = token_ids.shape
    dtype = compute_dtype(config)
    emb = gather_rows(params["embed"], token_ids, dtype)
    streams = jnp.broadcast_to(emb[:, :, None, :], (B, T, config.hc_mult, config.hidden_size))
    pre = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), config.hc_mult, dtype=jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    shared: dict = {}
    for layer in range(config.num_hidden_layers):
        with jax.named_scope(f"layer_{layer}"):
            streams, pre = layer_forward(params["layers"][layer], config, layer, streams, pre, positions,
                                         hash_ids, shared, kernels)
    h = rms_norm(hc_collapse(streams, pre), params["norm"], config.rms_norm_eps)
    return linear(h, params["head"]).astype(jnp.float32)


def forward(params: dict, config: ModelConfig, token_ids, *, hash_ids=None,
            kernels: KernelConfig | None = None) -> jax.Array:
    """Logits of whole sequences. `token_ids` is `[T]` or `[B, T]` (positions start at 0).

    Engram hash ids are computed on the host from the token ids unless given
    (`[B, T, n_engram_layers, n_cols]` int32)."""
    ids = np.asarray(token_ids) if not isinstance(token_ids, jax.core.Tracer) else token_ids
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    if hash_ids is None and config.engram_layer_ids:
        from deepinfer.model.engram_hash import hasher_for

        hasher = hasher_for(config)
        hash_ids = np.stack([hasher.hash_ids(np.asarray(row)) for row in ids])
    logits = forward_jit(params, config, jnp.asarray(ids, jnp.int32),
                         None if hash_ids is None else jnp.asarray(hash_ids, jnp.int32), kernels)
    return logits[0] if squeeze else logits
