"""Lightning indexer of CSA2 with the two-level (hierarchical) top-k of V4.1.

Index keys are produced only by KV-source layers, from the compressor latent (`wk` + `k_norm`,
RoPE at the group position, FP4 fake-quant); in V4 every CSA layer makes its own with a second
compressor (`compressor.compress_full_v4`). Every index-source layer scores its queries against
its source's keys: `s[t] = sum_h w_h * relu(q_h . k_t) / sqrt(d)`, invisible entries -inf. The
candidate-source layer (20 in the release) also selects a pool of 8-entry blocks that later
Reindex layers are restricted to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.model import qat
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import apply_rope, compress_inv_freq, linear, rms_norm


def index_keys(p: dict, config: ModelConfig, latent: jax.Array, positions: jax.Array) -> jax.Array:
    k = rms_norm(linear(latent, p["wk"]), p["k_norm"], config.rms_norm_eps)
    return qat.index_vector(apply_rope(k, positions, compress_inv_freq(config)), config)


def index_scores(p: dict, config: ModelConfig, x: jax.Array, q_residual: jax.Array, positions: jax.Array,
                 keys: jax.Array, ratio: int) -> jax.Array:
    """x `[B, T, D]` (attn-normed), q_residual `[B, T, q_lora]`, keys `[B, R, d]` -> `[B, T, R]`
    fp32 scores with entries not yet visible to each query (e >= (pos+1)//ratio) at -inf."""
    B, T, _ = x.shape
    nh, d = config.index_n_heads, config.index_head_dim
    q = linear(q_residual, p["wq_b"]).reshape(B, T, nh, d)
    q = qat.index_vector(apply_rope(q, positions, compress_inv_freq(config)), config)
    dots = jnp.einsum("bthd,brd->bthr", q.astype(jnp.float32), keys.astype(jnp.float32))
    dots = jax.nn.relu(dots) * d ** -0.5
    weights = linear(x, p["weights_proj"]).astype(jnp.float32) * nh ** -0.5
    scores = jnp.einsum("bthr,bth->btr", dots, weights)
    visible = jnp.arange(keys.shape[1])[None, None, :] < ((positions + 1) // ratio)[..., None]
    return jnp.where(visible, scores, -jnp.inf)


def candidate_blocks(scores: jax.Array, positions: jax.Array, ratio: int, top_blocks: int,
                     block_size: int) -> jax.Array:
    """Level one: keep the `top_blocks` best blocks of `block_size` entries (block score = max),
    the block holding the query's newest visible entry always kept. Returns a bool mask like
    `scores`."""
    B, T, R = scores.shape
    pad = -R % block_size
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    n_blocks = (R + pad) // block_size
    block_scores = jnp.max(padded.reshape(B, T, n_blocks, block_size), axis=-1)
    newest = ((positions + 1) // ratio - 1) // block_size  # -1 when nothing is visible
    block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
    k = min(top_blocks, n_blocks)
    values, idx = jax.lax.top_k(block_scores, k)
    keep = jnp.zeros((B, T, n_blocks), bool)
    keep = keep.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], idx].set(values > -jnp.inf)
    return jnp.repeat(keep, block_size, axis=-1)[..., :R]


def select_topk(scores: jax.Array, k: int) -> jax.Array:
    """Top-`k` entry indices per query, `-1` where fewer than `k` entries are selectable."""
    if k == 0 or scores.shape[-1] == 0:
        return jnp.zeros((*scores.shape[:-1], 0), jnp.int32)
    k = min(k, scores.shape[-1])
    values, idx = jax.lax.top_k(scores, k)
    return jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)


def dense_selection(positions: jax.Array, n_rows: int, ratio: int) -> jax.Array:
    """V4's HCA attends to every visible compressed row: indices `[B, T, n_rows]`, -1 where the
    row is not visible yet."""
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    return jnp.where(rows < ((positions + 1) // ratio)[..., None], rows, -1)
