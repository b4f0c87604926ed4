"""The token sampler, run inside the jitted engine step on the rows' last-token logits, with
vLLM `SamplingParams` semantics; its per-slot settings live on the device (`sampling_state.py`).

`sample(logits, state, slots, rows)` returns the advanced state and one token per row (and,
only with a static `num_logprobs`, log-probabilities). A row reads the settings of its cache
slot `slots[b]`; a row with `rows.emit` (its token is kept) advances that slot's output counts.

Order of operations (vLLM v1 sampler order):

1. `logit_bias` is added to the float32 logits, and while a slot has generated fewer than
   `min_tokens` tokens, its banned tokens (EOS unless ignore_eos, the stop ids) get -1e9.
2. Penalties. Repetition penalty on every token seen in the prompt or the output: a positive logit
   is divided by it, a negative one multiplied. Then frequency and presence penalties on output
   tokens only: `logit -= frequency * count + presence * (count > 0)`.
3. Greedy rows (temperature 0) take the argmax of these processed logits (the lowest id on ties).
4. Random rows: divide by temperature; min-p mask (keep tokens with `p >= min_p * p_max`,
   computed in log space); top-k mask (the k best, ties broken towards the lower token id); top-p
   mask on the probabilities that are left after top-k (the smallest prefix of the sorted tokens
   whose mass reaches `top_p`; the best token is always kept).
5. Gumbel-max: the token maximising `scaled + g`, `g = -log(-log u)` with `u` from a 32-bit hash
   of (seed, position, token id): counter-based, so a row's token depends only on its logits,
   settings, seed and position, never on the batch size, its row or its neighbours (no float
   reduction mixes rows). Drawn in two levels, which is the same distribution: a block of 256
   tokens by Gumbel-max over the blocks' log-sum-exps (noise keyed by the block index), then a
   token of that block by Gumbel-max over its 256 values. So a row draws 256 + V/256 noise
   values, not V, and the step pays one exp per logit: about 0.5 ms for 8 rows of 129,280 on a
   CPU, where full-vocabulary threefry noise cost about 20 ms.

A structured-output step (`SampleRows.allowed`) first sets the logits of the tokens the rows'
grammars forbid to -inf (`apply_bitmask`), so everything after, raw log-probabilities included,
sees the masked distribution, as vLLM's grammar bitmask does.

Steps 1, 2 and 4 and the draw are skipped (`lax.cond`) when no emitting row needs them, so a
step compiles once whatever its rows ask for. The only static choice is `num_logprobs`:

* None: no log-probabilities are computed (no log-softmax, no rank, no top-k over V);
* n >= 0: `SampleOutput.logprobs` / `ranks` hold the sampled token's raw log-probability and
  1-based rank (the number of tokens with a log-probability >= its own), and `top_ids` /
  `top_logprobs` the n most likely tokens. Raw means vLLM's default
  `logprobs_mode="raw_logprobs"`: the log-softmax of the logits as the model produced them,
  before bias, penalties, temperature and truncation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer.serve.engine import placeholders
from deepinfer.serve.engine.sampling_state import SamplingState

__all__ = ["BLOCK", "SampleOutput", "SampleRows", "Sampler", "apply_bitmask", "blocked_argmax", "choose", "draw", "gumbel", "process_logits",
           "row_keys", "sample", "slot_settings", "truncate", "with_logprobs"]

BLOCK = 256
"""Tokens per block of the two-level draw."""
BAN = -1e9
"""What a min_tokens ban adds to a logit."""
_GOLDEN = 0x9E3779B9
_BLOCK_STREAM = 0x5BD1E995  # the block noise's key differs from the token noise's


@functools.partial(jax.tree_util.register_dataclass, data_fields=["emit", "position", "folds", "allowed"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SampleRows:
    """Per-row inputs of a step's sampler besides the slots."""

    emit: Any  # bool[B]: the row's token is kept (a decode row, a prompt's last chunk); else padding
    position: Any  # i32[B]: absolute position of the token being sampled
    # u32[B, n_engram_layers, N-1, 2]: the Engram look-back folds of a decode step's rows, for
    # rows whose input token is a placeholder (`placeholders.py`); None in prefill steps and
    # without Engram
    folds: Any = None
    # i32[B, ceil(V / 32)]: the structured-output bitmask of each row (`serve.structured`: token
    # i is allowed iff bit i % 32 of word i // 32 is set; unconstrained rows are all ones); None
    # when no row of the step is constrained, which compiles the step without it
    allowed: Any = None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "logprobs", "ranks", "top_ids", "top_logprobs"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    tokens: Any  # i32[B]
    logprobs: Any = None  # f32[B] raw log-probability of the sampled token (num_logprobs set)
    ranks: Any = None  # i32[B] its 1-based rank in the raw distribution
    top_ids: Any = None  # i32[B, n]
    top_logprobs: Any = None  # f32[B, n]


