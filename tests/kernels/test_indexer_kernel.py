"""The `index_topk` op: the jnp reference against the float64 numpy oracle, the Pallas scoring
kernel against the reference (Pallas interpret mode on CPU), the model reaching the op through
the registry, and the kernel's CUDA lowering (cross-lowered from this CPU host).

Most cases use "exact" data: small integers and dyadic fractions whose dots, relu, `d**-0.5`
(d a power of 4), head weights and head sums are all exact in fp32 in any summation order, so
kernel and reference scores must agree bit for bit. A unique per-entry offset (head 0, seen only
through key dimension 0) below the other heads' granularity makes every row tie-free, so the
selected indices are fully determined. Continuous data (d = 128, bf16) checks the tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.pallas_kernels.indexer import index_scores_pallas, index_topk_pallas
from deepinfer.pallas_kernels.lowering import TRITON_TARGET, custom_call_targets, lower_for_cuda
from deepinfer.pallas_kernels.reference.indexer import index_scores, index_topk
from tests.kernels.mode import INTERPRET, KERNEL_BACKEND, ON_DEVICE
from tests.reference import v41_reference as R

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def exact_case(seed: int, *, B: int, T: int, H: int, d: int, R: int, ratio: int, positions: np.ndarray | None = None,
               dtype=jnp.float32):
    """Tie-free inputs with exactly representable scores (see the module docstring).

    Heads >= 1: integer q in [-2, 2] and keys in [-1, 1] (dims >= 1), weights in multiples of
    1/8 of either sign: each contributes a multiple of 2**-6. Head 0: q = e_0, weight 1/8,
    key dim 0 = p_r / 256 with p a permutation of the R entries: adds p_r * 2**-14 < 2**-6.
    `positions` default: every query at its own index, batch rows shifted (ragged)."""
    assert d in (16, 64, 256) and R <= 256  # d**-0.5 a power of two; p_r / 256 exact in bf16
    rng = np.random.default_rng(seed)
    q = rng.integers(-2, 3, (B, T, H, d)).astype(np.float32)
    q[..., :, 0] = 0
    q[..., 0, :] = 0
    q[..., 0, 0] = 1
    keys = rng.integers(-1, 2, (B, R, d)).astype(np.float32)
    keys[..., 0] = np.stack([rng.permutation(R) for _ in range(B)]) / 256
    weights = rng.integers(-8, 9, (B, T, H)).astype(np.float32) / 8
    weights[..., 0] = 1 / 8
    if positions is None:
        positions = np.arange(T)[None, :] + 3 * np.arange(B)[:, None]
    return (jnp.asarray(q, dtype), jnp.asarray(weights), jnp.asarray(keys, dtype),
            jnp.asarray(positions, jnp.int32))


def continuous_case(seed: int, *, B: int, T: int, H: int, d: int, R: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, d)), dtype)
    keys = jnp.asarray(rng.standard_normal((B, R, d)), dtype)
    weights = jnp.asarray(rng.standard_normal((B, T, H)) * H ** -0.5, jnp.float32)
    positions = jnp.asarray(np.arange(T)[None, :] + (R - T) + np.zeros((B, 1), int), jnp.int32)
    return q, weights, keys, positions


def assert_tie_free(scores: jax.Array) -> None:
    for row in np.asarray(scores).reshape(-1, scores.shape[-1]):
        finite = row[np.isfinite(row)]
        assert len(np.unique(finite)) == len(finite), "test data has tied scores"


def random_pool(seed: int, B: int, T: int, R: int, keep: float = 0.6) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).random((B, T, R)) < keep)


def kernel_topk(*args, **kw):
    return index_topk_pallas(*args, interpret=INTERPRET, **kw)


def check_exact(q, w, keys, pos, ratio, k, candidates=None, pool=None, **tiles):
    """Kernel and reference: bit-equal scores, identical selection and pool."""
    want_scores = index_scores(q, w, keys, pos, ratio)
    if candidates is not None:
        want_scores = jnp.where(candidates, want_scores, -jnp.inf)
    assert_tie_free(want_scores)
    got_scores = index_scores_pallas(q, w, keys, pos, ratio, candidates, interpret=INTERPRET, **tiles)
    np.testing.assert_array_equal(np.asarray(got_scores), np.asarray(want_scores))
    got_idx, got_pool = kernel_topk(q, w, keys, pos, ratio, k, candidates, pool, **tiles)
    want_idx, want_pool = index_topk(q, w, keys, pos, ratio, k, candidates, pool)
    assert got_idx.dtype == jnp.int32 and got_idx.shape == want_idx.shape == (*pos.shape, min(k, keys.shape[1]))
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    assert (got_pool is None) == (want_pool is None) == (pool is None)
    if pool is not None:
        np.testing.assert_array_equal(np.asarray(got_pool), np.asarray(want_pool))
    return np.asarray(want_idx), want_pool


# ---- the reference op against the float64 numpy oracle ---------------------------------------


@pytest.mark.parametrize("ratio", [1, 2])
def test_reference_matches_numpy_oracle(ratio):
    """Scores, top-k and candidate pool of `index_topk` equal `tests/reference/v41_reference.py`
    (float64; exact data, so equality is exact)."""
    T, H, d, k, blocks, block = 40, 4, 64, 12, 2, 8
    R_ = T // ratio
    q, w, keys, pos = exact_case(1, B=2, T=T, H=H, d=d, R=R_, ratio=ratio)
    scores = np.asarray(index_scores(q, w, keys, pos, ratio))
    topk, pool = index_topk(q, w, keys, pos, ratio, k, None, (blocks, block))
    masked_topk, _ = index_topk(q, w, keys, pos, ratio, k, pool)
    for b in range(2):
        qn, wn, kn = (np.asarray(a[b], np.float64) for a in (q, w, keys))
        oracle = np.einsum("th,thn->tn", wn, np.maximum(np.einsum("thd,nd->thn", qn, kn), 0) * d ** -0.5)
        vis_len = (np.asarray(pos[b]) + 1) // ratio
        oracle[np.arange(R_)[None, :] >= vis_len[:, None]] = -np.inf
        np.testing.assert_array_equal(scores[b], oracle)
        oracle_pool = R.select_candidate_blocks(oracle, vis_len, blocks, block)
        np.testing.assert_array_equal(np.asarray(pool[b]), oracle_pool)
        for idx, s in ((topk, oracle), (masked_topk, np.where(oracle_pool, oracle, -np.inf))):
            chosen = np.zeros((T, R_), bool)
            rows, slots = np.nonzero(np.asarray(idx[b]) >= 0)
            chosen[rows, np.asarray(idx[b])[rows, slots]] = True
            np.testing.assert_array_equal(chosen, R.select_topk(s, k))
    assert bool(jnp.any(topk == -1)) and bool(jnp.any(masked_topk != topk))  # padding and the pool act


def test_pool_and_candidates_are_exclusive():
    q, w, keys, pos = exact_case(2, B=1, T=4, H=4, d=16, R=4, ratio=1)
    for fn in (index_topk, kernel_topk):
        with pytest.raises(ValueError, match="not both"):
            fn(q, w, keys, pos, 1, 2, jnp.ones((1, 4, 4), bool), (2, 2))


# ---- the kernel against the reference ---------------------------------------------------------

TILES = [dict(), dict(block_t=1, block_r=16, tiles=1), dict(block_t=2, block_r=16, tiles=4),
         dict(block_t=4, block_r=32, tiles=2)]
TILE_IDS = ["default", "t1-r16x1", "t2-r16x4", "t4-r32x2"]


@pytest.mark.parametrize("tiles", TILES, ids=TILE_IDS)
@pytest.mark.parametrize("ratio", [1, 2])
def test_prefill_exact(ratio, tiles):
    """Ragged rows (batch row 1 three positions ahead), R not a multiple of any tile, causal
    visibility including queries with 0 visible entries and k larger than most rows' count."""
    T = 45
    R_ = (T + 3) // ratio + 1  # one entry nobody sees
    idx, _ = check_exact(*exact_case(3 + ratio, B=2, T=T, H=4, d=64, R=R_, ratio=ratio), ratio, 16, **tiles)
    assert (idx[0, 0] >= 0).sum() == 1 // ratio and (idx == -1).any(axis=-1).mean() > 0.2 and (idx >= 0).all(axis=-1).any()


