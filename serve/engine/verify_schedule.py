"""How many drafts a DSpark verify step checks: the paper's hardware-aware prefix scheduler
(Algorithm 1, engine-features.md §2.3) over this engine's measured verify-step cost.

`schedule` is Algorithm 1: candidates (request r, draft j) in descending order of survival
a[r,j] = c[r,1]···c[r,j] (the drafter's confidences, each the predicted acceptance of draft j
given the ones before it), admitted one at a time while the expected tokens per second,
tau / seconds(lengths), improves (tau = one token per request plus the admitted survivals).
With `early_stop` it stops at the first candidate that does not improve it: each admission is
then decided before anything that depends on the admitted draft itself is looked at, which is
what keeps it lossless when the confidences are those of the drafts being verified (the
Appendix-A counterexample: without the stop, a retrospective argmax admits draft 1 only when
it is the likelier token and the output distribution drifts from the target's).

The engine drafts and verifies in one device program, so the host chooses before the step's
drafts exist: `VerifySchedule` runs Algorithm 1 on each request's confidences of its earlier
steps (an exponential moving average, vLLM's `adaptive_verification_ema_alpha`), which is the
paper's production variant (§5.2: capacity from stale confidences). A choice that depends only
on tokens already emitted is lossless whatever it is, so there the search continues past
non-improving candidates to the best prefix (`early_stop=False`), across the jumps of a cost
curve that is a step function. A verify step pads every row to one width (all slots x the
anchor and W drafts: `runner.verify`), so its cost is a function of W, profiled at engine start
with a plain decode step's, the cost of W = 0 (`warmup.time_decode_steps`), and every
speculating row checks min(W, its lookahead) drafts: checking fewer would cost the same.

The confidence head is trained toward the analytic acceptance rate but is over- or
under-confident in practice; the paper calibrates it with Sequential Temperature Scaling
(engine-features.md §2.2: position k's confidence becomes sigmoid(logit(c_k) / T_k), T fitted
left to right on held-out data so that the survival products are calibrated), and the scheduler's
expected tokens are only as good as those products. `VerifySchedule(temperatures=)` applies the
temperatures to every confidence it observes; a checkpoint carries its own in
`CALIBRATION_FILE` (`load_calibration`; the embedded trained model's come from its STS phase,
`scripts/train_drafter.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["CALIBRATION_FILE", "VerifySchedule", "calibrate", "load_calibration", "schedule"]

# a checkpoint directory's DSpark confidence calibration: {"confidence_temperatures": [T_1, ...]}
CALIBRATION_FILE = "dspark_calibration.json"


def schedule(confidences: Sequence[np.ndarray], seconds: Callable[[np.ndarray], float], *,
             early_stop: bool = True) -> np.ndarray:
    """Algorithm 1 (module docstring). `confidences[r]`: request r's c[r, 1..γ_r] (γ_r = the
    drafts it may verify, possibly 0); `seconds(lengths)`: the step's cost when request r
    verifies `lengths[r]` drafts. Returns the lengths (int `[R]`)."""
    R = len(confidences)
    lengths = np.zeros(R, np.int64)
    # survival order; within a request survival never increases, and ties go draft position first
    # (breadth before depth, so equal confidences widen every request alike)
    candidates = sorted((-a, j, r) for r, c in enumerate(confidences)
                        for j, a in enumerate(np.cumprod(np.asarray(c, np.float64))))
    tau = float(R)
    best, chosen = tau / seconds(lengths), lengths.copy()
    for negative_survival, j, r in candidates:
        lengths[r] = j + 1
        tau -= negative_survival
        value = tau / seconds(lengths)
        if value > best:
            best, chosen = value, lengths.copy()
        elif early_stop:
            break
    return chosen


def calibrate(confidence: np.ndarray, temperatures: Sequence[float] | None) -> np.ndarray:
    """Sequential Temperature Scaling applied (module docstring): confidence k (a sigmoid
    output) becomes sigmoid(logit(c_k) / T_k); None: unchanged. Float64, and 0 and 1 stay."""
    c = np.asarray(confidence, np.float64)
    if temperatures is None:
        return c
    t = np.asarray(temperatures, np.float64)[:c.shape[-1]]
    with np.errstate(divide="ignore"):
        logit = np.log(c) - np.log1p(-c)
    return 1.0 / (1.0 + np.exp(-logit / t))


def load_calibration(directory: str | os.PathLike) -> tuple[float, ...] | None:
    """The confidence temperatures a checkpoint directory carries (`CALIBRATION_FILE`), or None
    when it has none; a file that is there but unreadable is a ValueError naming it."""
    path = os.path.join(directory, CALIBRATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            temperatures = json.load(f)["confidence_temperatures"]
        values = tuple(float(t) for t in temperatures)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a DSpark calibration ({{\"confidence_temperatures\": [...]}}): {e}") from None
    if not values or not all(0 < t < float("inf") for t in values):
        raise ValueError(f"{path}: confidence_temperatures must be positive numbers, got {list(values)}")
    return values


class VerifySchedule:
    """The verify width of each step from stale confidences and the measured step costs.

    `step_seconds[W]`: seconds of a verify step in which every row checks W >= 1 drafts (W up to
    num_speculative_tokens), and `step_seconds[0]` a plain decode step's: when no draft pays the
    step decodes plainly (no drafter, no verification), so speculation costs nothing where it
    does not pay. `observe` folds a request's confidences from a verify step into its moving
    average, `observe_step` a step's into the engine-wide one that stands in for a request's
    first step.

    A plain step drafts nothing, so the confidences would never change again: after
    `probe_every` plain steps in a row in which some request could speculate, the next one
    verifies the best width of at least one draft (a probe), which bounds what probing costs to
    one verify step in `probe_every + 1`.

    `temperatures`: the drafter's STS temperatures per draft position (`calibrate`), applied to
    every confidence observed; None: the raw confidences."""

    def __init__(self, step_seconds: Sequence[float], *, alpha: float = 0.8, probe_every: int = 8,
                 temperatures: Sequence[float] | None = None):
        self.step_seconds = np.asarray(step_seconds, np.float64)
        if self.step_seconds.ndim != 1 or len(self.step_seconds) < 2 or not np.all(self.step_seconds > 0):
            raise ValueError(f"step_seconds: a positive cost for a plain decode step, then one per width 1..k, "
                             f"got {step_seconds!r}")
        self.alpha = alpha
        self.probe_every = probe_every
        self.temperatures = None if temperatures is None else tuple(temperatures)
        if self.temperatures is not None and len(self.temperatures) < self.max_width:
            raise ValueError(f"temperatures: one per draft position up to {self.max_width}, got {self.temperatures}")
        self.plain_steps = 0  # plain decode steps in a row in which some request could speculate
        # before any step: certain acceptance, so the first steps verify as much as pays
        self.prior = np.ones(len(self.step_seconds) - 1)

    @property
    def max_width(self) -> int:
        return len(self.step_seconds) - 1

    def observe(self, previous: np.ndarray | None, confidence: np.ndarray) -> np.ndarray:
        """A request's average after a step that gave `confidence` (per draft position; the
        drafter scores its whole block whatever was verified); `previous` None: its first (then
        the engine-wide average stands in for its history)."""
        confidence = calibrate(np.asarray(confidence)[:self.max_width], self.temperatures)
        return self.alpha * confidence + (1 - self.alpha) * (self.prior if previous is None else previous)

    def observe_step(self, confidences: Sequence[np.ndarray]) -> None:
        """Fold a verify step's confidences (its speculating requests') into the engine-wide
        average, the stand-in for a request's first step."""
        if len(confidences):
            mean = np.mean([calibrate(np.asarray(c)[:self.max_width], self.temperatures) for c in confidences],
                           axis=0)
            self.prior = self.alpha * mean + (1 - self.alpha) * self.prior

    def width(self, confidences: Sequence[np.ndarray | None], lookaheads: Sequence[int]) -> int:
        """The step's W for requests with these averages (None: no step yet) that may verify
        `lookaheads[r]` drafts: Algorithm 1 without the early stop (module docstring); 0 is a
        plain decode step, except for a probe (class docstring)."""
        rows = [(self.prior if c is None else c)[:min(n, self.max_width)] for c, n in zip(confidences, lookaheads)]
        seconds = self.step_seconds
        width = int(schedule(rows, lambda lengths: seconds[int(lengths.max(initial=0))],
                             early_stop=False).max(initial=0))
        if width or not any(len(r) for r in rows):
            self.plain_steps = 0 if width else self.plain_steps
            return width
        if self.plain_steps < self.probe_every:
            self.plain_steps += 1
            return 0
        self.plain_steps = 0
        survival = [np.cumprod(r) for r in rows]
        value = [(len(rows) + sum(a[:w].sum() for a in survival)) / seconds[w] for w in range(1, self.max_width + 1)]
        return 1 + int(np.argmax(value))
