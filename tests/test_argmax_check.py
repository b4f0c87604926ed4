"""The flip-aware argmax comparison fails on a real disagreement and forgives a close call."""

import numpy as np
import pytest

from tests.argmax_check import assert_argmax_agrees

REF = np.array([[[0.0, 5.0, 1.0],     # clear winner 1
                 [2.0, 2.0 + 1e-6, 0.0],  # close call: 0 or 1
                 [9.0, 0.0, 0.0]]])   # clear winner 0


def test_agreement_and_close_calls_pass():
    assert_argmax_agrees(np.array([[1, 0, 0]]), REF, atol=1e-4)
    assert_argmax_agrees(REF + 1e-5, REF, atol=1e-4)


def test_a_clear_disagreement_fails():
    with pytest.raises(AssertionError, match=r"first: \[\[0, 2\]\]"):
        assert_argmax_agrees(np.array([[1, 1, 2]]), REF, atol=1e-4)


def test_sequential_stops_at_the_first_close_call():
    assert_argmax_agrees(np.array([[1, 0, 2]]), REF, atol=1e-4, sequential=True)
    with pytest.raises(AssertionError):
        assert_argmax_agrees(np.array([[2, 0, 0]]), REF, atol=1e-4, sequential=True)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"ours: shape \(1, 2\)"):
        assert_argmax_agrees(np.zeros((1, 2), int), REF, atol=1e-4)