@pytest.mark.parametrize("tiles", TILES[:3], ids=TILE_IDS[:3])
def test_boundary_positions_and_padding(tiles):
    """Queries at pos+1 a multiple of the ratio (a new entry just became visible), at pos+1 one
    short of it, at positions with 0 visible entries, and padding slots at position -1."""
    ratio, T = 2, 12
    pos = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1],
                    [15, 16, 17, 31, 32, 33, 0, 1, -1, 3, 47, 48]])
    args = exact_case(7, B=2, T=T, H=8, d=16, R=24, ratio=ratio, positions=pos)
    idx, _ = check_exact(*args, ratio, 8, **tiles)
    n_sel = (idx >= 0).sum(-1)
    np.testing.assert_array_equal(n_sel, np.minimum(np.clip((pos + 1) // ratio, 0, 24), 8))


@pytest.mark.parametrize("tiles", TILES, ids=TILE_IDS)
def test_candidate_mask(tiles):
    """A Reindex layer: the selection restricted to a pool, with fewer pooled entries than k."""
    B, T, R_ = 2, 33, 70
    q, w, keys, _ = exact_case(8, B=B, T=T, H=4, d=64, R=R_, ratio=1)
    pos = jnp.asarray(np.arange(T)[None, :] + np.array([[37], [10]]), jnp.int32)
    idx, _ = check_exact(q, w, keys, pos, 1, 24, random_pool(9, B, T, R_, keep=0.4), **tiles)
    assert (idx == -1).any() and (idx >= 0).all(axis=-1).any()


@pytest.mark.parametrize("ratio", [1, 2])
def test_candidate_source_builds_the_pool(ratio):
    """The candidate-source layer: pool from the kernel's scores, and that pool fed back."""
    B, T = 2, 64
    R_ = T // ratio
    args = exact_case(10, B=B, T=T, H=4, d=64, R=R_, ratio=ratio)
    _, pool = check_exact(*args, ratio, 8, None, (3, 4), block_t=2, block_r=16, tiles=2)
    check_exact(*args, ratio, 8, pool, None, block_t=2, block_r=16, tiles=2)


@pytest.mark.parametrize("R_", [1, 200])
def test_decode_exact(R_):
    """T = 1 per row at a long cache (several programs along R) and at a single entry; bf16."""
    B = 3
    pos = np.array([[R_ - 1], [R_ // 2], [0]])
    args = exact_case(11, B=B, T=1, H=16, d=256, R=R_, ratio=1, positions=pos, dtype=jnp.bfloat16)
    idx, _ = check_exact(*args, 1, 32, block_r=16, tiles=4)
    assert (idx[0] >= 0).sum() == min(32, R_) and (idx[2] >= 0).sum() == 1


def test_no_entries_yet():
    q, w, _, pos = exact_case(12, B=1, T=3, H=4, d=16, R=4, ratio=1)
    keys = jnp.zeros((1, 0, 16), jnp.float32)
    idx, pool = kernel_topk(q, w, keys, pos, 1, 8, None, (2, 4))
    want_idx, want_pool = index_topk(q, w, keys, pos, 1, 8, None, (2, 4))
    assert idx.shape == want_idx.shape == (1, 3, 0) and pool.shape == want_pool.shape == (1, 3, 0)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-6)], ids=["fp32", "bf16"])
def test_continuous_data_within_fp32_rounding(dtype, tol):
    """d = 128 (d**-0.5 inexact) random data: same -inf pattern, scores within fp32 rounding
    (relative to the row's scale), and the kernel's top-k is a top-k of the reference scores up to
    that rounding (exact index equality needs tie-free data, which the exact cases give)."""
    B, T, H, d, R_, k = 2, 24, 32, 128, 150, 40
    q, w, keys, pos = continuous_case(13, B=B, T=T, H=H, d=d, R=R_, dtype=dtype)
    want = index_scores(q, w, keys, pos, 1)
    got = index_scores_pallas(q, w, keys, pos, 1, interpret=INTERPRET, block_t=2, block_r=32, tiles=2)
    fin = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), fin)
    scale = float(jnp.max(jnp.abs(jnp.where(fin, want, 0))))
    err = float(jnp.max(jnp.abs(jnp.where(fin, got - want, 0))))
    assert err <= tol * scale, (err, scale)
    idx, _ = kernel_topk(q, w, keys, pos, 1, k, block_t=2, block_r=32, tiles=2)
    want_idx, _ = index_topk(q, w, keys, pos, 1, k)
    picked = np.take_along_axis(np.asarray(want), np.maximum(np.asarray(idx), 0), -1)
    best = np.take_along_axis(np.asarray(want), np.maximum(np.asarray(want_idx), 0), -1)
    np.testing.assert_array_equal(np.asarray(idx) >= 0, np.asarray(want_idx) >= 0)
    np.testing.assert_allclose(np.where(np.asarray(idx) >= 0, picked, 0), np.where(np.asarray(idx) >= 0, best, 0),
                               rtol=0, atol=4 * tol * scale)
    assert (np.asarray(idx) == np.asarray(want_idx)).mean() > 0.95


# ---- in the model -----------------------------------------------------------------------------


def test_interpret_kernel_runs_in_the_model():
    """The tiny model's forward with `index_topk` pinned to the kernel equals the reference
    forward (no fake-quant: see test_sparse_attention_kernel's twin test), and the pin reaches
    the op (an impossible pin is an error naming it)."""
    from deepinfer.model import init_params, load_config
    from deepinfer.model.forward import engram_hash_ids, forward_jit
    from deepinfer.pallas_kernels.registry import KernelConfig, KernelUnavailableError

    config = load_config("tiny-v4.1", fake_quant=False)
    params = init_params(config)
    ids = np.array([[0, 15, 300, 72, 9, 4000, 12, 88, 5, 61, 2, 999, 31, 7, 1000, 3, 44]], np.int32)
    hash_ids = jnp.asarray(engram_hash_ids(config, ids), jnp.int32)
    ref = forward_jit(params, config, jnp.asarray(ids), hash_ids, None)
    got = forward_jit(params, config, jnp.asarray(ids), hash_ids, KernelConfig(ops=(("index_topk", KERNEL_BACKEND),)))
    assert float(jnp.max(jnp.abs(got - ref))) <= 1e-4
    if not ON_DEVICE:
        with pytest.raises(KernelUnavailableError, match="'index_topk'.*'gpu_triton'"):
            forward_jit(params, config, jnp.asarray(ids), hash_ids, KernelConfig(ops=(("index_topk", "gpu_triton"),)))


# ---- CUDA lowering ------------------------------------------------------------------------------


@pytest.mark.parametrize("T,R_,with_candidates", [(1, 1000, False), (64, 96, True)], ids=["decode", "prefill-pool"])
def test_lowers_for_cuda_as_triton_custom_call(T, R_, with_candidates):
    q, w, keys, pos = continuous_case(14, B=2, T=T, H=32, d=128, R=R_, dtype=jnp.bfloat16)
    cand = random_pool(15, 2, T, R_) if with_candidates else None
    text = lower_for_cuda(lambda q, w, k, p, c: index_scores_pallas(q, w, k, p, 2, c), q, w, keys, pos, cand)
    assert custom_call_targets(text) == [TRITON_TARGET]
    assert "index_scores" in text  # the kernel name travels in the backend config
    whole = lower_for_cuda(lambda q, w, k, p, c: index_topk_pallas(q, w, k, p, 2, 512, c), q, w, keys, pos, cand)
    assert TRITON_TARGET in custom_call_targets(whole)


def test_top_k_has_no_pallas_triton_lowering():
    """Why top-k runs in jnp after the kernel: on jax 0.12.0.1 Pallas-Triton lowers argmax but
    neither `top_k` nor `sort`. When this starts lowering, fusing the selection becomes possible."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    def call(body, out):
        params = pltr.CompilerParams(num_warps=4, num_stages=1)
        return lambda x: pl.pallas_call(body, out_shape=out, compiler_params=params)(x)

    def argmax(x_ref, o_ref):
        o_ref[...] = jnp.argmax(x_ref[...], axis=-1).astype(jnp.int32)

    def top_k(x_ref, o_ref):
        o_ref[...] = jax.lax.top_k(x_ref[...], 16)[1]

    def sort(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...], axis=-1)

    x = jnp.ones((16, 128), jnp.float32)
    assert custom_call_targets(lower_for_cuda(call(argmax, jax.ShapeDtypeStruct((16,), jnp.int32)), x)) == [
        TRITON_TARGET]
    for body, out, name in ((top_k, jax.ShapeDtypeStruct((16, 16), jnp.int32), "top_k"),
                            (sort, jax.ShapeDtypeStruct((16, 128), jnp.float32), "sort")):
        with pytest.raises(NotImplementedError, match=f"Unimplemented primitive in Pallas Triton lowering: {name}"):
            lower_for_cuda(call(body, out), x)
