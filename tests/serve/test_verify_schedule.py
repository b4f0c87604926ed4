"""Confidence-scheduled verification (`serve/engine/verify_schedule.py`): Algorithm 1 of the DSpark
paper, its early stop (the Appendix-A counterexample, engine-features.md §2.3), and the engine's
choice of a verify width from stale confidences."""

import json

import numpy as np
import pytest

from deepinfer.serve.engine.verify_schedule import (CALIBRATION_FILE, VerifySchedule, calibrate, load_calibration,
                                                     schedule)


def _by_tokens(per_step: float, per_token: float):
    """A step cost linear in the verified tokens (requests + drafts)."""
    return lambda lengths: per_step + per_token * (len(lengths) + int(lengths.sum()))


def test_cheap_tokens_admit_every_draft_and_dear_ones_none():
    confidences = [np.array([0.9, 0.8, 0.5]), np.array([0.3, 0.2]), np.array([])]
    assert schedule(confidences, _by_tokens(1.0, 0.0)).tolist() == [3, 2, 0]
    assert schedule(confidences, _by_tokens(0.0, 1.0)).tolist() == [0, 0, 0]


def test_candidates_are_admitted_in_order_of_survival():
    """Survival a[r, j] = c[r,1]···c[r,j]: (0, 1) 0.9, (0, 2) 0.72, (1, 1) 0.6, (0, 3) 0.36, (1, 2)
    0.06. At 0.12 s per token over 1 s per step a candidate pays while its survival exceeds the
    throughput times 0.12 (~0.3 here): the first four do, (1, 2) does not."""
    confidences = [np.array([0.9, 0.8, 0.5]), np.array([0.6, 0.1])]
    assert schedule(confidences, _by_tokens(1.0, 0.12)).tolist() == [3, 1]


def test_the_early_stop_ends_at_a_cost_cliff_the_global_search_crosses():
    """A padded verify step costs the same for every width up to its widest row: here widths 1-2
    are dear and 3 cheap. Algorithm 1 stops at the first candidate that does not pay (width 1);
    without the stop it finds the better prefix behind the cliff."""
    seconds = np.array([1.0, 2.0, 2.0, 1.1])
    cost = lambda lengths: seconds[int(lengths.max(initial=0))]  # noqa: E731
    confidences = [np.array([0.9, 0.9, 0.9])] * 2
    assert schedule(confidences, cost).tolist() == [0, 0]
    assert schedule(confidences, cost, early_stop=False).tolist() == [3, 3]


def _first_token_of_a_step(rng, n: int, early_stop: bool) -> np.ndarray:
    """Appendix A: the target gives (A, B) probabilities (0.7, 0.3), the drafter (0.5, 0.5). Draft 1
    x1 is drawn from the drafter; the confidence of draft 2 depends on it (high after A, low after
    B: the Markov feature), and the scheduler sees both confidences before the step. Draft 1 then
    goes through the lossless acceptance rule if admitted (accept with min(1, p/q), else the
    residual norm(max(0, p - q)) = A); if not, the first token is drawn from the target.
    Returns the first tokens (0 = A) of n independent steps."""
    p, q = np.array([0.7, 0.3]), np.array([0.5, 0.5])
    seconds = np.array([1.0, 1.6, 1.7])  # draft 1 alone does not pay; drafts 1 and 2 may
    cost = lambda lengths: seconds[int(lengths.sum())]  # noqa: E731
    lengths = {x1: int(schedule([np.array([0.5, 0.95 if x1 == 0 else 0.05])], cost, early_stop=early_stop)[0])
               for x1 in (0, 1)}
    x1 = rng.random(n) < q[1]  # 1 = B
    admitted = np.array([lengths[0], lengths[1]])[x1.astype(int)] > 0
    accepted = rng.random(n) < np.minimum(1.0, p[x1.astype(int)] / q[x1.astype(int)])
    verified = np.where(accepted, x1, 0)  # a rejected B is replaced by the residual's A
    plain = rng.random(n) < p[1]
    return np.where(admitted, verified, plain).astype(int)


def _scaled(c, t):
    """Temperature scaling in closed form: sigmoid(logit(c) / t) = 1 / (1 + ((1 - c) / c) ** (1 / t))."""
    c, t = np.asarray(c, np.float64), np.asarray(t, np.float64)
    return 1.0 / (1.0 + ((1.0 - c) / c) ** (1.0 / t))


def test_sts_temperatures_calibrate_the_confidences_the_schedule_reads():
    """Sequential Temperature Scaling (engine-features.md §2.2): draft k's confidence becomes
    sigmoid(logit(c_k) / T_k) in every average the schedule keeps; order is kept, 0 and 1 stay.
    An overconfident drafter (T > 1 pulls confidences toward 1/2) no longer buys a verify step
    that the raw confidences would."""
    temperatures = (2.0, 0.5, 1.0)
    raw = np.array([0.9, 0.6, 0.3])
    np.testing.assert_allclose(calibrate(raw, temperatures), _scaled(raw, temperatures), rtol=1e-12)
    np.testing.assert_allclose(calibrate(raw, temperatures), [0.75, 0.6923076923, 0.3], rtol=1e-9)
    np.testing.assert_array_equal(calibrate(raw, None), raw)
    np.testing.assert_array_equal(calibrate(np.array([0.0, 1.0, 0.5]), (2.0, 2.0, 2.0)), [0.0, 1.0, 0.5])
    grid = np.linspace(0.01, 0.99, 99)
    assert np.all(np.diff(calibrate(grid, (3.0,) * 99)) > 0)
    seconds = [1.0, 1.8, 3.0, 4.0]
    plain, calibrated = VerifySchedule(seconds, alpha=1.0), VerifySchedule(seconds, alpha=1.0, temperatures=temperatures)
    np.testing.assert_allclose(calibrated.observe(None, np.r_[raw, 0.5, 0.5]), _scaled(raw, temperatures), rtol=1e-12)
    calibrated.observe_step([raw, raw])
    np.testing.assert_allclose(calibrated.prior, _scaled(raw, temperatures), rtol=1e-12)
    # one request: (1 + 0.9) / 1.8 beats a plain step's 1 / 1.0; calibrated, (1 + 0.75) / 1.8 does not
    assert plain.width([plain.observe(None, raw)], [3]) == 1
    assert calibrated.width([calibrated.observe(None, raw)], [3]) == 0
    with pytest.raises(ValueError, match="temperatures: one per draft position up to 3"):
        VerifySchedule(seconds, temperatures=(1.0, 1.0))


