"""One sampling engine step on one device as two programs that never send the `[rows, vocab]`
logits to the host: `step_logits` (placeholder tokens resolved, `placeholders.py`, then the
model step; the rows' last-token logits stay on the device) and `sample_logits` (the sampler on
them; only the sampled tokens, and log-probabilities when a row asked, come back).

Two programs, not one, so that the model is compiled once per step shape: what the sampler
is asked for (log-probabilities, structured-output masks) selects one of several small sampler
programs, never a second copy of the model. The host may also build the masks while the model
half runs (asynchronous scheduling with structured output). The logits are materialised between
the two on the device, as they are inside one program (the sampler reads them several times).

`programs.py` jits both once per engine configuration, the cache donated to the first and the
per-slot sampling state to the second (its output counts advance by the kept tokens). Under a
mesh the same two programs run shard-mapped (`sharding.engine_step.MeshStep.step_logits` and
`sample`).
"""

from __future__ import annotations

import dataclasses

import jax

from deepinfer.model.config import ModelConfig
from deepinfer.model.kv_cache import CacheLayout, KVCache
from deepinfer.model.step import StepBatch, step_body
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.sampler import SampleOutput, SampleRows, Sampler
from deepinfer.serve.engine.sampling_state import SamplingState

__all__ = ["model_rows", "sample_logits", "sampler_rows", "step_logits"]


def model_rows(rows: SampleRows) -> SampleRows:
    """What `step_logits` reads of a step's sampler rows: the masks are the sampler's alone, so
    a step with masks and one without run the same model program."""
    return dataclasses.replace(rows, allowed=None)


def sampler_rows(rows: SampleRows) -> SampleRows:
    """What `sample_logits` reads of them: the Engram look-back is the model's alone."""
    return dataclasses.replace(rows, folds=None)


def step_logits(params: dict, cache: KVCache, state: SamplingState, batch: StepBatch, rows: SampleRows, *,
                config: ModelConfig, layout: CacheLayout,
                kernels: KernelConfig | None = None) -> tuple[KVCache, jax.Array, jax.Array]:
    """The model half: placeholders resolved from the state (`rows.folds`: their Engram
    look-back), the model step. Returns the updated cache, the rows' last-token logits (left on
    the device for `sample_logits`) and the int32 `[layers, experts]` routed-token counts (EPLB)."""
    batch = Sampler.resolve(batch, state, rows, config)
    return step_body(params, cache, batch, config=config, layout=layout, kernels=kernels)


def sample_logits(logits: jax.Array, state: SamplingState, slots: jax.Array, rows: SampleRows, *,
                  head: Sampler = Sampler()) -> tuple[SamplingState, SampleOutput]:
    """The sampler half on `step_logits`' logits (with the rows' masks): the updated sampling
    state and the rows' `SampleOutput`."""
    return head(logits, state, slots, rows)
