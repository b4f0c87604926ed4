"""`EngineConfig`: how an `LLMEngine` runs (its cache budget, prefill, scheduling, speculative
decoding, batch invariance, prefix cache), checked when it is made. Holds no mesh: the engine
takes that separately."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.prefix_cache import PrefixCacheConfig
from deepinfer.serve.engine.scheduler import GRANULE
from deepinfer.serve.engine.speculative import SpeculativeConfig

__all__ = ["PREFILL_MODES", "EngineConfig"]

PREFILL_MODES = ("full", "compact")


@dataclass(frozen=True)
class EngineConfig:
    budget: CacheBudget = CacheBudget()
    prefill_chunk: int = 512
    # tokens per step and dp rank (vLLM's name): decodes plus prefill chunks of several prompts,
    # and the prefill step's padded rows x tokens; a burst of requests is admitted in a few steps
    max_num_batched_tokens: int = 2048
    # the narrowest page table a step reads covers this many tokens: the steps of shorter
    # sequences read it (padding pages are skipped), so they compile one program fewer per
    # doubling (`runner.page_bucket`)
    min_page_bucket_tokens: int = 2048
    seed: int = 0
    kernels: KernelConfig | None = None
    # "compact" (DeepInfer's default): decoder layers run only on each prompt's last
    # `keep_tokens` rows (model-v4.1-flash.md §4.3); "full": every layer on every row
    prefill_mode: str = "compact"
    keep_tokens: int = 140
    # expert load balancing: every `eplb_interval` steps, a new layout of `eplb_slots` physical
    # experts per layer (default: one extra slot per device) from the load counted since the last
    eplb_interval: int | None = None
    eplb_slots: int | None = None
    # keep the DSpark drafter's context (its per-block window rings) when the checkpoint has the
    # drafter: per token one main_proj and a wkv per block (about 3 % of a step), which only the
    # speculative-decoding loop reads: off unless speculative decoding is on
    drafter_context: bool = False
    # the per-slot sampling state's fixed-size lists: logit_bias entries per request, and stop
    # token ids held back until min_tokens (plus EOS)
    max_logit_bias: int = 128
    max_stop_token_ids: int = 32
    # plan and dispatch each step before reading the previous step's tokens (module docstring)
    async_scheduling: bool = True
    # DSpark speculative decoding (`speculative.py`); None: off. It keeps the drafter's context
    # (whatever `drafter_context` says) and, for now, reads each step before planning the next
    speculative: SpeculativeConfig | None = None
    # batch-invariant inference (engine-features.md §3): a request's tokens and logprobs are the
    # same bits whatever else is in the batch, its row, and how its prompt was chunked; the step
    # computes every product in fixed tiles and each query's keys in one order
    # (`KernelConfig.batch_invariant`), and a request without a seed samples with one derived
    # from its prompt (not from its arrival). With speculative decoding, a draft is accepted iff
    # it is the token the plain sampler draws there (`accept_drafts(by_sample=True)`): the same
    # bits as without. On a mesh too (dp ranks, experts over every device; DSpark included);
    # there prefill chunks are not split over cp (each cp replica computes whole rows).
    deterministic: bool = False
    # share full prompt pages between requests by their tokens and rebuild the per-sequence
    # state of a hit by replay (`prefix_cache.py`); None: every prompt is computed from its start
    prefix_cache: PrefixCacheConfig | None = None

    def __post_init__(self):
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be 'full' or 'compact', got {self.prefill_mode!r}")
        if self.max_num_batched_tokens < GRANULE:
            raise ValueError(f"max_num_batched_tokens must be at least {GRANULE} (one prefill chunk), "
                             f"got {self.max_num_batched_tokens}")
        if self.min_page_bucket_tokens < 1:
            raise ValueError(f"min_page_bucket_tokens must be positive, got {self.min_page_bucket_tokens}")
        if self.keep_tokens < 1:
            raise ValueError(f"keep_tokens must be positive, got {self.keep_tokens}")
        if self.eplb_interval is not None and self.eplb_interval < 1:
            raise ValueError(f"eplb_interval must be positive, got {self.eplb_interval}")
        if self.max_logit_bias < 0 or self.max_stop_token_ids < 0:
            raise ValueError(f"max_logit_bias and max_stop_token_ids must be non-negative, got "
                             f"{self.max_logit_bias} and {self.max_stop_token_ids}")