# ------------------------------------------------------------------------------------- noise


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (Wellons' lowbias32): every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """u32 key of each row's noise, from (seed u32, position i32)."""
    return _mix(_mix(seed.astype(jnp.uint32)) ^ (position.astype(jnp.uint32) * jnp.uint32(_GOLDEN)))


def gumbel(keys: jax.Array, ids: jax.Array) -> jax.Array:
    """f32 Gumbel noise of (key, id): `keys u32[B]`, `ids [B, n]` (token or block ids).

    u = (2k + 1) / 2**24 with k the hash's top 23 bits: exact in float32, inside (0, 1)."""
    bits = _mix(keys[:, None] ^ _mix(ids.astype(jnp.uint32) + jnp.uint32(_GOLDEN)))
    u = (bits >> 9).astype(jnp.float32) * jnp.float32(2.0 ** -23) + jnp.float32(2.0 ** -24)
    return -jnp.log(-jnp.log(u))


# ------------------------------------------------------------------------------ arg-maxima


def _first_argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum on the last axis (two plain reductions: XLA's CPU backend runs
    a variadic argmax reduction ~20x slower)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, iota, x.shape[-1]), axis=-1)


def _blocks(x: jax.Array) -> jax.Array:
    """`[B, V]` -> `[B, ceil(V / BLOCK), BLOCK]`, padded with -inf."""
    B, V = x.shape
    pad = -V % BLOCK
    if pad:
        x = jnp.concatenate([x, jnp.full((B, pad), -jnp.inf, x.dtype)], axis=1)
    return x.reshape(B, -1, BLOCK)


def _pick(blocks: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]


def blocked_argmax(x: jax.Array) -> jax.Array:
    """`argmax(x, -1)` (lowest id on ties) of `x [B, V]`, through the block maxima."""
    blocks = _blocks(x)
    b = _first_argmax(jnp.max(blocks, axis=-1))
    return b * BLOCK + _first_argmax(_pick(blocks, b))


def draw(scaled: jax.Array, keys: jax.Array) -> jax.Array:
    """Two-level Gumbel-max over `scaled [B, V]` (-inf: excluded) with per-row noise `keys`."""
    blocks = _blocks(scaled)
    top = jnp.max(blocks, axis=-1)
    top = jnp.where(top > -jnp.inf, top, 0.0)  # an excluded block's log-sum-exp is -inf
    lse = jnp.log(jnp.sum(jnp.exp(blocks - top[..., None]), axis=-1)) + top
    block_ids = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 1)
    b = _first_argmax(lse + gumbel(_mix(keys ^ jnp.uint32(_BLOCK_STREAM)), block_ids))
    ids = b[:, None] * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (b.shape[0], BLOCK), 1)
    return b * BLOCK + _first_argmax(_pick(blocks, b) + gumbel(keys, ids))


# ------------------------------------------------------------------------------- processing


def apply_bitmask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """`logits [B, V]` with the tokens that `allowed [B, ceil(V / 32)]` (int32 words, little-endian
    bits) does not allow set to -inf."""
    B, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (allowed.astype(jnp.uint32)[:, :, None] >> shifts) & jnp.uint32(1)
    return jnp.where(bits.reshape(B, -1)[:, :V] != 0, logits, -jnp.inf)


def slot_settings(state: SamplingState, slots: jax.Array) -> dict[str, jax.Array]:
    """The per-slot scalars and lists of each row (the dense history stays where it is)."""
    names = [f.name for f in dataclasses.fields(state) if f.name not in ("output_counts", "prompt_seen")]
    return {name: getattr(state, name)[slots] for name in names}


