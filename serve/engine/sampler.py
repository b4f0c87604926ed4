"""Batch token sampler with vLLM `SamplingParams` semantics, one jitted function per batch shape.

Two halves:

* Host: `build_sampling_tensors` turns one parameter object per request (anything with attributes
  named like vLLM's `SamplingParams` fields) plus per-request positions and token histories into a
  `SamplingTensors` pytree of padded per-row numpy arrays.
* Device: `sample(logits, tensors, rng_key, num_logprobs)` runs the whole batch in one jitted call
  and returns a `SampleOutput`.

Order of operations (vLLM v1 sampler order):

1. `logit_bias` is added to the float32 logits.
2. Penalties. Repetition penalty on every token seen in the prompt or the output: a positive logit
   is divided by it, a negative one multiplied. Then frequency and presence penalties on output
   tokens only: `logit -= frequency * count + presence * (count > 0)`.
3. Greedy rows (temperature < `GREEDY_EPS`) take the argmax of these processed logits.
4. Random rows: divide by temperature; min-p mask (keep tokens with `p >= min_p * p_max`,
   computed in log space); top-k mask (the k best, ties broken towards the lower token id); top-p
   mask on the probabilities that are left after top-k (the smallest prefix of the sorted tokens
   whose mass reaches `top_p`; the best token is always kept).
5. Gumbel-max: `argmax(masked_logits / T + g)` where `g` is standard Gumbel noise over the whole
   vocabulary. A seeded row draws `g` from `fold_in(key(seed), position)`, so its tokens depend
   only on (logits, parameters, seed, position), never on batch size, row index or neighbours.
   An unseeded row draws from `fold_in(rng_key, row)`; the caller must pass a fresh `rng_key` for
   every step.

Log-probabilities follow vLLM's default `logprobs_mode="raw_logprobs"`: they are the log-softmax
of the logits exactly as the model produced them, before bias, penalties, temperature and any
truncation. `SampleOutput.logprobs` is that value for the sampled token, `ranks` its 1-based rank
in that distribution (the number of tokens with a log-probability >= its own), and with
`num_logprobs = n > 0` `top_ids` / `top_logprobs` hold the n most likely tokens (n = -1: the whole
vocabulary).

Representations (memory at most O(B*V), usually far less):

* Penalty history is sparse and deduplicated: `seen_ids i32[B, H]` holds, per row, the distinct
  token ids that a penalty can touch (output tokens, plus prompt tokens when that row has a
  repetition penalty), padded with -1; `seen_output_counts i32[B, H]` holds how often each of them
  occurs in the output (0 for prompt-only tokens). H <= V after deduplication, bucketed to a power
  of two. The device gathers the H logits of each row, rewrites them and scatters them back: no
  [B, V] count table is built or kept. Rows without penalties carry only padding, and when no row
  has a penalty H is 0.
* Logit bias is sparse: `bias_ids i32[B, Kb]` (padded with -1) and `bias_values f32[B, Kb]`.

`SamplingTensors` also carries four static flags (`all_greedy`, `do_penalties`, `do_min_p`,
`do_top_k_top_p`) that let the compiled function skip work nobody in the batch asked for (the
full-vocabulary sort, the noise); each combination is one more compilation for a batch shape.

Seeds are taken modulo 2**32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GREEDY_EPS",
    "SampleOutput",
    "SamplingParamsLike",
    "SamplingTensors",
    "apply_penalties_and_bias",
    "build_sampling_tensors",
    "sample",
]

GREEDY_EPS = 1e-5
"""Temperatures below this are treated as 0 (greedy), as vLLM does."""

_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "logit_bias": None,
}


class SamplingParamsLike(Protocol):
    """What `build_sampling_tensors` reads; a missing attribute takes vLLM's default."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    logit_bias: Mapping[int, float] | None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "has_seed", "position", "bias_ids", "bias_values",
        "seen_ids", "seen_output_counts",
    ],
    meta_fields=["all_greedy", "do_penalties", "do_min_p", "do_top_k_top_p"],
)
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one padded batch (B rows, vocabulary V).

    Padding rows are greedy with no penalty and no bias. The static flags describe the real rows
    and are part of the jit cache key.
    """

    temperature: Any  # f32[B]; 0 = greedy
    top_k: Any  # i32[B]; 0 = off
    top_p: Any  # f32[B]; 1 = off
    min_p: Any  # f32[B]; 0 = off
    presence_penalty: Any  # f32[B]; output tokens only
    frequency_penalty: Any  # f32[B]; output tokens only
    repetition_penalty: Any  # f32[B]; 1 = off; prompt and output tokens
    seed: Any  # u32[B]; read only where has_seed
    has_seed: Any  # bool[B]
    position: Any  # i32[B]; absolute position of the token being sampled
    bias_ids: Any  # i32[B, Kb]; -1 = padding
    bias_values: Any  # f32[B, Kb]
    seen_ids: Any  # i32[B, H]; distinct token ids a penalty touches; -1 = padding
    seen_output_counts: Any  # i32[B, H]; occurrences of seen_ids[b, h] in the output
    all_greedy: bool = False
    do_penalties: bool = True
    do_min_p: bool = True
    do_top_k_top_p: bool = True

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "logprobs", "ranks", "top_ids", "top_logprobs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Result of `sample` for a batch of B rows."""

    tokens: Any  # i32[B]
    logprobs: Any  # f32[B]; raw log-probability of the sampled token
    ranks: Any  # i32[B]; 1-based rank of the sampled token in the raw distribution
    top_ids: Any = None  # i32[B, n] when num_logprobs != 0, else None
    top_logprobs: Any = None  # f32[B, n] when num_logprobs != 0, else None


