"""Placeholder input tokens: a decode row whose input is the token its sequence's previous step
sampled, which the host has not read yet (asynchronous scheduling, `engine.py`).

The host writes -1 for such a token; inside the jitted step, before the model runs, it becomes the
slot's `last_token` (written by the sampler of the step that drew it), and its Engram rows are
computed on the device from the look-back folds the host sent (`SampleRows.folds`). Keyed by slot,
not by the previous step's row: rows may change order between steps, a slot's sequence cannot
(a slot is reset when a new sequence takes it, and its first decode always follows a step that
sampled into it).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from deepinfer.model.config import ModelConfig
from deepinfer.model.engram_hash_device import hash_pending
from deepinfer.model.step import StepBatch

__all__ = ["PLACEHOLDER", "resolve"]

PLACEHOLDER = -1
"""A decode row's input token that only the device knows yet."""


def resolve(batch: StepBatch, state, rows, config: ModelConfig) -> StepBatch:
    """`batch` with every placeholder token (and its Engram rows) filled in from `state`
    (`SamplingState`); `rows` (`SampleRows`) carries the look-back folds. Decode steps only
    (one token per row): a prefill chunk never starts with a token the host has not read."""
    if batch.tokens.shape[1] != 1:
        return batch
    first = batch.tokens[:, 0]
    pending = first == PLACEHOLDER
    last = state.last_token[batch.slots]
    token = jnp.where(pending, last, first)
    hash_ids = batch.hash_ids
    if hash_ids is not None and rows.folds is not None:
        fresh = hash_pending(config, token, rows.folds)
        hash_ids = jnp.where(pending[:, None, None, None], fresh[:, None], hash_ids)
    return dataclasses.replace(batch, tokens=token[:, None], hash_ids=hash_ids)
