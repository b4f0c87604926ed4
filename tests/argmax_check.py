"""Argmax equality that allows for rounding flips.

Two computations that agree to a tolerance can still pick different argmaxes where the two best
logits are closer than that tolerance, and which positions those are depends on the machine's
rounding (CPU flags, thread counts). Exact argmax equality over a long prompt is therefore a test
that passes only where the rounding happens to agree; `assert_argmax_agrees` compares exactly
where a difference of `atol` cannot swap the winner and lets either side win where it can.
"""

from __future__ import annotations

import numpy as np


def assert_argmax_agrees(ours: np.ndarray, ref_logits: np.ndarray, atol: float, *,
                         sequential: bool = False) -> None:
    """`ours` (token ids `[..., T]`, or logits `[..., T, V]` whose argmax is taken) equals the
    argmax of `ref_logits` `[..., T, V]` at every position whose two best reference logits are more
    than `2 * atol` apart. `sequential`: each position is conditioned on the tokens before it (a
    draft block), so a row is compared only up to its first close call."""
    ref_logits = np.asarray(ref_logits, np.float64)
    ours = np.asarray(ours)
    if ours.shape == ref_logits.shape:
        ours = ours.argmax(-1)
    if ours.shape != ref_logits.shape[:-1]:
        raise ValueError(f"ours: shape {ours.shape}, expected {ref_logits.shape[:-1]} or {ref_logits.shape}")
    top2 = np.sort(ref_logits, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * atol
    if sequential:
        clear = np.cumprod(clear, axis=-1).astype(bool)
    wrong = np.argwhere(clear & (ours != ref_logits.argmax(-1)))
    assert not len(wrong), (f"argmax differs at {len(wrong)} position(s) where no difference of {atol:.2e} "
                            f"can swap it; first: {wrong[:3].tolist()}")
