"""DSpark speculative decoding: draft, verify and accept on the device
(engine-features.md §2; the drafter: `model.drafter`; the acceptance rule: `acceptance.py`; the
rollback: `model.rollback`).

A verify row holds the request's anchor (its last sampled token, not in the cache yet) at
position p and room for ℓ drafts at p+1 .. p+ℓ (0 <= ℓ <= `num_speculative_tokens`, chosen by
the host; padding after). A verify step runs three programs, one after the other on the device
(the host waits for none of them):

1. drafts (`propose_drafts`): the drafter reads the row's context from its rings (positions < p)
   and proposes the block after the anchor, left to right through the Markov head: the argmax
   for greedy requests, a draw from q = the request's temperature and truncation applied to the drafter's
   logits for sampled ones (noise keyed by seed and position, `acceptance.DRAFT_STREAM`). Drafts
   the host proposed instead (`DraftInputs.host_drafts`: tests' oracle drafts) are certain
   (one-hot q). The drafts' Engram rows are hashed on the device (`hash_drafts`), so the host
   need not see a draft before it is accepted;
2. verifies: the target runs over [anchor, drafts] (`verify_target`: `model.step.verify_body`)
   and each position's target distribution p is the request's own, as a plain decode step
   would sample from it after accepting the drafts before it (logit bias, min_tokens bans and
   penalties counting those drafts as outputs, temperature, min-p, top-k, top-p:
   `sampler.process_logits(earlier=)` / `truncate`, computed in `accept_drafts`);
3. accepts losslessly (`accept_drafts`; `acceptance.accept`: min(1, p/q), a residual draw at the
   first rejection, the bonus token after the last draft; greedy rows keep the drafts equal to
   the target's argmax); the request gains the a accepted drafts and one more token (each with
   its raw log-probabilities when the step's `Sampler` asks: `VerifyOutput.gained`), and the
   cache keeps the anchor and the accepted drafts (`roll_back` undoes the rest).

A row with ℓ = 0 (no drafts this step: near its end, or a width of 0) samples its one token
with the plain sampler, exactly as a decode step does (same noise, logprobs when asked).

Three programs rather than one so that the two models (drafter, target) are each compiled once
per step shape, whatever the sampler is asked for: masks and log-probabilities select one of the
small `accept_drafts` programs.

Structured output: a constrained row's mask at each verify position depends on the drafts before
it, which the host's grammar must read. In a step with such a row the host reads the drafts after
`propose_drafts` and builds one mask per position without advancing the grammar
(`serve.structured`) while the target runs; `accept_drafts` applies them to the target's
logits: a draft the grammar forbids has p = 0 and is rejected like any other, and the correction
or bonus token is drawn under its own position's mask. Acceptance stays lossless: the
drafts are still drawn from the (unmasked) drafter's q.

What is built: fixed-k and confidence-scheduled verification (the host chooses the step's
width, or a plain decode step, from earlier steps' confidences: `verify_schedule.py`) of every
request (greedy or sampled, with penalties, min_tokens bans and logprobs, constrained or not),
synchronous; in deterministic mode by sample matching (`accept_drafts(by_sample=
True)`); on a device mesh each dp rank runs the three programs on its own rows
(`mesh_speculative.py`). Not yet: overlap with asynchronous scheduling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import draft_block
from deepinfer.model.engram_hash_device import hash_drafts
from deepinfer.model.kv_cache import CacheLayout, KVCache
from deepinfer.model.rollback import Undo, roll_back
from deepinfer.model.step import StepBatch, verify_body
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.acceptance import DRAFT_STREAM, accept, stream_keys
from deepinfer.serve.engine.sampler import (SampleOutput, SampleRows, Sampler, apply_bitmask, blocked_argmax, choose,
                                            draw, process_logits, row_keys, slot_settings, truncate,
                                            with_logprobs)
from deepinfer.serve.engine.sampling_state import SamplingState

__all__ = ["DraftInputs", "DraftProposal", "SpecDecodeCounts", "SpeculativeConfig", "VerifiedLogits", "VerifyOutput",
           "accept_drafts", "propose_drafts", "verify_target"]

METHODS = ("dspark",)
KEYS = ("method", "num_speculative_tokens", "enable_adaptive_verification", "confidence_temperatures",
        "verify_step_seconds")


def _positive_numbers(values) -> bool:
    """`values` is a list (or tuple) of positive finite numbers."""
    return (not isinstance(values, (str, bytes)) and hasattr(values, "__len__")
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf") for v in values))


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` names: `method` ("dspark": the checkpoint's own drafter),
    `num_speculative_tokens` (drafts verified per request and step; DeepInfer's baseline 5, at
    most the drafter's block) and `enable_adaptive_verification` (DSpark's confidence-scheduled
    verification: each step verifies the number of drafts, at most `num_speculative_tokens`,
    that maximises the expected tokens per second, or decodes plainly where none pays,
    `verify_schedule.py`). `confidence_temperatures`: the drafter's Sequential Temperature
    Scaling (engine-features.md §2.2), one temperature per draft position, at least
    `num_speculative_tokens` of them, that calibrate the confidences the scheduler reads; None:
    the checkpoint's own (`verify_schedule.CALIBRATION_FILE`, written with the embedded trained
    model) where `LLM` finds them, else the raw confidences. `verify_step_seconds`: the step-cost
    curve the scheduler weighs tokens against (seconds of a plain decode step, then of a verify
    step per width 1 .. `num_speculative_tokens` drafts per row), as an earlier engine of this
    configuration on this machine measured and logged it; None: profiled when the engine starts.
    On a multi-process mesh process 0's (given or measured) is every process's. Only adaptive
    verification reads these two."""

    method: str = "dspark"
    num_speculative_tokens: int = 5
    enable_adaptive_verification: bool = False
    confidence_temperatures: tuple[float, ...] | None = None
    verify_step_seconds: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if not isinstance(self.enable_adaptive_verification, bool):
            raise ValueError(f"enable_adaptive_verification must be true or false, "
                             f"got {self.enable_adaptive_verification!r}")
        if self.confidence_temperatures is not None:
            temperatures = self.confidence_temperatures
            if not _positive_numbers(temperatures):
                raise ValueError(f"confidence_temperatures must be a list of positive numbers (one per draft "
                                 f"position), got {temperatures!r}")
            if len(temperatures) < self.num_speculative_tokens:
                raise ValueError(f"confidence_temperatures: one per draft position verified, at least "
                                 f"num_speculative_tokens ({self.num_speculative_tokens}), got {len(temperatures)}")
            object.__setattr__(self, "confidence_temperatures", tuple(float(t) for t in temperatures))
        if self.verify_step_seconds is not None:
            seconds, k = self.verify_step_seconds, self.num_speculative_tokens
            if not _positive_numbers(seconds) or len(seconds) != k + 1:
                raise ValueError(f"verify_step_seconds: a plain decode step's cost, then one per width 1 .. {k} "
                                 f"({k + 1} positive numbers), got {seconds!r}")
            object.__setattr__(self, "verify_step_seconds", tuple(float(t) for t in seconds))

    @classmethod
    def from_value(cls, value, name: str = "speculative_config") -> SpeculativeConfig | None:
        """None, a `SpeculativeConfig` or vLLM's dict form (`{"method": "dspark",
        "num_speculative_tokens": 5}`); a bad key or value is a `ValueError` naming it."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{name}: must be a dict such as {{'method': 'dspark', 'num_speculative_tokens': 5}}, "
                             f"got {value!r}")
        for key in value:
            if key not in KEYS:
                raise ValueError(f"{name}.{key}: unknown key (known: {', '.join(KEYS)})")
        try:
            return cls(**value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def check(self, config: ModelConfig) -> None:
        if self.num_speculative_tokens > config.dspark_block_size:
            raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) exceeds the DSpark drafter's "
                             f"block of {config.dspark_block_size} tokens")
        if self.confidence_temperatures is not None and len(self.confidence_temperatures) > config.dspark_block_size:
            raise ValueError(f"confidence_temperatures: {len(self.confidence_temperatures)} given, one per position "
                             f"of the DSpark drafter's block of {config.dspark_block_size} at most")


@dataclass
class SpecDecodeCounts:
    """The engine's speculative-decoding counters, as vLLM names them (`metrics()`): verify rows
    that checked drafts, draft tokens checked, drafts accepted, and accepted drafts by position
    in the block (position j counts the rows that accepted more than j drafts)."""

    block: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.block

    def record(self, drafts: int, accepted: int) -> None:
        """One row of a verify step that checked `drafts` drafts and accepted `accepted`."""
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_pos[j] += 1

    def since(self, before: SpecDecodeCounts | None) -> SpecDecodeCounts:
        """The counts of the verify rows recorded after `before` (a `snapshot()`; None: all)."""
        if before is None:
            return self.snapshot()
        return SpecDecodeCounts(self.block, self.num_drafts - before.num_drafts,
                                self.num_draft_tokens - before.num_draft_tokens,
                                self.num_accepted_tokens - before.num_accepted_tokens,
                                [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)])

    def snapshot(self) -> SpecDecodeCounts:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row gains on average: its accepted drafts and the token after them
        (vLLM's mean acceptance length); 0 before any row."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def metrics(self) -> dict:
        return {"vllm:spec_decode_num_drafts": self.num_drafts,
                "vllm:spec_decode_num_draft_tokens": self.num_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "vllm:spec_decode_num_accepted_tokens_per_pos": {str(j): c for j, c in
                                                                 enumerate(self.accepted_per_pos)}}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftInputs:
    """What the host tells a verify step about each row's drafts."""

    num_drafts: jax.Array  # i32[B]: ℓ, the drafts the row verifies
    host_drafts: jax.Array  # i32[B, K]: drafts proposed on the host (read where `use_host`)
    use_host: jax.Array  # bool[B]: verify `host_drafts` instead of the drafter's
    # u32[B, K, n_engram_layers, N-1, 2]: the host's part of the drafts' Engram folds
    # (`EngramHasher.draft_folds` of the sequence up to the anchor); None without Engram
    folds: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyOutput:
    """Per row: `tokens [B, K+1]`: the tokens the row gained (a drafting row `count` of them:
    its accepted drafts, then the correction or bonus token; a row without drafts one, its
    plain sample); `sampled`: the plain sampler's output for the anchor (with its logprobs when
    asked: what a row without drafts gained); `count [B]`; `accepted [B]`: drafts accepted;
    `drafts [B, K]`: the drafts verified; `confidence [B, N]`: the drafter's confidences of its
    whole block (N = `dspark_block_size`, whatever the step verified: what the host schedules
    the next steps from); `gained`: with log-probabilities asked (the step's `Sampler`), those of
    each of `tokens` (`SampleOutput` fields `[B, K+1]` and `[B, K+1, n]`; entry j is decided by
    the target's logits at the anchor's position + j), else None."""

    tokens: jax.Array
    sampled: SampleOutput
    count: jax.Array
    accepted: jax.Array
    drafts: jax.Array
    confidence: jax.Array
    gained: SampleOutput | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftProposal:
    """The drafter's block for each row of a verify step: `drafts [B, K]` (the host's where it
    proposed them), `q [B, K, V]`: the log-probabilities each draft was drawn from (one-hot for
    host drafts; zeros when no drafting row samples: greedy acceptance never reads them) and
    `confidence [B, N]`: the drafter's confidences of its whole block."""

    drafts: jax.Array
    q: jax.Array
    confidence: jax.Array


