"""One engine step on one device as one program: placeholder tokens resolved (`placeholders.py`),
the model step, then the sampler on each
row's last-token logits, so only the sampled tokens (and log-probabilities, when a row asked)
come back to the host, never the `[rows, vocab]` logits.

`programs.py` jits it once per engine configuration, with the cache and the per-slot sampling
state donated: they come back updated (the state's output counts advance by the kept tokens).
Under a mesh the same head runs inside the shard-mapped step (`sharding.engine_step.MeshStep`,
`head=`).
"""

from __future__ import annotations

import jax

from deepinfer.model.config import ModelConfig
from deepinfer.model.kv_cache import CacheLayout, KVCache
from deepinfer.model.step import StepBatch, step_body
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.sampler import SampleOutput, SampleRows, Sampler
from deepinfer.serve.engine.sampling_state import SamplingState

__all__ = ["sample_logits", "step_and_sample", "step_logits"]


def step_and_sample(params: dict, cache: KVCache, state: SamplingState, batch: StepBatch, rows: SampleRows, *,
                    config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None = None,
                    head: Sampler = Sampler()) -> tuple[KVCache, SamplingState, SampleOutput, jax.Array]:
    """Returns the updated cache and sampling state, the rows' `SampleOutput` and the int32
    `[layers, experts]` routed-token counts (EPLB)."""
    batch = head.resolve(batch, state, rows, config)
    cache, logits, counts = step_body(params, cache, batch, config=config, layout=layout, kernels=kernels)
    state, out = head(jax.lax.optimization_barrier(logits), state, batch.slots, rows)
    return cache, state, out, counts


def step_logits(params: dict, cache: KVCache, state: SamplingState, batch: StepBatch, rows: SampleRows, *,
                config: ModelConfig, layout: CacheLayout,
                kernels: KernelConfig | None = None) -> tuple[KVCache, jax.Array, jax.Array]:
    """The first half of `step_and_sample` as its own program: placeholders resolved, the model
    step; the rows' last-token logits stay on the device for `sample_logits`. A decode step whose
    structured-output masks need the previous step's tokens runs so: the host reads those tokens
    and builds the masks while the device runs this."""
    batch = Sampler.resolve(batch, state, rows, config)
    return step_body(params, cache, batch, config=config, layout=layout, kernels=kernels)


def sample_logits(logits: jax.Array, state: SamplingState, slots: jax.Array, rows: SampleRows, *,
                  head: Sampler = Sampler()) -> tuple[SamplingState, SampleOutput]:
    """The second half: the sampler on `step_logits`' logits (with the rows' masks)."""
    return head(logits, state, slots, rows)
