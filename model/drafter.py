"""DeepSeek-V4.1's DSpark drafter (the checkpoint's `mtp.0..n-1`): one parallel pass proposes a
block of `dspark_block_size` tokens, a rank-r Markov head chains them, a confidence head scores
each (model-v4.1-flash.md §2.9; vLLM 0.33 `models/deepseek_v41/nvidia/dspark.py` and its DSpark
speculator).

- Context ("KV injection"): the target's residual streams entering `dspark_target_layer_ids`,
  averaged over the streams, are joined by `mtp.0.main_proj` + `main_norm` into `main_x`. Each
  draft block projects `main_x` with its OWN `wkv` + `kv_norm` + RoPE into window KV rows at the
  target's positions: the drafter rings the engine keeps per sequence (`context_kv`).
- Block: the anchor (the token just sampled from the target, at position p) and N-1 noise tokens
  at p+1..p+N-1 run through the draft blocks: backbone-shaped window-only layers with their own
  MoE (`dspark_n_routed_experts`, top `dspark_num_experts_per_tok`), whose attention is NOT
  causal: every block token sees the context rows [p-W, p) and the whole block.
- Heads: the streams collapse with the last FFN site's `pre` (`head_hidden`); base logits come
  from the last block's `norm` and the SHARED `head`; position j predicts token p+j+1, biased by
  the Markov head from the token drafted before it (the anchor for j = 0).

`propose` drafts greedily unless given a `pick` (how the speculative-decoding loop draws sampled
drafts: `serve/engine/speculative.py`); verification and the planner belong to that loop.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model import qat
from deepinfer.model.attention import output_projection, query, window_kv_unquantized
from deepinfer.model.config import ModelConfig
from deepinfer.model.forward import backbone, embed_streams, engram_hash_ids, mixes
from deepinfer.model.kv_cache import CacheLayout, KVCache, decode
from deepinfer.model.layers import gather_rows, linear, rms_norm
from deepinfer.model.mhc import hc_collapse, hc_expand
from deepinfer.model.moe import moe
from deepinfer.model.params import compute_dtype
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


def has_drafter(params: dict, config: ModelConfig) -> bool:
    """True when the params hold V4.1's DSpark blocks (checkpoints may leave `mtp.*` out)."""
    return not config.is_v4 and bool(config.dspark_target_layer_ids) and "mtp" in params


def context_input(params: dict, config: ModelConfig, target_means: list[jax.Array]) -> jax.Array:
    """`main_x [..., D]` from the `stream_mean` of the streams entering each target layer."""
    mp = params["mtp"][0]
    return rms_norm(linear(jnp.concatenate(target_means, axis=-1), mp["main_proj"]), mp["main_norm"],
                    config.rms_norm_eps)


def context_kv(params: dict, config: ModelConfig, block: int, main_x: jax.Array, positions: jax.Array) -> jax.Array:
    """Draft block `block`'s window KV rows `[B, T, hd]` of `main_x` at `positions`, before the
    QAT fake-quant (what the packed ring encodes; `qat.window_kv` gives the attended values)."""
    return window_kv_unquantized(params["mtp"][block]["attn"], config, config.num_hidden_layers + block,
                                 main_x, positions)


def _block_attention(p: dict, config: ModelConfig, layer: int, x: jax.Array, positions: jax.Array,
                     ctx_kv: jax.Array, ctx_visible: jax.Array, kernels: KernelConfig | None) -> jax.Array:
    """Non-causal window attention of the block `x [B, N, D]` over [context rows ++ block]."""
    B, N, _ = x.shape
    q, _ = query(p, config, layer, x, positions)
    kv = qat.window_kv(window_kv_unquantized(p, config, layer, x, positions), config)
    dtype = compute_dtype(config)
    keys = jnp.concatenate([ctx_kv.astype(dtype), kv.astype(dtype)], axis=1)
    mask = jnp.concatenate([jnp.broadcast_to(ctx_visible[:, None, :], (B, N, ctx_visible.shape[1])),
                            jnp.ones((B, N, N), bool)], axis=-1)
    attend = get_kernel("sparse_attention", kernels)
    o = attend(q, keys, mask, jnp.zeros((B, 0, config.head_dim), dtype), jnp.zeros((B, N, 0), jnp.int32),
               p["attn_sink"], config.head_dim ** -0.5)
    return output_projection(p, config, layer, o, positions)