def propose_drafts(params: dict, cache: KVCache, state: SamplingState, batch: StepBatch, rows: SampleRows,
                   drafts_in: DraftInputs, *, config: ModelConfig, layout: CacheLayout,
                   kernels: KernelConfig | None = None, coupled: bool = False, ep=None) -> DraftProposal:
    """Step 1 of the module docstring: each row's drafts after its anchor (the cache is only
    read). Returns the `DraftProposal` (read by the host where structured output masks the
    verify positions from the drafts: `accept_drafts`).

    `coupled` (with `accept_drafts(by_sample=True)`): a sampled draft is drawn with the plain
    sampler's own noise for its position, so that it is the target's sample whenever the two
    distributions put the same token first under that noise (a draft is accepted iff it equals
    the target's sample; independent noise would match only by chance)."""
    K = batch.tokens.shape[1] - 1
    settings = slot_settings(state, batch.slots)
    random = settings["temperature"] > 0
    temperature = jnp.where(random, settings["temperature"], 1.0)
    drafting = rows.emit & (drafts_in.num_drafts > 0)
    anchor, anchor_pos = batch.tokens[:, 0], batch.positions[:, 0]

    def pick(logits, j):
        """Draft j: the argmax, or for a sampled row a draw from its truncated distribution."""
        greedy = blocked_argmax(logits).astype(jnp.int32)
        live = drafting & random

        def sampled(x):
            scaled = truncate(x / temperature[:, None], settings, live)
            position = anchor_pos + 1 + j
            keys = (row_keys(settings["seed"], position) if coupled
                    else stream_keys(settings["seed"], position[:, None], DRAFT_STREAM)[:, 0])
            return draw(scaled, keys).astype(jnp.int32), scaled

        drawn, scaled = jax.lax.cond(jnp.any(live), sampled, lambda x: (greedy, x), logits)
        return jnp.where(random, drawn, greedy), scaled

    block = draft_block(params, config, layout, cache, batch.slots, anchor, anchor_pos, batch.floor, kernels, pick, ep)
    use_host = drafts_in.use_host[:, None]
    drafts = jnp.where(use_host, drafts_in.host_drafts, block["tokens"][:, :K])

    def draft_logp(picked):
        certain = jnp.where(jax.nn.one_hot(drafts, config.vocab_size, dtype=jnp.bool_), 0.0, -jnp.inf)
        return jnp.where(use_host[..., None], certain, jax.nn.log_softmax(picked, axis=-1))

    # else acceptance never reads q (greedy rows match argmaxes)
    q = jax.lax.cond(jnp.any(drafting & random), draft_logp, jnp.zeros_like, block["picked"][:, :K])
    return DraftProposal(drafts, q, block["confidence"])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifiedLogits:
    """The target's side of a verify step (`verify_target`): fp32 `logits [B, K+1, V]` at the
    anchor and every draft, and the `Undo` that rolls the cache back to the accepted tokens."""

    logits: jax.Array
    undo: Undo


