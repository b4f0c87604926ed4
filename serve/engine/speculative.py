"""DSpark speculative decoding: verify each decoding request's drafts in one target step, keep
the accepted ones, and draft the next block, all in one device program
(engine-features.md §2; the drafter: `model.drafter`; the rollback: `model.rollback`).

A verify row holds the request's anchor (its last sampled token, not in the cache yet) at
position p and its ℓ drafts at p+1 .. p+ℓ (0 <= ℓ <= `num_speculative_tokens`; padding after).
The target runs over the whole row (`model.step.verify_body`); draft j is accepted while every
draft before it was, and it equals the target's greedy token at p+j-1 (`blocked_argmax`, the
sampler's own greedy, ties to the lowest id). With `a` accepted, the request gains the a drafts
and the target's token after them (the bonus token when a = ℓ, the correction otherwise): a+1
tokens from one step; the cache keeps the anchor and the accepted drafts (`roll_back` undoes
the rest). A row without drafts (ℓ = 0: a request that just finished its prefill, or one that
does not speculate) samples its one token with the sampler exactly as a decode step does.
The drafter then proposes the next block from the rolled-back cache, anchored at the new last
token, for the host to send with the next step.

What is built: fixed-k verification of greedy requests without logit processing
(`speculatable`), synchronous (the host reads a verify step before planning the next), on one
device. Not yet: verifying sampled requests (the lossless rule is `acceptance.accept`, not
wired in: the drafter draws greedily), requests with penalties, logit bias, min_tokens or
logprobs (they decode one token per step in the same program), confidence-scheduled
variable-length verification, overlap with asynchronous scheduling and the mesh step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import draft_from_cache
from deepinfer.model.kv_cache import CacheLayout, KVCache
from deepinfer.model.rollback import roll_back
from deepinfer.model.step import StepBatch, verify_body
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.sampler import SampleOutput, SampleRows, Sampler, blocked_argmax
from deepinfer.serve.engine.sampling_state import SamplingState
from deepinfer.serve.engine.types import SamplingParams

__all__ = ["SpeculativeConfig", "VerifyOutput", "speculatable", "verify_and_draft"]

METHODS = ("dspark",)
# vLLM's keys that this engine does not do yet: refused by name rather than ignored
NOT_BUILT = {
    "enable_adaptive_verification": "confidence-scheduled variable-length verification is not built yet "
                                    "(every request verifies num_speculative_tokens drafts)",
    "draft_sample_method": "drafts are greedy; sampled drafts (and verifying sampled requests) are not built yet",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` names: `method` ("dspark": the checkpoint's own drafter) and
    `num_speculative_tokens` (drafts verified per request and step; DeepInfer's baseline 5, at
    most the drafter's block)."""

    method: str = "dspark"
    num_speculative_tokens: int = 5

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")

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
            if key in NOT_BUILT:
                raise ValueError(f"{name}.{key}: {NOT_BUILT[key]}")
            if key not in ("method", "num_speculative_tokens"):
                raise ValueError(f"{name}.{key}: unknown key (known: method, num_speculative_tokens)")
        try:
            return cls(**value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def check(self, config: ModelConfig) -> None:
        if self.num_speculative_tokens > config.dspark_block_size:
            raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) exceeds the DSpark drafter's "
                             f"block of {config.dspark_block_size} tokens")


def speculatable(params: SamplingParams) -> bool:
    """Requests whose drafts this engine verifies: greedy, with nothing that changes the logits
    per position (penalties, logit bias, min_tokens bans) and no logprobs."""
    return (params.temperature == 0 and params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.repetition_penalty == 1 and not params.logit_bias and params.min_tokens == 0
            and params.logprobs is None)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyOutput:
    """Per row: `tokens [B, T]`: the target's greedy token after each row position (a row with
    drafts gains tokens[:accepted+1]); `sampled`: the sampler's output for the anchor (what a
    row without drafts gains, with its logprobs when asked); `accepted [B]`; `drafts [B, N]`:
    the next block."""

    tokens: jax.Array
    sampled: SampleOutput
    accepted: jax.Array
    drafts: jax.Array


def verify_and_draft(params: dict, cache: KVCache, state: SamplingState, batch: StepBatch, rows: SampleRows,
                     num_drafts: jax.Array, *, config: ModelConfig, layout: CacheLayout,
                     kernels: KernelConfig | None = None,
                     head: Sampler = Sampler()) -> tuple[KVCache, SamplingState, VerifyOutput, jax.Array]:
    """One verify step (module docstring). `batch` rows: anchor + drafts (`last_index`: the last
    draft, whose pending pair state a fully accepted row keeps); `rows`: the sampler's rows for
    the anchor; `num_drafts [B]`: ℓ per row. Returns
    the rolled-back cache, the sampling state (every gained token counted, `last_token` the
    newest), the `VerifyOutput` and the routed-token counts (of every verified token)."""
    cache, logits, counts, undo = verify_body(params, cache, batch, config=config, layout=layout, kernels=kernels)
    logits = jax.lax.optimization_barrier(logits)
    B, T, V = logits.shape
    state, first = head(logits[:, 0], state, batch.slots, rows)
    targets = blocked_argmax(logits.reshape(B * T, V)).reshape(B, T).astype(jnp.int32)
    live = jnp.arange(T - 1)[None, :] < num_drafts[:, None]
    match = (batch.tokens[:, 1:] == targets[:, :-1]) & live
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    cache = roll_back(cache, undo, batch.slots, batch.positions, accepted + 1)

    # the state counts every token a drafting row gained (the sampler counted the first)
    rows_idx = jnp.arange(B)
    newest = jnp.where(num_drafts > 0, targets[rows_idx, accepted], first.tokens)
    S = state.num_output.shape[0]
    drafting = rows.emit & (num_drafts > 0)
    extra = drafting[:, None] & (jnp.arange(T)[None, :] >= 1) & (jnp.arange(T)[None, :] <= accepted[:, None])
    at = jnp.where(extra, batch.slots[:, None], S)
    kept = jnp.where(rows.emit, batch.slots, S)
    state = dataclasses.replace(
        state, num_output=state.num_output.at[kept].add(jnp.where(drafting, accepted, 0), mode="drop"),
        last_token=state.last_token.at[kept].set(newest, mode="drop"),
        output_counts=state.output_counts.at[at, targets].add(1, mode="drop"))

    anchor_pos = batch.positions[:, 0] + accepted + 1
    drafts = draft_from_cache(params, config, layout, cache, batch.slots, newest, anchor_pos, batch.floor,
                              kernels)["tokens"]
    return cache, state, VerifyOutput(targets, first, accepted, drafts), counts
