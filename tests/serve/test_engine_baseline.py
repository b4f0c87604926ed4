"""The engine reproduces the outputs recorded from the first-wave engine (greedy and seeded
sampling, tokens and logprobs) on a mixed-length batch at the engine's defaults; see
`tests/serve/engine_baseline.py` for how they were recorded and why the comparison is flip-aware."""

import json

import pytest

from tests.serve import engine_baseline as baseline


@pytest.fixture(scope="module")
def model():
    return baseline.model()


@pytest.fixture(scope="module")
def recorded():
    return json.loads(baseline.FIXTURE.read_text())["outputs"]


@pytest.mark.parametrize("kind", sorted(baseline.SAMPLING))
def test_engine_reproduces_recorded_outputs(model, recorded, kind):
    ours = baseline.generate(model, kind)
    assert sorted(ours) == sorted(recorded[kind])
    for request_id, output in ours.items():
        baseline.assert_matches(output, recorded[kind][request_id], f"{kind} {request_id}")