def verify_target(params: dict, cache: KVCache, batch: StepBatch, drafts_in: DraftInputs, proposal: DraftProposal,
                  *, config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None = None,
                  ep=None) -> tuple[KVCache, VerifiedLogits, jax.Array]:
    """Step 2 of the module docstring, the model part: the target over [anchor, drafts] of each
    row (its drafts' Engram rows hashed on the device). Returns the cache with every verified
    token written, the `VerifiedLogits` and the routed-token counts (of every verified token)."""
    K = batch.tokens.shape[1] - 1
    drafts = proposal.drafts
    verified = jnp.arange(K)[None, :] < drafts_in.num_drafts[:, None]
    hash_ids = batch.hash_ids
    if hash_ids is not None and drafts_in.folds is not None:
        hash_ids = hash_ids.at[:, 1:].set(hash_drafts(config, drafts, drafts_in.folds))
    batch = dataclasses.replace(batch, tokens=batch.tokens.at[:, 1:].set(jnp.where(verified, drafts, 0)),
                                hash_ids=hash_ids)
    cache, logits, counts, undo = verify_body(params, cache, batch, config=config, layout=layout, kernels=kernels,
                                              ep=ep)
    return cache, VerifiedLogits(logits, undo), counts


def accept_drafts(cache: KVCache, state: SamplingState, batch: StepBatch, rows: SampleRows, drafts_in: DraftInputs,
                  proposal: DraftProposal, verified: VerifiedLogits, masks: jax.Array | None = None, *,
                  head: Sampler = Sampler(), by_sample: bool = False) -> tuple[KVCache, SamplingState, VerifyOutput]:
    """Step 2's distributions and step 3 of the module docstring over `verify_target`'s logits.
    `masks i32[B, K+1, ceil(V / 32)]` (None: no row constrained): each verify position's
    structured-output bitmask (position j: the grammar after the anchor and drafts 1..j), applied
    to the target's logits before anything else, so a draft the grammar forbids has p = 0 and is
    rejected, and the correction or bonus token is drawn under its position's mask. Returns the
    rolled-back cache, the sampling state (every gained token counted, `last_token` the newest)
    and the `VerifyOutput`.

    `by_sample` (deterministic mode): instead of the min(1, p/q) rule, each verify position's
    token is the one the plain sampler draws there (`sampler.choose`: the same processed
    logits, truncation and (seed, position) noise) and a draft is accepted iff it is that
    token. Still lossless (the row gains exactly the target's own samples) and, with the
    batch-invariant verify step, the same bits as decoding without speculation. A sampled draft
    drawn with independent noise would be accepted with probability sum_x q(x) p(x), below the
    ratio rule's sum_x min(p(x), q(x)); drawn with the sampler's own noise
    (`propose_drafts(coupled=True)`), it is accepted whenever q and p pick the same token under
    that noise."""
    B, T = batch.tokens.shape
    slots, num, drafts = batch.slots, drafts_in.num_drafts, proposal.drafts
    settings = slot_settings(state, slots)
    random = settings["temperature"] > 0
    temperature = jnp.where(random, settings["temperature"], 1.0)
    drafting = rows.emit & (num > 0)
    anchor_pos = batch.positions[:, 0]
    any_sampled = jnp.any(drafting & random)

    logits = verified.logits
    V = logits.shape[-1]
    if masks is not None:  # (the plain sampler below then reads masked logits too)
        logits = apply_bitmask(logits.reshape(B * T, V), masks.reshape(B * T, -1)).reshape(B, T, V)

    # rows without drafts: the plain sampler on the anchor's logits, exactly a decode step
    state, first = head(logits[:, 0], state, slots, dataclasses.replace(rows, emit=rows.emit & ~drafting))

    # each verified position's target distribution, as the plain sampler would draw from it after
    # accepting the drafts before it (they count as outputs for penalties and min_tokens bans)
    flat_slots, flat_live = jnp.repeat(slots, T), jnp.repeat(drafting, T)
    before = jnp.arange(T - 1)[None, None, :] < jnp.arange(T)[None, :, None]  # [1, T, K]: draft i precedes j
    earlier = jnp.where(before, drafts[:, None, :], -1).reshape(B * T, T - 1)
    processed = process_logits(logits.reshape(B * T, V), state, flat_slots, flat_live, earlier)
    flat = slot_settings(state, flat_slots)

    def scaled_logp(x):  # greedy rows' argmax is unchanged (temperature 1, truncation keeps it)
        scaled = x / jnp.repeat(temperature, T)[:, None]
        return jax.nn.log_softmax(truncate(scaled, flat, flat_live & jnp.repeat(random, T)), axis=-1)

    decides = anchor_pos[:, None] + 1 + jnp.arange(T)[None, :]  # the position each entry decides
    if by_sample:
        accepted, next_token = _accept_matching(choose(processed, flat, flat_live, decides.reshape(-1)).reshape(B, T),
                                                drafts, jnp.where(drafting, num, 0))
    else:
        target = jax.lax.cond(any_sampled, scaled_logp, lambda x: x, processed).reshape(B, T, V)
        # rows without drafts count as greedy here: their token is the plain sampler's
        accepted, next_token = accept(target, proposal.q, drafts, jnp.where(drafting, num, 0),
                                      ~(random & drafting), settings["seed"], decides)

    idx = jnp.arange(T)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    gained = jnp.where(idx < accepted[:, None], padded, next_token[:, None])
    gained = jnp.where(drafting[:, None], gained, first.tokens[:, None]).astype(jnp.int32)
    count = jnp.where(drafting, accepted + 1, 1).astype(jnp.int32)
    cache = roll_back(cache, verified.undo, slots, batch.positions, count)

    # the state counts every token a drafting row gained (the plain sampler counted the others)
    S = state.num_output.shape[0]
    kept = jnp.where(drafting, slots, S)
    at = jnp.where(drafting[:, None] & (idx < count[:, None]), slots[:, None], S)
    state = dataclasses.replace(
        state, num_output=state.num_output.at[kept].add(count, mode="drop"),
        last_token=state.last_token.at[kept].set(next_token, mode="drop"),
        output_counts=state.output_counts.at[at, gained].add(1, mode="drop"))
    per_position = None
    if head.num_logprobs is not None:  # raw log-probabilities, as the plain sampler's
        per_position = with_logprobs(logits.reshape(B * T, V), gained.reshape(-1), head.num_logprobs)
        per_position = jax.tree.map(lambda a: a.reshape(B, T, *a.shape[1:]), per_position)
    out = VerifyOutput(gained, first, count, jnp.where(drafting, accepted, 0).astype(jnp.int32), drafts,
                       proposal.confidence, per_position)
    return cache, state, out


def _accept_matching(chosen: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(accepted [B], next_token [B])` when each verify position's token is `chosen [B, K+1]`
    (the target's own sample there): the drafts are accepted up to the first that differs from
    it, and the next token is the target's at that position (after the last draft: the bonus)."""
    K = drafts.shape[1]
    live = jnp.arange(K)[None, :] < num_drafts[:, None]
    same = (drafts == chosen[:, :K]) & live
    accepted = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(chosen, accepted[:, None], axis=1)[:, 0]
