"""Per-slot sampling state on the device: what the request in each cache slot asked for.

It is written once, when a request is admitted to a slot (`slot_row` + `write_slot`), cleared
when the request leaves (`clear_slots`), and read and advanced by every engine step
(`sampler.Sampler`), so a step sends no sampling settings or token histories from the host.

Per slot (S slots, vocabulary V):

* the vLLM parameters: temperature (0 = greedy), top-k (0 = off), top-p, min-p, the presence,
  frequency and repetition penalties, and the seed of its counter-based noise (a request
  without a seed gets one drawn by the engine);
* `logit_bias` as a fixed-size sparse list (`bias_ids`, -1 = padding; `bias_values`);
* min_tokens bans: `ban_ids` (EOS unless ignore_eos, and the stop token ids) get a large negative
  bias while `num_output < min_tokens`; `num_output` counts the request's generated tokens and
  is advanced by the step;
* `last_token`: the token the slot's last step sampled, which a decode step reads as its input
  when the host has not read it yet (asynchronous scheduling);
* the penalty history, dense: `output_counts` (occurrences of each token in the output, advanced
  by the step with the sampled token) and `prompt_seen` (the prompt's tokens, which count for
  the repetition penalty only, as in vLLM). They are uploaded at admission only for a request
  with a penalty; for the others they are zeroed on the device and never read.

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
    "SamplingParamsLike",
    "SamplingState",
    "SlotRow",
    "check_capacity",
    "clear_slots",
    "init_state",
    "jitted_writers",
    "slot_row",
    "write_slot",
]

GREEDY_EPS = 1e-5
"""Temperatures below this are treated as 0 (greedy), as vLLM does."""

_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None, "min_tokens": 0,
    "stop_token_ids": None, "ignore_eos": False,
}


class SamplingParamsLike(Protocol):
    """What `slot_row` reads (vLLM names); a missing attribute takes vLLM's default."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float] | None
    min_tokens: int
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool


_SCALARS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "min_tokens", "num_output", "last_token")
_LISTS = ("bias_ids", "bias_values", "ban_ids")
_DENSE = ("output_counts", "prompt_seen")


