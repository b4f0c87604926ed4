"""The compiled engine-step programs of one engine configuration, shared by the engines that use
it and released when none does.

XLA's CPU backend compiles each kernel of a program into its own object and maps three memory
regions per kernel: an engine-step program of tiny-v4.1 holds ~600-900 maps, so a process reaches
the kernel's `vm.max_map_count` (65,530 by default) at ~75-100 live step programs, and the next
compilation dies inside XLA ("LLVM compilation error: Cannot allocate memory", then a segfault).
A module-level `jax.jit` keeps every program it ever compiled, for every engine configuration a
process ever built, long after the engines are gone. Here each (config, layout, kernels) family
gets its own jitted functions, both kinds of step the runner runs: `forward` (the model step,
logits out: encoder-only prefill chunks, all-logits steps) and `sample` (the model step and the
sampler on the device: `device_step.py`). Runners hold their family; a family no runner holds
is kept for the next engine of the same configuration only while the process holds less than
half of `vm.max_map_count`; dropping the jitted functions frees their executables and maps.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from functools import partial

import jax

from deepinfer.model.config import ModelConfig
from deepinfer.model.kv_cache import CacheLayout
from deepinfer.model.step import step_body
from deepinfer.ops.batch_invariant import batch_invariant, compiler_options
from deepinfer.pallas_kernels.registry import KernelConfig, platform_info
from deepinfer.serve.engine.device_step import model_rows, sample_logits, sampler_rows, step_logits
from deepinfer.serve.engine.sampler import Sampler, prompt_logprobs
from deepinfer.serve.engine.speculative import accept_drafts, propose_drafts, verify_target

__all__ = ["StepPrograms", "engine_step", "forget_unused", "forward_step", "memory_maps", "release_unused",
           "step_programs"]


class StepPrograms:
    """The jitted steps of one family: `forward(params, cache, batch, all_logits=, decoder=)`
    (cache donated: logits out, no sampling); a sampling step in two (`device_step`):
    `logits(params, cache, state, batch, rows)` (cache donated) then `sample_logits(logits,
    state, slots, rows, head=)` (state donated); the DSpark verify step in three
    (`speculative`): `propose(params, cache, state, batch, rows, drafts_in)` (the cache only
    read), `target(params, cache, batch, drafts_in, proposal)` (cache donated) then
    `accept(cache, state, batch, rows, drafts_in, proposal, verified, masks, head=)` (cache and
    state donated); `prompt_logprobs(logits, targets, num_logprobs=)` on a `forward` step's
    all-position logits (vLLM's prompt logprobs). Every model program is keyed on its step's shapes alone; what the sampler is
    asked for (log-probabilities, masks) selects a small program of its own."""

    def __init__(self, config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None):
        self.key = (config, layout, kernels)
        bound = dict(config=config, layout=layout, kernels=kernels)
        jit = partial(jax.jit, compiler_options=_compiler_options(kernels))
        self.forward = jit(partial(step_body, **bound), static_argnames=("all_logits", "decoder"),
                           donate_argnums=(1,))
        self.logits = jit(partial(step_logits, **bound), donate_argnums=(1,))
        self.prompt_logprobs = jit(prompt_logprobs, static_argnames=("num_logprobs",))
        invariant = kernels is not None and kernels.batch_invariant
        self.propose = jit(partial(propose_drafts, **bound, coupled=invariant))
        self.target = jit(partial(verify_target, **bound), donate_argnums=(1,))
        if invariant:
            # the samplers invariant too (their exp, log and short sums: `ops.batch_invariant`),
            # and a draft accepted iff it is the token the plain sampler draws at its position:
            # a verify step then gains a decode step's bits (`accept_drafts(by_sample=True)`;
            # the drafts drawn with the same noise: `propose_drafts(coupled=True)`)
            self.sample_logits = jit(batch_invariant(sample_logits), static_argnames=("head",), donate_argnums=(1,))
            self.accept = jit(batch_invariant(partial(accept_drafts, by_sample=True)), static_argnames=("head",),
                              donate_argnums=(0, 1))
        else:
            self.sample_logits = jit(sample_logits, static_argnames=("head",), donate_argnums=(1,))
            self.accept = jit(accept_drafts, static_argnames=("head",), donate_argnums=(0, 1))


def _compiler_options(kernels: KernelConfig | None) -> dict[str, str] | None:
    """XLA options of a batch-invariant family (`ops.batch_invariant.compiler_options`)."""
    if kernels is None or not kernels.batch_invariant:
        return None
    return compiler_options(platform_info(kernels.platform).platform) or None


_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # families some runner holds
_kept: OrderedDict = OrderedDict()  # recently used families, oldest first


def memory_maps() -> tuple[int, int]:
    """(memory maps this process holds, the kernel's per-process limit) on Linux, else (0, 1)."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 1


def release_unused() -> None:
    """Forget the least recently used families while the process holds more than half of
    `vm.max_map_count`; those no runner holds are freed with their executables."""
    count, limit = memory_maps()
    while _kept and count > limit // 2:
        _kept.popitem(last=False)
        count, limit = memory_maps()


def forget_unused() -> None:
    """Forget every kept family no runner holds (their executables and maps are freed)."""
    _kept.clear()


def step_programs(config: ModelConfig, layout: CacheLayout, kernels: KernelConfig | None) -> StepPrograms:
    """The family of (config, layout, kernels): the one a live runner holds, a kept one, or new."""
    key = (config, layout, kernels)
    family = _live.get(key) or _kept.get(key)
    if family is None:
        release_unused()
        family = StepPrograms(config, layout, kernels)
        _live[key] = family
    _kept.pop(key, None)
    _kept[key] = family
    return family


def forward_step(params, config: ModelConfig, layout: CacheLayout, cache, batch, *, all_logits: bool = False,
                 decoder: bool = True, kernels: KernelConfig | None = None):
    """`model.step.forward_step` (returns cache, logits, expert counts) compiled in its family."""
    return step_programs(config, layout, kernels).forward(params, cache, batch, all_logits=all_logits,
                                                          decoder=decoder)


def engine_step(params, cache, state, batch, rows, *, config: ModelConfig, layout: CacheLayout,
                kernels: KernelConfig | None = None, head: Sampler = Sampler()):
    """A sampling step (`device_step`: the model program, then `head`'s sampler program) in its
    family; returns the cache, the sampling state, the rows' samples and the expert counts."""
    family = step_programs(config, layout, kernels)
    cache, logits, counts = family.logits(params, cache, state, batch, model_rows(rows))
    state, out = family.sample_logits(logits, state, batch.slots, sampler_rows(rows), head=head)
    return cache, state, out, counts