# ----------------------------------------------------------------------------------------- host


def _bucket(n: int, minimum: int = 8) -> int:
    """0 stays 0; otherwise the next power of two, at least `minimum`."""
    if n <= 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())


def _get(params: Any, name: str) -> Any:
    value = getattr(params, name, None) if params is not None else None
    return _DEFAULTS[name] if value is None else value


def build_sampling_tensors(
    params_list: Sequence[SamplingParamsLike | None],
    positions: Sequence[int],
    prompt_token_ids: Sequence[Sequence[int] | None] | None = None,
    output_token_ids: Sequence[Sequence[int] | None] | None = None,
    *,
    vocab_size: int,
    batch_size: int | None = None,
) -> SamplingTensors:
    """Per-row sampling tensors (numpy) for `len(params_list)` requests, padded to `batch_size`.

    Args:
      params_list: one object per request with vLLM-named attributes (`temperature`, `top_k`,
        `top_p`, `min_p`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `seed`,
        `logit_bias: dict[int, float]`); None or a missing attribute means vLLM's default.
      positions: absolute position of the token each request samples now (its current length).
      prompt_token_ids, output_token_ids: token history per request (None = empty); read only for
        rows with a penalty. Ids outside [0, vocab_size) are ignored.
      vocab_size: V, the width of the logits.
      batch_size: rows after padding (a bucket size); defaults to the number of requests.

    Raises:
      ValueError: a parameter out of range or a logit_bias id outside the vocabulary.
    """
    n = len(params_list)
    if len(positions) != n:
        raise ValueError(f"{len(positions)} positions for {n} requests")
    for name, seqs in (("prompt_token_ids", prompt_token_ids),
                       ("output_token_ids", output_token_ids)):
        if seqs is not None and len(seqs) != n:
            raise ValueError(f"{len(seqs)} {name} for {n} requests")
    B = n if batch_size is None else int(batch_size)
    if B < n:
        raise ValueError(f"batch_size {B} < {n} requests")
    V = int(vocab_size)
    if V <= 0:
        raise ValueError(f"vocab_size must be positive, got {V}")

    temperature = np.zeros(B, np.float32)
    top_k = np.zeros(B, np.int32)
    top_p = np.ones(B, np.float32)
    min_p = np.zeros(B, np.float32)
    presence = np.zeros(B, np.float32)
    frequency = np.zeros(B, np.float32)
    repetition = np.ones(B, np.float32)
    seed = np.zeros(B, np.uint32)
    has_seed = np.zeros(B, np.bool_)
    position = np.zeros(B, np.int32)
    biases: list[tuple[np.ndarray, np.ndarray]] = []
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    for i, p in enumerate(params_list):
        t = float(_get(p, "temperature"))
        k = int(_get(p, "top_k"))
        tp = float(_get(p, "top_p"))
        mp = float(_get(p, "min_p"))
        pres = float(_get(p, "presence_penalty"))
        freq = float(_get(p, "frequency_penalty"))
        rep = float(_get(p, "repetition_penalty"))
        s = _get(p, "seed")
        bias = _get(p, "logit_bias")
        pos = int(positions[i])

        if not t >= 0.0:
            raise ValueError(f"request {i}: temperature must be >= 0, got {t}")
        if k < -1:
            raise ValueError(f"request {i}: top_k must be -1, 0 or positive, got {k}")
        if not 0.0 < tp <= 1.0:
            raise ValueError(f"request {i}: top_p must be in (0, 1], got {tp}")
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"request {i}: min_p must be in [0, 1], got {mp}")
        if not rep > 0.0:
            raise ValueError(f"request {i}: repetition_penalty must be > 0, got {rep}")
        if pos < 0:
            raise ValueError(f"request {i}: position must be >= 0, got {pos}")

        if t < GREEDY_EPS:  # greedy: truncation cannot change the argmax
            t, k, tp, mp = 0.0, 0, 1.0, 0.0
        if k < 0 or k >= V:
            k = 0
        temperature[i], top_k[i], top_p[i], min_p[i] = t, k, tp, mp
        presence[i], frequency[i], repetition[i] = pres, freq, rep
        position[i] = pos
        if s is not None:
            seed[i] = int(s) % (1 << 32)
            has_seed[i] = True

        if bias:
            ids = np.fromiter((int(key) for key in bias), np.int64, len(bias))
            if ids.size and (ids.min() < 0 or ids.max() >= V):
                raise ValueError(f"request {i}: logit_bias token id outside [0, {V})")
            vals = np.fromiter((float(v) for v in bias.values()), np.float32, len(bias))
            biases.append((ids, vals))
        else:
            biases.append((np.zeros(0, np.int64), np.zeros(0, np.float32)))

        if pres != 0.0 or freq != 0.0 or rep != 1.0:
            out = np.asarray(
                (output_token_ids[i] if output_token_ids is not None else None) or [], np.int64)
            out = out[(out >= 0) & (out < V)]
            out_ids, out_counts = np.unique(out, return_counts=True)
            if rep != 1.0:
                prompt = np.asarray(
                    (prompt_token_ids[i] if prompt_token_ids is not None else None) or [], np.int64)
                prompt = prompt[(prompt >= 0) & (prompt < V)]
                ids = np.union1d(prompt, out_ids)
            else:
                ids = out_ids
            counts = np.zeros(ids.shape, np.int64)
            counts[np.searchsorted(ids, out_ids)] = out_counts
            seen.append((ids, counts))
        else:
            seen.append((np.zeros(0, np.int64), np.zeros(0, np.int64)))

    real = slice(0, n)
    random_rows = temperature[real] > 0.0
    do_penalties = bool(np.any(presence[real] != 0) or np.any(frequency[real] != 0)
                        or np.any(repetition[real] != 1))

    kb = _bucket(max((b[0].size for b in biases), default=0))
    bias_ids = np.full((B, kb), -1, np.int32)
    bias_values = np.zeros((B, kb), np.float32)
    for i, (ids, vals) in enumerate(biases):
        bias_ids[i, : ids.size] = ids
        bias_values[i, : vals.size] = vals

    h = _bucket(max((s_[0].size for s_ in seen), default=0)) if do_penalties else 0
    seen_ids = np.full((B, h), -1, np.int32)
    seen_counts = np.zeros((B, h), np.int32)
    for i, (ids, counts) in enumerate(seen):
        seen_ids[i, : ids.size] = ids
        seen_counts[i, : counts.size] = counts

    return SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        seed=seed, has_seed=has_seed, position=position,
        bias_ids=bias_ids, bias_values=bias_values,
        seen_ids=seen_ids, seen_output_counts=seen_counts,
        all_greedy=not bool(np.any(random_rows)),
        do_penalties=do_penalties,
        do_min_p=bool(np.any(min_p[real][random_rows] > 0)),
        do_top_k_top_p=bool(np.any(top_k[real][random_rows] > 0)
                            or np.any(top_p[real][random_rows] < 1)),
    )