def block_tokens(config: ModelConfig, anchor: jax.Array, anchor_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The draft block's tokens `[B, N]` (anchor, then noise) and positions (p .. p+N-1)."""
    N = config.dspark_block_size
    tokens = jnp.concatenate([anchor[:, None].astype(jnp.int32),
                              jnp.full((anchor.shape[0], N - 1), config.dspark_noise_token_id, jnp.int32)], axis=1)
    return tokens, anchor_pos[:, None].astype(jnp.int32) + jnp.arange(N, dtype=jnp.int32)


def draft_hidden(params: dict, config: ModelConfig, ctx_kv: list[jax.Array], ctx_pos: jax.Array, anchor: jax.Array,
                 anchor_pos: jax.Array, floor: jax.Array | None = None,
                 kernels: KernelConfig | None = None, ep=None) -> jax.Array:
    """The draft blocks over one block per row -> `head_hidden [B, N, D]` (before the norm).
    `ep`: the MoE's expert-parallel exchange on a mesh (`model.moe.moe`).

    `ctx_kv[i]` `[B, S, hd]`: block i's context rows (fake-quantized values) at `ctx_pos [B, S]`
    (-1 = empty); a row is visible iff its position is in [p - W, p) and >= `floor` (the
    compact-prefill replay start; rows below it were never written)."""
    tokens, positions = block_tokens(config, anchor, anchor_pos)
    p = anchor_pos[:, None]
    visible = (ctx_pos >= 0) & (ctx_pos < p) & (ctx_pos >= p - config.sliding_window)
    if floor is not None:
        visible = visible & (ctx_pos >= floor[:, None])
    B, N = tokens.shape
    streams = embed_streams(params, config, tokens)
    pre = jax.nn.one_hot(jnp.zeros((B, N), jnp.int32), config.hc_mult, dtype=jnp.float32)
    for i, bp in enumerate(params["mtp"]):
        layer = config.num_hidden_layers + i
        with jax.named_scope(f"draft_block_{i}"):
            a_pre, a_post, a_comb = mixes(bp, "attn", streams, config, kernels)
            x = rms_norm(hc_collapse(streams, pre), bp["attn_norm"], config.rms_norm_eps)
            y = _block_attention(bp["attn"], config, layer, x, positions, ctx_kv[i], visible, kernels)
            streams = hc_expand(y, streams, a_post, a_comb)
            f_pre, f_post, f_comb = mixes(bp, "ffn", streams, config, kernels)
            x = rms_norm(hc_collapse(streams, a_pre), bp["ffn_norm"], config.rms_norm_eps)
            y = moe(bp["ffn"], config, x, n_active=config.dspark_num_experts_per_tok, kernels=kernels, ep=ep)
            streams = hc_expand(y, streams, f_post, f_comb)
            pre = f_pre
    return hc_collapse(streams, pre)


def greedy_pick(logits: jax.Array, j: int) -> tuple[jax.Array, jax.Array]:
    """Position j's draft from its logits `[B, V]`: the argmax (and nothing to keep: `[B, 0]`)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits[:, :0]


def propose(params: dict, config: ModelConfig, head_hidden: jax.Array, anchor: jax.Array,
            pick: Callable = greedy_pick) -> dict:
    """Drafts through the Markov chain: `tokens [B, N]`, their `logits [B, N, vocab]` (base +
    Markov bias, fp32), `confidence [B, N]` (predicted acceptance, sigmoid) and `picked [B, N,
    vocab]`: what `pick(logits [B, V], j) -> (token [B], picked [B, V])` drew each draft from
    (the greedy default takes the argmax and keeps nothing: `[B, N, 0]`)."""
    last = params["mtp"][-1]
    base = linear(rms_norm(head_hidden, last["norm"], config.rms_norm_eps), params["head"]).astype(jnp.float32)
    markov, proj = last["markov_head"], last["confidence_head"]["proj"]
    hidden = head_hidden.astype(jnp.float32)

    def step(prev, j):
        m = gather_rows(markov["embed"], prev, jnp.float32)  # [B, r]
        logits = base[:, j] + linear(m, markov["head"])
        token, picked = pick(logits, j)
        confidence = jax.nn.sigmoid(linear(jnp.concatenate([hidden[:, j], m], axis=-1), proj)[:, 0])
        return token, (token, logits, confidence, picked)

    _, (tokens, logits, confidence, picked) = jax.lax.scan(step, anchor.astype(jnp.int32),
                                                            jnp.arange(config.dspark_block_size))
    return {"tokens": tokens.T, "logits": jnp.moveaxis(logits, 0, 1), "confidence": confidence.T,
            "picked": jnp.moveaxis(picked, 0, 1), "head_hidden": head_hidden}


@partial(jax.jit, static_argnames=("config", "kernels"))
def _draft_after_jit(params: dict, config: ModelConfig, token_ids: jax.Array, hash_ids: jax.Array | None,
                     anchor: jax.Array, kernels: KernelConfig | None = None) -> dict:
    B, T = token_ids.shape
    _, _, means = backbone(params, config, token_ids, hash_ids, kernels, capture=config.dspark_target_layer_ids)
    main_x = context_input(params, config, means)
    S = min(T, config.sliding_window)
    positions = jnp.broadcast_to(jnp.arange(T - S, T, dtype=jnp.int32), (B, S))
    ctx = [qat.window_kv(context_kv(params, config, i, main_x[:, T - S:], positions), config)
           for i in range(len(params["mtp"]))]
    anchor_pos = jnp.full((B,), T, jnp.int32)
    hidden = draft_hidden(params, config, ctx, positions, anchor, anchor_pos, kernels=kernels)
    return {**propose(params, config, hidden, anchor), "main_x": main_x}


def draft_after(params: dict, config: ModelConfig, token_ids, anchor, *, kernels: KernelConfig | None = None) -> dict:
    """The drafter from whole sequences (the reference the engine's rings are checked against):
    the target has processed `token_ids` `[B, T]` (positions 0..T-1) and sampled `anchor [B]`
    (position T). Returns `propose`'s dict plus `main_x [B, T, D]`."""
    if not has_drafter(params, config):
        raise ValueError("these params have no DSpark drafter (`mtp.*` of a DeepSeek-V4.1 checkpoint)")
    ids = np.asarray(token_ids, np.int32)
    hash_ids = engram_hash_ids(config, ids)
    return _draft_after_jit(params, config, jnp.asarray(ids), None if hash_ids is None else jnp.asarray(hash_ids),
                            jnp.asarray(anchor, jnp.int32), kernels)


def draft_block(params: dict, config: ModelConfig, layout: CacheLayout, cache: KVCache, slots: jax.Array,
                anchor: jax.Array, anchor_pos: jax.Array, floor: jax.Array | None = None,
                kernels: KernelConfig | None = None, pick: Callable = greedy_pick, ep=None) -> dict:
    """Drafts for the sequences in cache `slots [B]` from their drafter rings: the target has
    processed positions < `anchor_pos [B]` and sampled `anchor [B]`. Returns `propose`'s dict
    (drafted with `pick`); traced inside the caller's program (on a mesh: one rank's share, its
    local slots, under the step's `shard_map` with `ep`)."""
    if not layout.draft_rings:
        raise ValueError("this cache keeps no drafter rings (CacheLayout.draft_rings == 0)")
    L = config.num_hidden_layers
    ctx = [decode("window", tuple(w[L + i, slots] for w in cache.window), compute_dtype(config))
           for i in range(layout.draft_rings)]
    hidden = draft_hidden(params, config, ctx, cache.window_pos[slots], anchor, anchor_pos, floor, kernels, ep)
    return propose(params, config, hidden, anchor, pick)


@partial(jax.jit, static_argnames=("config", "layout", "kernels"))
def draft_from_cache(params: dict, config: ModelConfig, layout: CacheLayout, cache: KVCache, slots: jax.Array,
                     anchor: jax.Array, anchor_pos: jax.Array, floor: jax.Array | None = None,
                     kernels: KernelConfig | None = None) -> dict:
    """Greedy `draft_block` as its own program. Equals `draft_after` on the whole sequences
    (the engine tests check it)."""
    return draft_block(params, config, layout, cache, slots, anchor, anchor_pos, floor, kernels)