@functools.partial(jax.tree_util.register_dataclass, data_fields=[*_SCALARS, *_LISTS, *_DENSE], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """The device arrays, leading dim = slot (split over dp ranks under a mesh)."""

    temperature: Any  # f32[S]; 0 = greedy
    top_k: Any  # i32[S]; 0 = off
    top_p: Any  # f32[S]; 1 = off
    min_p: Any  # f32[S]; 0 = off
    presence_penalty: Any  # f32[S]
    frequency_penalty: Any  # f32[S]
    repetition_penalty: Any  # f32[S]; 1 = off
    seed: Any  # u32[S]
    min_tokens: Any  # i32[S]
    num_output: Any  # i32[S]; tokens generated so far
    # i32[S]: the token the slot's last step sampled, the input of its next decode step when the
    # host has not read it yet (asynchronous scheduling: `placeholders.py`)
    last_token: Any
    bias_ids: Any  # i32[S, Kb]; -1 = padding
    bias_values: Any  # f32[S, Kb]
    ban_ids: Any  # i32[S, Kn]; -1 = padding; banned while num_output < min_tokens
    output_counts: Any  # i32[S, V]
    prompt_seen: Any  # bool[S, V]

    @property
    def vocab_size(self) -> int:
        return int(self.output_counts.shape[1])


@functools.partial(jax.tree_util.register_dataclass, data_fields=[*_SCALARS, *_LISTS, *_DENSE], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SlotRow:
    """One slot's values (numpy), as `SamplingState` holds them; the dense penalty history is
    None for a request without a penalty (zeroed on the device instead of uploaded)."""

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    seed: Any
    min_tokens: Any
    num_output: Any
    last_token: Any
    bias_ids: Any
    bias_values: Any
    ban_ids: Any
    output_counts: Any = None
    prompt_seen: Any = None


_DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "min_p": np.float32,
           "presence_penalty": np.float32, "frequency_penalty": np.float32, "repetition_penalty": np.float32,
           "seed": np.uint32, "min_tokens": np.int32, "num_output": np.int32, "last_token": np.int32,
           "bias_ids": np.int32, "bias_values": np.float32, "ban_ids": np.int32, "output_counts": np.int32,
           "prompt_seen": np.bool_}
# what a free slot holds: greedy, nothing biased, banned or counted
_NEUTRAL = {"temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0,
            "repetition_penalty": 1, "seed": 0, "min_tokens": 0, "num_output": 0, "last_token": 0, "bias_ids": -1,
            "bias_values": 0, "ban_ids": -1, "output_counts": 0, "prompt_seen": False}


def init_state(num_slots: int, vocab_size: int, max_logit_bias: int, max_bans: int) -> SamplingState:
    """Every slot neutral (jit it with output shardings to build it in place on a mesh)."""
    shapes = {name: (num_slots,) for name in _SCALARS}
    shapes.update(bias_ids=(num_slots, max_logit_bias), bias_values=(num_slots, max_logit_bias),
                  ban_ids=(num_slots, max_bans), output_counts=(num_slots, vocab_size),
                  prompt_seen=(num_slots, vocab_size))
    return SamplingState(**{name: jnp.full(shape, _NEUTRAL[name], _DTYPES[name]) for name, shape in shapes.items()})


def _get(params: Any, name: str) -> Any:
    value = getattr(params, name, None) if params is not None else None
    return _DEFAULTS[name] if value is None else value


def _bans(params: Any, eos_token_id: int | None) -> list[int]:
    """The tokens banned until min_tokens: the stop token ids, and EOS unless ignore_eos."""
    if int(_get(params, "min_tokens")) <= 0:
        return []
    banned = [int(t) for t in _get(params, "stop_token_ids") or ()]
    if not _get(params, "ignore_eos") and eos_token_id is not None:
        banned.append(int(eos_token_id))
    return sorted(set(banned))


def check_capacity(params: Any, *, eos_token_id: int | None, max_logit_bias: int, max_bans: int) -> None:
    """A request's lists must fit the state's fixed-size lists: ValueError naming the field."""
    bias = _get(params, "logit_bias") or {}
    if len(bias) > max_logit_bias:
        raise ValueError(f"logit_bias: {len(bias)} entries, this engine supports at most {max_logit_bias} "
                         "(EngineConfig.max_logit_bias)")
    bans = _bans(params, eos_token_id)
    if len(bans) > max_bans:
        raise ValueError(f"stop_token_ids: with min_tokens, at most {max_bans} tokens (stop ids and EOS) can be "
                         f"held back, got {len(bans)} (EngineConfig.max_stop_token_ids)")


def slot_row(params: SamplingParamsLike | None, *, seed: int, vocab_size: int, max_logit_bias: int, max_bans: int,
             eos_token_id: int | None = None, prompt_token_ids: Sequence[int] = (),
             output_token_ids: Sequence[int] = ()) -> SlotRow:
    """The slot values of a request with `params` (None or a missing attribute: vLLM's default)
    and per-request `seed`, whose tokens so far are `prompt_token_ids` + `output_token_ids`
    (the output ones count as generated: min_tokens, presence/frequency penalties).

    Raises ValueError (naming the field): a value out of range, a token id outside the
    vocabulary, more bias entries or bans than the lists hold."""
    V = int(vocab_size)
    t = float(_get(params, "temperature"))
    k = int(_get(params, "top_k"))
    tp = float(_get(params, "top_p"))
    mp = float(_get(params, "min_p"))
    pres = float(_get(params, "presence_penalty"))
    freq = float(_get(params, "frequency_penalty"))
    rep = float(_get(params, "repetition_penalty"))
    if not t >= 0.0:
        raise ValueError(f"temperature: must be >= 0, got {t}")
    if k < -1:
        raise ValueError(f"top_k: must be -1, 0 or positive, got {k}")
    if not 0.0 < tp <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {tp}")
    if not 0.0 <= mp <= 1.0:
        raise ValueError(f"min_p: must be in [0, 1], got {mp}")
    if not rep > 0.0:
        raise ValueError(f"repetition_penalty: must be > 0, got {rep}")
    if t < GREEDY_EPS:  # greedy: truncation cannot change the argmax
        t, k, tp, mp = 0.0, 0, 1.0, 0.0
    if k < 0 or k >= V:
        k = 0
    check_capacity(params, eos_token_id=eos_token_id, max_logit_bias=max_logit_bias, max_bans=max_bans)

    bias = _get(params, "logit_bias") or {}
    bias_ids = np.full(max_logit_bias, -1, np.int32)
    bias_values = np.zeros(max_logit_bias, np.float32)
    for i, (tid, value) in enumerate(bias.items()):
        if not 0 <= int(tid) < V:
            raise ValueError(f"logit_bias: token id {tid} is outside the vocabulary [0, {V})")
        bias_ids[i], bias_values[i] = int(tid), float(value)
    bans = _bans(params, eos_token_id)
    ban_ids = np.full(max_bans, -1, np.int32)
    for i, tid in enumerate(bans):
        if not 0 <= tid < V:
            raise ValueError(f"stop_token_ids: token id {tid} is outside the vocabulary [0, {V})")
        ban_ids[i] = tid

    counts = seen = None
    if pres != 0.0 or freq != 0.0 or rep != 1.0:
        out = np.asarray(output_token_ids, np.int64).reshape(-1)
        counts = np.bincount(out[(out >= 0) & (out < V)], minlength=V).astype(np.int32)
        seen = np.zeros(V, np.bool_)
        prompt = np.asarray(prompt_token_ids, np.int64).reshape(-1)
        seen[prompt[(prompt >= 0) & (prompt < V)]] = True
    values = dict(temperature=t, top_k=k, top_p=tp, min_p=mp, presence_penalty=pres, frequency_penalty=freq,
                  repetition_penalty=rep, seed=int(seed) % (1 << 32), min_tokens=int(_get(params, "min_tokens")),
                  num_output=len(output_token_ids),
                  last_token=int(output_token_ids[-1]) if len(output_token_ids) else 0)
    return SlotRow(**{name: np.asarray(v, _DTYPES[name]) for name, v in values.items()},
                   bias_ids=bias_ids, bias_values=bias_values, ban_ids=ban_ids, output_counts=counts,
                   prompt_seen=seen)


def _write_slot(state: SamplingState, slot: jax.Array, row: SlotRow) -> SamplingState:
    new = {}
    for field in dataclasses.fields(SamplingState):
        array, value = getattr(state, field.name), getattr(row, field.name)
        if value is None:  # no penalty: the history is never read, zero it
            value = jnp.zeros(array.shape[1:], array.dtype)
        new[field.name] = array.at[slot].set(jnp.asarray(value, array.dtype), mode="drop")
    return SamplingState(**new)


def _clear_slots(state: SamplingState, slots: jax.Array) -> SamplingState:
    new = {}
    for field in dataclasses.fields(SamplingState):
        array = getattr(state, field.name)
        new[field.name] = array.at[slots].set(jnp.asarray(_NEUTRAL[field.name], array.dtype), mode="drop")
    return SamplingState(**new)


def jitted_writers(shardings: SamplingState | None = None):
    """`(write_slot, clear_slots)`, jitted with the state donated; `shardings` (a `SamplingState`
    of shardings, under a mesh) keeps their results placed like the state.

    * `write_slot(state, slot, row)`: slot `slot` (a global slot id) holds `row` (two
      compilations: with and without the dense penalty history);
    * `clear_slots(state, slots)`: `slots` neutral (ids past the end are padding: pad them to one
      shape)."""
    kwargs = {} if shardings is None else {"out_shardings": shardings}
    return (jax.jit(_write_slot, donate_argnums=(0,), **kwargs), jax.jit(_clear_slots, donate_argnums=(0,), **kwargs))


write_slot, clear_slots = jitted_writers()
