"""The lossless acceptance rule of speculative decoding (engine-features.md §2.3, "Acceptance
rule"), for sampled and greedy rows alike, on the device.

A row verifies drafts d_1..d_ℓ, each drawn from the drafter's distribution q_j (given the tokens
before it). With p_j the target's distribution at the same position (after the request's logit
processing, temperature and truncation):

- draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) (a uniform u_j < the ratio);
  the accepted prefix ends at the first rejection;
- at the first rejection the row's next token is drawn from the residual norm(max(0, p_j - q_j));
  when all ℓ are accepted it is the bonus token, drawn from p_{ℓ+1}.

The tokens a row gains then follow the target's distribution exactly, whatever q is. A greedy
row (temperature 0) is the one-hot case: a draft is accepted iff it is the target's argmax, and
the next token is the target's argmax at the first mismatch (or after the last draft).

Randomness is counter-based like the sampler's (`sampler.row_keys`): the uniforms and the
residual/bonus draw are keyed by (seed, position) in streams of their own, independent of the
noise the drafter drew the drafts with and of the plain sampler's, so a row's outcome does not
depend on its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.serve.engine.sampler import blocked_argmax, draw, gumbel, row_keys

__all__ = ["ACCEPT_STREAM", "DRAFT_STREAM", "RESIDUAL_STREAM", "accept", "uniform"]

# seeds XOR-ed with these give independent noise streams (the sampler's own stream is the seed)
DRAFT_STREAM = 0x2545F491
ACCEPT_STREAM = 0x68E31DA4
RESIDUAL_STREAM = 0xB5297A4D


def stream_keys(seed: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """u32 keys `[B, n]` of the positions `[B, n]` of rows with `seed [B]`, in `stream`."""
    salted = seed.astype(jnp.uint32) ^ jnp.uint32(stream)
    return row_keys(jnp.broadcast_to(salted[:, None], positions.shape).reshape(-1),
                    positions.reshape(-1)).reshape(positions.shape)


def uniform(keys: jax.Array) -> jax.Array:
    """f32 in (0, 1) per key (the Gumbel draw's uniform: u = exp(-exp(-g)))."""
    g = gumbel(keys.reshape(-1), jnp.zeros((keys.size, 1), jnp.int32))[:, 0]
    return jnp.exp(-jnp.exp(-g)).reshape(keys.shape)


def accept(target_logp: jax.Array, draft_logp: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
           greedy: jax.Array, seed: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(accepted [B], next_token [B])` of rows with `num_drafts [B]` drafts `drafts [B, K]`.

    `target_logp [B, K+1, V]`: log p at each draft's position and after the last (-inf: cut by
    truncation); `draft_logp [B, K, V]`: log q each draft was drawn from; `greedy [B]`: the
    one-hot rule; `seed [B]` u32; `positions [B, K+1]`: the position each entry of
    `target_logp` decides (the noise keys)."""
    B, K = drafts.shape
    live = jnp.arange(K)[None, :] < num_drafts[:, None]
    greedy_ok = drafts == blocked_argmax(target_logp[:, :K].reshape(B * K, -1)).reshape(B, K)

    def accepted_count(ok):
        return jnp.sum(jnp.cumprod((ok & live).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    def greedy_only(_):  # no sampled row: nothing random to draw (the usual greedy batch)
        accepted = accepted_count(greedy_ok)
        return accepted, blocked_argmax(target_logp[jnp.arange(B), accepted]).astype(jnp.int32)

    def mixed(_):
        return _accept_sampled(target_logp, draft_logp, drafts, live, greedy, greedy_ok, seed, positions,
                               accepted_count)

    return jax.lax.cond(jnp.any(~greedy), mixed, greedy_only, None)


def _accept_sampled(target_logp, draft_logp, drafts, live, greedy, greedy_ok, seed, positions, accepted_count):
    """`accept` when some sampled row verifies drafts."""
    B, K = drafts.shape
    rows = jnp.arange(B)
    p_d = jnp.take_along_axis(target_logp[:, :K], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_logp, drafts[..., None], axis=-1)[..., 0]
    u = uniform(stream_keys(seed, positions[:, :K], ACCEPT_STREAM))
    sampled_ok = jnp.log(u) < p_d - q_d  # u < p/q; never when p = 0 (cut), always when p >= q
    accepted = accepted_count(jnp.where(greedy[:, None], greedy_ok, sampled_ok))

    at = target_logp[rows, accepted]  # [B, V]: where the next token is decided
    rejected = accepted < jnp.sum(live, axis=1)
    q_at = draft_logp[rows, jnp.minimum(accepted, K - 1)] if K else jnp.full_like(at, -jnp.inf)
    p, q = jnp.exp(at), jnp.exp(q_at)
    residual = jnp.maximum(p - q, 0.0)
    # at a rejection the residual has mass (p(d) < q(d) somewhere means p > q elsewhere); rounding
    # could leave none: then p itself
    has_mass = jnp.any(residual > 0, axis=-1)
    use_residual = (rejected & has_mass)[:, None]
    logits = jnp.where(use_residual, jnp.log(residual), at)
    keys = stream_keys(seed, positions[rows, accepted][:, None], RESIDUAL_STREAM)[:, 0]
    drawn = draw(logits, keys)
    next_token = jnp.where(greedy, blocked_argmax(at), drawn).astype(jnp.int32)
    return accepted, next_token