# --------------------------------------------------------------------------------------- device


def _process_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """float32 logits with logit_bias added and the penalties applied (vLLM order)."""
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    if t.bias_ids.shape[1]:
        ids = jnp.where(t.bias_ids >= 0, t.bias_ids, V)
        logits = logits.at[rows, ids].add(t.bias_values.astype(jnp.float32), mode="drop")
    if t.do_penalties and t.seen_ids.shape[1]:
        valid = t.seen_ids >= 0
        cur = jnp.take_along_axis(logits, jnp.where(valid, t.seen_ids, 0), axis=1)
        rep = t.repetition_penalty.astype(jnp.float32)[:, None]
        cur = jnp.where(cur > 0, cur / rep, cur * rep)
        counts = t.seen_output_counts.astype(jnp.float32)
        cur = (cur - t.frequency_penalty.astype(jnp.float32)[:, None] * counts
               - t.presence_penalty.astype(jnp.float32)[:, None] * (counts > 0))
        logits = logits.at[rows, jnp.where(valid, t.seen_ids, V)].set(
            cur, mode="drop", unique_indices=True)
    return logits


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
    p = top_p.astype(jnp.float32)[:, None]
    keep &= (p >= 1.0) | (mass_before < p) | (iota == 0)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    return jnp.zeros((B, V), jnp.bool_).at[rows, order].set(keep, unique_indices=True)