def _penalized(p: dict) -> jax.Array:
    return (p["presence_penalty"] != 0) | (p["frequency_penalty"] != 0) | (p["repetition_penalty"] != 1)


def process_logits(logits: jax.Array, state: SamplingState, slots: jax.Array, emit: jax.Array,
                   earlier: jax.Array | None = None) -> jax.Array:
    """Steps 1-2: float32 logits with bias, min_tokens bans and penalties applied.

    `earlier i32[B, n]` (None: none): output tokens a row gained after the state was last
    advanced (-1: no token), counted as outputs by the bans and the penalties. A speculative
    verify position sees the drafts before it this way, so that its distribution is the one a
    plain decode step would sample from after accepting them."""
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    p = slot_settings(state, slots)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    num_output = p["num_output"] if earlier is None else p["num_output"] + jnp.sum(earlier >= 0, axis=1)
    bans = jnp.where((num_output < p["min_tokens"])[:, None], p["ban_ids"], -1)
    ids = jnp.concatenate([p["bias_ids"], bans], axis=1)
    values = jnp.concatenate([p["bias_values"], jnp.full(bans.shape, BAN, jnp.float32)], axis=1)

    def bias(x):
        return x.at[rows, jnp.where(ids >= 0, ids, V)].add(values, mode="drop")

    logits = jax.lax.cond(jnp.any(emit[:, None] & (ids >= 0)), bias, lambda x: x, logits)
    penalized = _penalized(p)

    def penalties(x):
        counts = state.output_counts[slots]
        if earlier is not None:
            counts = counts.at[rows, jnp.where(earlier >= 0, earlier, V)].add(1, mode="drop")
        seen = (state.prompt_seen[slots] | (counts > 0)) & penalized[:, None]
        rep = p["repetition_penalty"][:, None]
        cur = jnp.where(x > 0, x / rep, x * rep)
        counts = counts.astype(jnp.float32)
        cur = cur - p["frequency_penalty"][:, None] * counts - p["presence_penalty"][:, None] * (counts > 0)
        return jnp.where(seen, cur, x)

    return jax.lax.cond(jnp.any(emit & penalized), penalties, lambda x: x, logits)