def test_a_checkpoints_calibration_file_is_read_and_a_bad_one_named(tmp_path):
    assert load_calibration(tmp_path) is None
    path = tmp_path / CALIBRATION_FILE
    path.write_text(json.dumps({"confidence_temperatures": [0.7, 1, 1.5], "source": "a test"}))
    assert load_calibration(tmp_path) == (0.7, 1.0, 1.5)
    for bad in ("{", json.dumps({"temperatures": [1.0]}), json.dumps({"confidence_temperatures": [1.0, -2.0]}),
                json.dumps({"confidence_temperatures": []})):
        path.write_text(bad)
        with pytest.raises(ValueError, match=f"{CALIBRATION_FILE}.*confidence_temperatures"):
            load_calibration(tmp_path)


def test_appendix_a_the_early_stop_keeps_the_target_distribution():
    """With the early stop, whether draft 1 is verified cannot depend on draft 1 itself: the first
    token follows the target (0.7, 0.3). A retrospective argmax over the prefixes (no early stop)
    verifies draft 1 only when it is A, and the first token is A with probability 0.85."""
    rng = np.random.default_rng(0)
    n = 200_000
    sd = np.sqrt(0.7 * 0.3 / n)  # ~0.001
    with_stop = 1 - _first_token_of_a_step(rng, n, early_stop=True).mean()
    assert abs(with_stop - 0.7) < 5 * sd, with_stop
    without = 1 - _first_token_of_a_step(rng, n, early_stop=False).mean()
    assert abs(without - 0.85) < 5 * sd, without


def test_width_from_stale_confidences():
    """The engine's choice: one width for the step, from each request's moving average (the
    engine-wide one before its first step), at most its lookahead; 0 is a plain decode step."""
    sched = VerifySchedule([1.0, 1.05, 1.1, 1.6])  # a plain decode step, then verify steps of 1..3 drafts
    assert sched.max_width == 3
    # before any step the prior is certain acceptance: verify as far as pays
    assert sched.width([None, None], [3, 3]) == 2  # 2 x 3 tokens / 1.1 s beats 2 x 4 / 1.6 s
    assert sched.width([None], [1]) == 1  # its lookahead bounds it
    low = sched.observe(None, np.array([0.05, 0.05, 0.05, 0.5, 0.5]))  # the drafter's whole block
    np.testing.assert_allclose(low, 0.8 * np.array([0.05, 0.05, 0.05]) + 0.2 * 1.0)
    sched.observe_step([np.array([0.05, 0.05, 0.05, 0.5]), np.array([0.15, 0.05, 0.05, 0.5])])
    np.testing.assert_allclose(sched.prior, 0.8 * np.array([0.1, 0.05, 0.05]) + 0.2 * 1.0)
    sched.observe_step([])  # a step in which no request speculated
    np.testing.assert_allclose(sched.prior, 0.8 * np.array([0.1, 0.05, 0.05]) + 0.2 * 1.0)
    assert sched.width([low, low], [3, 3]) == 1  # 2 x 1.24 / 1.05 beats 2 x 1.29 / 1.1
    lower = sched.observe(low, np.array([0.001, 0.001, 0.001]))  # 0.049 each
    assert sched.width([lower], [3]) == 0
    assert sched.width([], []) == 0


def test_plain_decoding_probes_the_drafter_now_and_then():
    """Where no draft pays the steps decode plainly, which drafts nothing: every `probe_every + 1`-th
    such step verifies the best width of at least one draft, so fresh confidences can bring
    speculation back. Steps in which no request can speculate neither count nor probe."""
    sched = VerifySchedule([1.0, 1.5, 1.6, 3.0], probe_every=2)
    weak = [np.array([0.3, 0.3, 0.3])] * 2
    assert [sched.width(weak, [3, 3]) for _ in range(3)] == [0, 0, 2]  # (2 + 0.78) / 1.6 beats 1.6 / 1.5
    assert sched.width([None], [0]) == 0 and sched.plain_steps == 0
    assert [sched.width(weak, [3, 3]) for _ in range(3)] == [0, 0, 2]
    strong = [np.array([0.95, 0.95, 0.95])] * 2
    assert sched.width(strong, [3, 3]) == 2 and sched.plain_steps == 0


def test_a_bad_cost_table_is_refused():
    for bad in ([1.0], [1.0, 0.0], [[1.0, 2.0]]):
        with pytest.raises(ValueError, match="step_seconds"):
            VerifySchedule(bad)