def _gumbel(t: SamplingTensors, rng_key: jax.Array, B: int, V: int) -> jax.Array:
    """f32[B, V] Gumbel noise; seeded rows from fold_in(key(seed), position)."""
    impl = jax.random.key_impl(rng_key)
    seeded = jax.vmap(lambda s, pos: jax.random.fold_in(jax.random.key(s, impl=impl), pos))(
        t.seed.astype(jnp.uint32), t.position.astype(jnp.int32))
    unseeded = jax.vmap(lambda r: jax.random.fold_in(rng_key, r))(jnp.arange(B, dtype=jnp.int32))
    sd, ud = jax.random.key_data(seeded), jax.random.key_data(unseeded)
    mask = t.has_seed.reshape((B,) + (1,) * (sd.ndim - 1))
    keys = jax.random.wrap_key_data(jnp.where(mask, sd, ud), impl=impl)
    return jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)


def _sample_impl(logits: jax.Array, t: SamplingTensors, rng_key: jax.Array,
                 num_logprobs: int) -> SampleOutput:
    with jax.named_scope("sample"):
        logits = logits.astype(jnp.float32)
        B, V = logits.shape
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
        processed = _process_logits(logits, t)
        greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
        if t.all_greedy:
            tokens = greedy_tokens
        else:
            temperature = t.temperature.astype(jnp.float32)
            is_greedy = temperature < GREEDY_EPS
            scaled = processed / jnp.where(is_greedy, 1.0, temperature)[:, None]
            if t.do_min_p:
                floor = (jnp.max(scaled, axis=-1, keepdims=True)
                         + jnp.log(t.min_p.astype(jnp.float32))[:, None])
                scaled = jnp.where(scaled >= floor, scaled, -jnp.inf)
            if t.do_top_k_top_p:
                scaled = jnp.where(_top_k_top_p_keep(scaled, t.top_k, t.top_p), scaled, -jnp.inf)
            sampled = jnp.argmax(scaled + _gumbel(t, rng_key, B, V), axis=-1).astype(jnp.int32)
            tokens = jnp.where(is_greedy, greedy_tokens, sampled)
        token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=1)[:, 0]
        ranks = jnp.sum(raw_logprobs >= token_logprobs[:, None], axis=-1, dtype=jnp.int32)
        top_ids = top_logprobs = None
        if num_logprobs != 0:
            n = V if num_logprobs < 0 else min(num_logprobs, V)
            top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, n)
            top_ids = top_ids.astype(jnp.int32)
        return SampleOutput(tokens=tokens, logprobs=token_logprobs, ranks=ranks,
                            top_ids=top_ids, top_logprobs=top_logprobs)


_sample_jit = jax.jit(_sample_impl, static_argnames=("num_logprobs",))

apply_penalties_and_bias = jax.jit(_process_logits)
"""`apply_penalties_and_bias(logits f32[B, V], tensors) -> f32[B, V]`: steps 1-2 only."""


def sample(logits: jax.Array, tensors: SamplingTensors, rng_key: jax.Array,
           num_logprobs: int = 0) -> SampleOutput:
    """Sample one token per row of `logits f32/bf16[B, V]` (jitted; `num_logprobs` is static).

    `rng_key` (a typed key or a raw uint32 threefry key) feeds unseeded random rows only, one
    `fold_in(rng_key, row)` each; pass a fresh key every step. `num_logprobs`: 0 = no top-n
    output, n > 0 = the n most likely raw tokens per row, -1 = the whole vocabulary.
    """
    if not isinstance(num_logprobs, int) or num_logprobs < -1:
        raise ValueError(f"num_logprobs must be an int >= -1, got {num_logprobs!r}")
    if not jnp.issubdtype(getattr(rng_key, "dtype", None), jax.dtypes.prng_key):
        rng_key = jax.random.wrap_key_data(jnp.asarray(rng_key, jnp.uint32))
    with jax.profiler.TraceAnnotation("sample"):
        return _sample_jit(logits, tensors, rng_key, num_logprobs=num_logprobs)