def _top_k_top_p_keep(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool[B, V]: tokens that survive top-k, then top-p on the renormalised remainder."""
    B, V = scaled.shape
    iota = jax.lax.broadcasted_iota(jnp.int32, (B, V), 1)
    neg_sorted, order = jax.lax.sort((-scaled, iota), dimension=1, is_stable=True, num_keys=1)
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    keep = iota < k  # iota doubles as the rank in sorted order
    vals = jnp.where(keep, -neg_sorted, -jnp.inf)
    probs = jax.nn.softmax(vals, axis=1)
    mass_before = jnp.cumsum(probs, axis=1) - probs
    p = top_p[:, None]
    keep &= (p >= 1.0) | (mass_before < p) | (iota == 0)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    return jnp.zeros((B, V), jnp.bool_).at[rows, order].set(keep, unique_indices=True)


def truncate(scaled: jax.Array, p: dict, live: jax.Array) -> jax.Array:
    """Step 4's masks on temperature-scaled logits (-inf: cut); `live` rows decide whether the
    masks run at all."""
    min_p = p["min_p"]

    def cut_min_p(x):
        floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
        return jnp.where(x >= floor, x, -jnp.inf)

    scaled = jax.lax.cond(jnp.any(live & (min_p > 0)), cut_min_p, lambda x: x, scaled)

    def cut_top_k_top_p(x):
        return jnp.where(_top_k_top_p_keep(x, p["top_k"], p["top_p"]), x, -jnp.inf)

    truncating = (p["top_k"] > 0) | (p["top_p"] < 1)
    return jax.lax.cond(jnp.any(live & truncating), cut_top_k_top_p, lambda x: x, scaled)


def with_logprobs(raw: jax.Array, tokens: jax.Array, num_logprobs: int) -> SampleOutput:
    """`tokens [B]` taken from `raw [B, V]` with their raw log-probabilities and ranks and the
    `num_logprobs` most likely tokens (the `num_logprobs` choice of the module docstring)."""
    raw_logprobs = jax.nn.log_softmax(raw, axis=-1)
    token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=1)[:, 0]
    ranks = jnp.sum(raw_logprobs >= token_logprobs[:, None], axis=-1, dtype=jnp.int32)
    top_ids = top_logprobs = None
    if num_logprobs > 0:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, min(num_logprobs, raw.shape[1]))
        top_ids = top_ids.astype(jnp.int32)
    return SampleOutput(tokens, token_logprobs, ranks, top_ids, top_logprobs)


def prompt_logprobs(logits: jax.Array, targets: jax.Array, num_logprobs: int) -> SampleOutput:
    """vLLM's prompt logprobs of a prefill chunk: at each position of `logits [B, T, V]` (the
    model's raw logits there) the next prompt token `targets [B, T]` (any id where there is none)
    with its raw log-probability and rank, and the `num_logprobs` most likely tokens; every
    field `[B, T, ...]`."""
    B, T, V = logits.shape
    out = with_logprobs(logits.reshape(B * T, V), targets.reshape(B * T), num_logprobs)
    return jax.tree.map(lambda a: a.reshape(B, T, *a.shape[1:]), out)


# ---------------------------------------------------------------------------------- the step


def choose(processed: jax.Array, p: dict[str, jax.Array], emit: jax.Array, position: jax.Array) -> jax.Array:
    """Step 3, each row's token from its processed logits `[B, V]` (`process_logits`) and
    settings `p` (`slot_settings`): the argmax for greedy rows; for sampled rows, temperature,
    truncation and the two-level Gumbel draw keyed by (seed, `position`), the position of the
    token being sampled. `emit`: rows whose draw counts (the others are not truncated)."""
    greedy = blocked_argmax(processed)
    is_random = p["temperature"] > 0
    live = emit & is_random

    def draw_random(x):
        scaled = x / jnp.where(is_random, p["temperature"], 1.0)[:, None]
        return draw(truncate(scaled, p, live), row_keys(p["seed"], position))

    drawn = jax.lax.cond(jnp.any(live), draw_random, lambda x: greedy, processed)
    return jnp.where(is_random, drawn, greedy).astype(jnp.int32)


def sample(logits: jax.Array, state: SamplingState, slots: jax.Array, rows: SampleRows, *,
           num_logprobs: int | None = None) -> tuple[SamplingState, SampleOutput]:
    """One token per row of `logits [B, V]` (traced inside the step; see the module docstring).
    `slots i32[B]`: each row's slot in `state` (ids local to this device's share)."""
    with jax.named_scope("sampler"):
        # the logits are materialised once: left fusable, XLA recomputed the model's head
        # projection inside the sampler's full-vocabulary passes (measured: ~20 % of a CPU step)
        raw = jax.lax.optimization_barrier(logits.astype(jnp.float32))
        if rows.allowed is not None:  # structured output: before everything, as in vLLM
            raw = apply_bitmask(raw, rows.allowed)
        processed = process_logits(raw, state, slots, rows.emit)
        tokens = choose(processed, slot_settings(state, slots), rows.emit, rows.position)

        out = SampleOutput(tokens) if num_logprobs is None else with_logprobs(raw, tokens, num_logprobs)

        S = state.num_output.shape[0]
        kept = jnp.where(rows.emit, slots, S)  # S: dropped
        state = dataclasses.replace(
            state, num_output=state.num_output.at[kept].add(1, mode="drop"),
            last_token=state.last_token.at[kept].set(tokens, mode="drop"),
            output_counts=state.output_counts.at[kept, tokens].add(1, mode="drop"))
        return state, out


@dataclasses.dataclass(frozen=True)
class Sampler:
    """`sample` with its static choice bound: the hashable head the engine step runs after the
    model (`sharding.engine_step.MeshStep` takes it as `head`)."""

    num_logprobs: int | None = None

    def __call__(self, logits, state, slots, rows):
        return sample(logits, state, slots, rows, num_logprobs=self.num_logprobs)

    @staticmethod
    def resolve(batch, state, rows, config):
        """The step's input with its placeholder tokens filled in from the state, before the
        model runs (`placeholders.resolve`)."""
        return placeholders.resolve(batch, state, rows, config)
