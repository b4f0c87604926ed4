"""Balanced context parallelism (CP) for long prefill: the zigzag token split and a work model.

Why this exists
---------------
Under context parallelism the prompt's query tokens are spread over ``cp`` ranks.  With causal
attention a query at position ``p`` reads ``p + 1`` keys, so a plain contiguous split gives the last
rank far more work than the first and every layer waits for the slowest rank.  The zigzag split cuts
the (padded) prompt into ``2 * cp`` equal blocks and gives rank ``r`` blocks ``r`` and
``2 * cp - 1 - r``: one early (cheap) block and the mirrored late (expensive) block, so the per-rank
sums of causal work are equal.  For sparse-attention (DSA/CSA) layers the queries are split the same
way and the shared compressed KV is all-gathered, so only query-side work is divided.

This module is pure numpy planning code: it decides which token positions each rank owns and
estimates how even the resulting work is.  It never touches device memory.

Padding
-------
Both splitters pad the prompt to a whole number of blocks so that every rank holds the same number of
slots (static shapes).  Padding slots hold the position ``PAD`` (= -1); real tokens hold their
position ``0 .. num_tokens - 1``.  The padding sits at the end of the padded sequence (the tail of the
last block).  ``attention_work`` ignores padding slots.

Work model (``attention_work``)
-------------------------------
Costs are counted in key/entry reads, per query position ``p`` (0-based):

* dense causal attention: ``p + 1``;
* DeepSeek-V4.1 sparse attention, for a layer whose compressor ratio is ``ratio``:
  ``v = (p + 1) // ratio`` compressed entries are visible, and the cost is
  ``min(p + 1, window)`` (sliding window, current token included)
  ``+ min(v, topk)`` (selected compressed entries)
  ``+ v`` (the candidate-source indexer scores every visible entry).
  ``ratio = 0`` means a window-only layer (no compressed entries, no indexer).

This is a first-order model: it ignores per-token constant costs (projections, MoE) that are
split evenly by any equal-count split, and it ignores communication.
"""

from __future__ import annotations

import numpy as np

PAD = -1  # position value written into padding slots

__all__ = ["PAD", "zigzag_blocks", "zigzag_slots", "contiguous_blocks", "attention_work", "balance_report"]


def _check(num_tokens: int, cp: int) -> None:
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got cp={cp!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative integer, got num_tokens={num_tokens!r}")


def _padded_positions(num_tokens: int, multiple: int) -> np.ndarray:
    padded = -(-num_tokens // multiple) * multiple
    pos = np.arange(padded, dtype=np.int64)
    pos[num_tokens:] = PAD
    return pos


def zigzag_blocks(num_tokens: int, cp: int) -> list[np.ndarray]:
    """Token positions owned by each CP rank under the zigzag split.

    The prompt is padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` equal blocks; rank ``r``
    gets block ``r`` followed by block ``2 * cp - 1 - r``.  Padding slots hold ``PAD`` (-1).
    Returns ``cp`` int64 arrays of equal length.
    """
    slots = zigzag_slots(num_tokens, cp)
    return np.split(np.where(slots < num_tokens, slots, PAD), cp)


def zigzag_slots(num_tokens: int, cp: int) -> np.ndarray:
    """The zigzag split as one rank-major array of indices into the padded natural sequence.

    Slot ``i`` of the concatenated ``zigzag_blocks(num_tokens, cp)`` holds padded token
    ``zigzag_slots(...)[i]``; indices ``>= num_tokens`` are padding.  The CP forward permutes
    token ids with it on the host; ``cp_forward.unzigzag`` undoes it on the device.
    """
    _check(num_tokens, cp)
    blocks = np.split(np.arange(-(-num_tokens // (2 * cp)) * (2 * cp), dtype=np.int64), 2 * cp)
    return np.concatenate([np.concatenate([blocks[r], blocks[2 * cp - 1 - r]]) for r in range(cp)])


def contiguous_blocks(num_tokens: int, cp: int) -> list[np.ndarray]:
    """Token positions per rank under a plain contiguous split (for comparison).

    The prompt is padded to a multiple of ``cp`` and cut into ``cp`` equal runs; rank ``r`` gets run
    ``r``.  Padding slots hold ``PAD`` (-1).
    """
    _check(num_tokens, cp)
    return list(np.split(_padded_positions(num_tokens, cp), cp))


def attention_work(positions, *, window: int = 128, topk: int = 512, ratio: int = 1,
                   dense_causal: bool = False) -> float:
    """Attention work (key/entry reads) for the query ``positions`` one rank holds.

    See the module docstring for the model.  Padding slots (negative positions) cost nothing.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got window={window!r}")
    if topk < 0:
        raise ValueError(f"topk must be >= 0, got topk={topk!r}")
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0, got ratio={ratio!r}")
    pos = np.asarray(positions, dtype=np.int64)
    n = pos[pos >= 0] + 1  # keys visible to each real query (causal, self included)
    if dense_causal:
        return float(n.sum())
    work = np.minimum(n, window).sum()
    if ratio > 0:
        visible = n // ratio
        work += np.minimum(visible, topk).sum() + visible.sum()
    return float(work)


def balance_report(num_tokens: int, cp: int, **work_kwargs) -> dict:
    """Per-rank work and its max/mean imbalance for the zigzag and the contiguous split.

    ``work_kwargs`` go to ``attention_work``.  Returns
    ``{"zigzag": {"work": [...], "max_over_mean": x}, "contiguous": {...}}``.
    """
    _check(num_tokens, cp)
    report = {}
    for name, split in (("zigzag", zigzag_blocks), ("contiguous", contiguous_blocks)):
        work = [attention_work(p, **work_kwargs) for p in split(num_tokens, cp)]
        mean = float(np.mean(work))
        report[name] = {"work": work, "max_over_mean": (max(work) / mean) if mean > 0 else 1.0}
    return report
