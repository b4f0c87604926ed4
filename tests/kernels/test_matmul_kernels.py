"""The Pallas matmul kernels (`fp8_block_matmul`, `moe_experts_mxfp4`) against their jnp
references (Pallas interpret mode on CPU), their CUDA lowering (cross-lowered from this CPU
host), and the model's use of the two registry ops.

Tolerances are error bounds, elementwise, not fitted constants. Kernel and reference both
accumulate in fp32, in different orders (K-tiled dots vs XLA's dot; a token's k expert rows
vs a sum over all E experts), so each fp32 K-term dot may differ by up to `2 K u sum|terms|`
(u = 2^-24, both sides off the exact sum by at most `K u sum|terms|`). A result rounded to bf16
on both sides may differ by one more bf16 ulp at its magnitude on top (two fp32 values that
close can round to neighbouring bf16 values; `bf16_ulp`). The MoE bound carries
these through the SwiGLU to first order (`moe_bound`). Each test also prints the measured
max |diff| (pytest -s), and a negative control shows the bound catches a wrong block scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer.ops import quant
from deepinfer.model.params import FP4, FP8, QuantWeight
from deepinfer.pallas_kernels import matmul as mm
from deepinfer.pallas_kernels import registry
from deepinfer.pallas_kernels.lowering import TRITON_TARGET, custom_call_targets, lower_for_cuda
from deepinfer.pallas_kernels.reference import matmul as ref
from deepinfer.pallas_kernels.registry import GPU_TRITON, INTERPRET, REFERENCE, KernelConfig, PlatformInfo
from tests.kernels.mode import INTERPRET as INTERPRET_MODE
from tests.kernels.mode import KERNEL_BACKEND, ON_DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

U = 2.0 ** -24  # fp32 unit roundoff
BF16_ROUND = 2.0 ** -8  # one rounding to bf16 moves a value by at most this, relatively (half an ulp)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _report(name: str, got, want, tol) -> None:
    diff = np.abs(_f64(got) - _f64(want))
    print(f" {name}: max |diff| {diff.max():.3g} (max |ref| {np.abs(_f64(want)).max():.3g}, "
          f"min tol {np.min(tol):.3g})", end="")
    bad = diff > tol
    assert not bad.any(), (f"{int(bad.sum())} elements over the bound; worst {diff[bad].max():.3g} "
                           f"at {np.argwhere(bad)[0]}")


# ---- FP8 block matmul ------------------------------------------------------------------------


def fp8_weight(seed: int, N: int, K: int, block, scale_bytes=(113, 121), codes=None) -> QuantWeight:
    """Random e4m3 bytes (every finite code: zeros, subnormals, up to +-448; no NaN) and random
    UE8M0 bytes in `scale_bytes` (2^(b - 127); the default keeps weights O(1) like the model)."""
    rng = np.random.default_rng(seed)
    if codes is None:
        q = rng.integers(0, 256, (N, K), dtype=np.uint8)
        q = np.where((q & 0x7F) == 0x7F, q - 1, q).astype(np.uint8)  # NaN -> +-448
    else:
        q = rng.choice(np.asarray(codes, np.uint8), (N, K))
    bn, bk = block
    s = rng.integers(scale_bytes[0], scale_bytes[1] + 1, (-(-N // bn), -(-K // bk)), dtype=np.uint8)
    return QuantWeight(jnp.asarray(q.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu)),
                       kind=FP8, block=tuple(block))


def activations(seed: int, shape, dtype, away_from_zero: bool = False) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if away_from_zero:  # |x| in [1, 2): products with the tiniest weights stay fp32/bf16 normals
        x = np.sign(x) * (1.0 + rng.random(shape))
    return jnp.asarray(x, dtype)


def bf16_ulp(magnitude) -> np.ndarray:
    """One bf16 ulp at `magnitude` >= 0: 2^(floor(log2 m) - 7), and 2^-133 (the subnormal
    spacing) below the smallest normal 2^-126."""
    return 2.0 ** (np.floor(np.log2(np.maximum(magnitude, 2.0 ** -126))) - 7)


def fp32_dot_bound(x, W: np.ndarray) -> np.ndarray:
    """`2 K u sum|terms|` of `x @ W^T` (module docstring), plus `K 2^-126` for fp32 subnormal
    partial sums a backend may flush to zero."""
    K = W.shape[1]
    return 2 * K * U * (np.abs(_f64(x)) @ np.abs(W).T) + K * 2.0 ** -126


def fp8_bound(x, w: QuantWeight, want) -> np.ndarray:
    """Elementwise bound on |kernel - reference| (module docstring): the fp32 accumulation bound,
    and for bf16 outputs one bf16 ulp at the largest magnitude either fp32 result can have (the
    reference's |want| is itself within half an ulp of its fp32 value)."""
    W = quant.dequantize_fp8_blocks(np.asarray(w.q), np.asarray(w.scale), block=w.block, xp=np).astype(np.float64)
    tol = fp32_dot_bound(x, W)
    if x.dtype == jnp.bfloat16:
        tol = tol + bf16_ulp((np.abs(_f64(want)) + tol) * (1 + 2.0 ** -7))
    return tol


def check_fp8(x, w: QuantWeight, **kw):
    got = mm.fp8_block_matmul_pallas(x, w.q, w.scale, w.block, interpret=INTERPRET_MODE, **kw)
    want = ref.fp8_block_matmul(x, w)
    assert got.shape == want.shape and got.dtype == want.dtype == x.dtype
    _report("fp8", got, want, fp8_bound(x, w, want))
    return got, want


FP8_CASES = {  # name: (x shape, N, block)
    "decode-128x128": ((1, 256), 384, (128, 128)),  # one scale block per K step
    "ragged-M-128x128": ((70, 384), 256, (128, 128)),  # 64-row tiles: the second one is partial
    "tiny-32x32": ((5, 160), 96, (32, 32)),  # four blocks per 128-wide K step; K padded to 256
    "edge-blocks-16x32": ((3, 50), 40, (16, 32)),  # N, K not multiples of the block or the tiles
    "row-scales-1x32": ((4, 64), 48, (1, 32)),  # the FP8_ROWS layout: one scale per row and 32
    "block-not-pow2-16x48": ((3, 96), 32, (16, 48)),  # K steps of 16 inside each 48-wide block
    "batched-32x32": ((2, 3, 128), 64, (32, 32)),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_matches_reference(case, dtype):
    xshape, N, block = FP8_CASES[case]
    check_fp8(activations(1, xshape, DTYPES[dtype]), fp8_weight(2, N, xshape[-1], block))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_largest_magnitudes(dtype):
    """Every weight +-448 (the largest e4m3) times 2^20 scales."""
    w = fp8_weight(3, 128, 256, (128, 128), scale_bytes=(147, 147), codes=(0x7E, 0xFE))
    got, _ = check_fp8(activations(4, (20, 256), DTYPES[dtype]), w)
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32)))) > 1e9


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_tiny_scales(dtype):
    """Scales 2^-117 .. 2^-110 with every e4m3 code, down to the subnormal 2^-9: the smallest
    products are 2^-126, still normal in fp32 and bf16 (|x| >= 1)."""
    w = fp8_weight(5, 64, 96, (32, 32), scale_bytes=(10, 17))
    got, _ = check_fp8(activations(6, (9, 96), DTYPES[dtype], away_from_zero=True), w)
    assert 0 < float(jnp.max(jnp.abs(got.astype(jnp.float32)))) < 1e-25


def test_fp8_byte_decode_equals_the_float8_conversion():
    """The sm_80 path decodes e4m3 bytes with integer ops: all 256 bytes equal the float8
    conversion bit for bit (NaNs at 0x7F/0xFF), and the kernel results are identical."""
    b = jnp.arange(256, dtype=jnp.uint8)
    native = np.asarray(jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32))
    bits = np.asarray(mm._e4m3_bits_to_f32(b))
    np.testing.assert_array_equal(native.view(np.uint32)[~np.isnan(native)], bits.view(np.uint32)[~np.isnan(native)])
    assert np.array_equal(np.isnan(native), np.isnan(bits)) and np.isnan(native).sum() == 2
    x, w = activations(7, (5, 160), jnp.float32), fp8_weight(8, 96, 160, (32, 32))
    a = mm.fp8_block_matmul_pallas(x, w.q, w.scale, w.block, interpret=INTERPRET_MODE)
    b = mm.fp8_block_matmul_pallas(x, w.q, w.scale, w.block, interpret=INTERPRET_MODE, decode_bits=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_bound_catches_a_wrong_block_scale():
    """Negative control: the kernel on a weight with one block scale doubled is outside the
    bound of the true weight."""
    x, w = activations(9, (6, 256), jnp.float32), fp8_weight(10, 256, 256, (128, 128))
    s = np.asarray(w.scale).view(np.uint8).copy()
    s[1, 0] += 1
    bad = QuantWeight(w.q, jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu)), kind=FP8, block=w.block)
    got = mm.fp8_block_matmul_pallas(x, bad.q, bad.scale, bad.block, interpret=INTERPRET_MODE)
    want = ref.fp8_block_matmul(x, w)
    over = np.abs(_f64(got) - _f64(want)) > fp8_bound(x, w, want)
    # the outputs of that block's rows (N 128..255), and only those (a few may cancel by chance)
    assert over[:, 128:256].mean() > 0.9 and not over[:, :128].any()


def test_fp8_kernel_rejects_a_k_block_it_cannot_tile():
    w = fp8_weight(11, 32, 48, (32, 24))
    with pytest.raises(ValueError, match="multiple of 16"):
        mm.fp8_block_matmul_pallas(jnp.ones((2, 48)), w.q, w.scale, w.block, interpret=True)


def test_linear_on_fp8_weights_matches_float64():
    """The model's `linear` on an FP8 QuantWeight goes through the registry (its platform default,
    and the kernel pinned): both equal the float64 product with the dequantized weight within
    the bound (jitted, as the model runs it)."""
    from deepinfer.model.layers import linear

    w = fp8_weight(12, 64, 128, (32, 32))
    W = quant.dequantize_fp8_blocks(np.asarray(w.q), np.asarray(w.scale), block=w.block, xp=np).astype(np.float64)
    for dtype in DTYPES.values():
        x = activations(13, (2, 5, 128), dtype)
        exact = _f64(x) @ W.T
        for kernels in (None, KernelConfig(ops=(("fp8_block_matmul", KERNEL_BACKEND),))):
            got = jax.jit(functools.partial(linear, kernels=kernels))(x, w)
            assert got.dtype == dtype and got.shape == (2, 5, 64)
            _report("linear", got, exact, fp8_bound(x.reshape(-1, 128), w, exact.reshape(-1, 64)).reshape(exact.shape))


# ---- MXFP4 routed experts --------------------------------------------------------------------


def fp4_weight(seed: int, E: int, N: int, K: int, scale_bytes=(124, 127), codes=None) -> QuantWeight:
    """Random packed e2m1 bytes (every byte is two valid codes, +-0 to +-6) and UE8M0 scales."""
    rng = np.random.default_rng(seed)
    if codes is None:
        q = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    else:
        q = rng.choice(np.asarray(codes, np.uint8), (E, N, K // 2))
    s = rng.integers(scale_bytes[0], scale_bytes[1] + 1, (E, N, K // 32), dtype=np.uint8)
    return QuantWeight(jnp.asarray(q.view(np.int8)), jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu)),
                       kind=FP4, block=(1, 32))


def experts(seed: int, E: int, D: int, F: int, **kw) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
    kw13 = {k[:-3]: v for k, v in kw.items() if k.endswith("_13")}
    kw2 = {k[:-2]: v for k, v in kw.items() if k.endswith("_2")}
    return (fp4_weight(seed, E, F, D, **kw13), fp4_weight(seed + 1, E, F, D, **kw13),
            fp4_weight(seed + 2, E, D, F, **kw2))


def routing(seed: int, N: int, k: int, E: int, allowed=None, first=None, drop: float = 0.0):
    """Distinct expert ids per token from `allowed` (default all), column 0 forced to `first`
    if given, a fraction `drop` of ids set to -1 (no expert, as expert parallelism passes);
    weights in (0, 2]."""
    rng = np.random.default_rng(seed)
    pool = np.arange(E) if allowed is None else np.asarray(allowed)
    ids = np.stack([rng.permutation(pool)[:k] for _ in range(N)])
    if first is not None:
        for row in ids:
            j = np.nonzero(row == first)[0]
            row[j[0] if len(j) else 0], row[0] = row[0], first
    ids = np.where(rng.random(ids.shape) < drop, -1, ids)
    return jnp.asarray(2 * rng.random((N, k)) + 1e-3, jnp.float32), jnp.asarray(ids, jnp.int32)


def _silu(g):
    return g / (1.0 + np.exp(-np.clip(g, -700, 700)))


def _moe_pairs(x, weights, ids, w1, w3, w2, limit: float, dtype):
    """Per routing column j: (valid pairs [N], float64 expert outputs y [N, D], their error
    bound dy [N, D]); see `moe_bound`."""
    W1, W3, W2 = (quant.dequantize_mxfp4(np.asarray(w.q), np.asarray(w.scale), 32, xp=np).astype(np.float64)
                  for w in (w1, w3, w2))
    E, F, D = W1.shape
    X = _f64(x)
    r = BF16_ROUND if dtype == jnp.bfloat16 else 0.0
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    for j in range(ids.shape[1]):
        ok = (ids[:, j] >= 0) & (ids[:, j] < E)
        e = np.where(ok, ids[:, j], 0)
        wt = np.where(ok, weights[:, j], 0.0)[:, None]
        g = np.einsum("nd,nfd->nf", X, W1[e])
        u = np.einsum("nd,nfd->nf", X, W3[e])
        dg = 2 * D * U * np.einsum("nd,nfd->nf", np.abs(X), np.abs(W1[e])) + r * np.abs(g)
        du = 2 * D * U * np.einsum("nd,nfd->nf", np.abs(X), np.abs(W3[e])) + r * np.abs(u)
        if limit > 0:
            u, g = np.clip(u, -limit, limit), np.minimum(g, limit)
        h = _silu(g) * u * wt
        dh = np.abs(wt) * (1.1 * np.abs(u) * dg + np.abs(_silu(g)) * du) + (r + 16 * U) * np.abs(h)
        y = np.einsum("nf,ndf->nd", h, W2[e])
        dy = (2 * F * U * np.einsum("nf,ndf->nd", np.abs(h), np.abs(W2[e])) + np.einsum("nf,ndf->nd", dh, np.abs(W2[e]))
              + r * np.abs(y))
        yield ok, y, dy


def moe_bound(x, weights, ids, w1, w3, w2, limit: float, dtype) -> np.ndarray:
    """Elementwise bound on |kernel - reference| for the MoE (module docstring), first order,
    times 2 for the second-order terms: per pair, gate/up (D-term dots) and the per-pair
    output (F-term dots) may differ by `2 K u sum|terms|`, each bf16 rounding (gate, up, h, the
    per-pair output) by `2^-8 |value|`; the clamps are 1-Lipschitz and |silu'| < 1.1; `16 u |h|`
    covers exp/sigmoid differences between backends; the k-row fp32 sum adds `k u sum|rows|`."""
    total = np.zeros(np.shape(x))
    k = np.shape(ids)[1]
    for ok, y, dy in _moe_pairs(x, weights, ids, w1, w3, w2, limit, dtype):
        total += np.where(ok[:, None], 2 * dy + k * U * np.abs(y), 0.0)
    return total + 1e-30


def moe_f64(x, weights, ids, w1, w3, w2, limit: float) -> np.ndarray:
    """The routed-expert sum in float64 (the value `moe_bound` bounds around)."""
    return sum(np.where(ok[:, None], y, 0.0) for ok, y, _ in _moe_pairs(x, weights, ids, w1, w3, w2, limit, None))


def run_moe(x, weights, ids, w1, w3, w2, limit, **kw):
    return mm.moe_experts_mxfp4_pallas(x, weights, ids, w1.q, w1.scale, w3.q, w3.scale, w2.q, w2.scale, limit,
                                       interpret=INTERPRET_MODE, **kw)


def check_moe(x, weights, ids, ws, limit=10.0, **kw):
    got = run_moe(x, weights, ids, *ws, limit, **kw)
    want = ref.moe_experts_mxfp4(x, weights, ids, *ws, limit)
    assert got.shape == want.shape == x.shape and got.dtype == want.dtype == jnp.float32
    _report("moe", got, want, moe_bound(x, weights, ids, *ws, limit, x.dtype))
    return got, want


E, D, F = 8, 128, 64  # the tiny presets' expert shapes
MOE_CASES = {  # name: routing kwargs, kernel kwargs
    "random-13x2": (dict(N=13, k=2), {}),
    "experts-without-tokens": (dict(N=13, k=2, allowed=(1, 4, 6)), {}),
    "one-expert-has-every-token": (dict(N=70, k=2, first=5), {}),  # 70 rows on expert 5: 5 tiles of 16
    "one-expert-64-row-tiles": (dict(N=70, k=2, first=5), dict(block_m=64)),  # ragged last tile
    "decode-1-token": (dict(N=1, k=2), {}),
    "dropped-pairs": (dict(N=17, k=3, drop=0.3), {}),  # ids -1 contribute nothing
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_matches_reference(case, dtype):
    rkw, kkw = MOE_CASES[case]
    weights, ids = routing(20, E=E, **rkw)
    x = activations(21, (rkw["N"], D), DTYPES[dtype])
    check_moe(x, weights, ids, experts(22, E, D, F), **kkw)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_moe_dims_not_powers_of_two_and_no_clamp(dtype):
    """D = 96, F = 160 (32-wide tiles along both) and swiglu_limit 0 (no clamps)."""
    weights, ids = routing(23, 11, 2, 4)
    x = activations(24, (11, 96), DTYPES[dtype])
    check_moe(x, weights, ids, experts(25, 4, 96, 160), limit=0.0)


@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_moe_largest_magnitudes(dtype, limit):
    """Every code +-6 (the largest e2m1) times 2^20 scales: gate/up reach ~1e9 (clamped at the
    limit, or not at all), outputs ~1e10 (with clamps) to ~1e23 (without)."""
    codes = (0x77, 0xFF, 0x7F, 0xF7)
    ws = experts(26, E, D, F, scale_bytes_13=(147, 147), codes_13=codes, scale_bytes_2=(147, 147), codes_2=codes)
    weights, ids = routing(27, 9, 2, E)
    got, _ = check_moe(activations(28, (9, D), DTYPES[dtype]), weights, ids, ws, limit=limit)
    assert float(jnp.max(jnp.abs(got))) > (1e9 if limit else 1e20)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_moe_tiny_scales(dtype):
    """w1/w3 scales 2^-47 .. 2^-40 and w2 scales 2^60 .. 2^64: gate/up ~1e-11, outputs O(1e-3);
    every intermediate stays a normal float in fp32 and bf16."""
    ws = experts(29, E, D, F, scale_bytes_13=(80, 87), scale_bytes_2=(187, 191))
    weights, ids = routing(30, 10, 2, E)
    got, _ = check_moe(activations(31, (10, D), DTYPES[dtype], away_from_zero=True), weights, ids, ws)
    assert 1e-8 < float(jnp.max(jnp.abs(got))) < 1e3


def test_moe_bound_catches_a_wrong_block_scale():
    """Negative control: one w2 scale of a routed expert doubled (a 1 x 32 block) puts that
    expert's tokens outside the bound of the true weights."""
    ws = experts(32, E, D, F)
    weights, ids = routing(33, 13, 2, E, first=3)
    x = activations(34, (13, D), jnp.float32)
    s = np.asarray(ws[2].scale).view(np.uint8).copy()
    s[3, 7, 1] += 1
    bad = QuantWeight(ws[2].q, jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu)), kind=FP4, block=(1, 32))
    got = run_moe(x, weights, ids, ws[0], ws[1], bad, 10.0)
    want = ref.moe_experts_mxfp4(x, weights, ids, *ws, 10.0)
    over = np.abs(_f64(got) - _f64(want)) > moe_bound(x, weights, ids, *ws, 10.0, jnp.float32)
    # output column 7 of every token (all routed to expert 3), and only that column
    assert over[:, 7].mean() > 0.9 and not np.delete(over, 7, axis=1).any()


def test_moe_schedule():
    """The grouped layout: every valid pair has its own row, in a tile of its expert, reading
    its token with its weight; groups start on tile boundaries; padding rows read token N with
    weight 0; tiles past the end have expert E; dropped pairs point past the rows."""
    N, k, tm = 23, 3, 16
    weights, ids = routing(35, N, k, E, allowed=(0, 2, 3, 7), drop=0.1)
    row_token, row_weight, tile_expert, pair_row = (np.asarray(a) for a in mm.moe_schedule(ids, weights, E, tm))
    ids, weights = np.asarray(ids).reshape(-1), np.asarray(weights).reshape(-1)
    R = row_token.shape[0]
    assert R == tile_expert.shape[0] * tm
    valid = ids >= 0
    assert np.all(pair_row[~valid] == R)
    rows = pair_row[valid]
    assert len(set(rows.tolist())) == len(rows) and rows.max() < R
    np.testing.assert_array_equal(row_token[rows], (np.arange(N * k) // k)[valid])
    np.testing.assert_array_equal(row_weight[rows], weights[valid])
    np.testing.assert_array_equal(tile_expert[rows // tm], ids[valid])
    pad = np.setdiff1d(np.arange(R), rows)
    assert np.all(row_token[pad] == N) and np.all(row_weight[pad] == 0)
    used = tile_expert < E
    assert used.sum() == sum(-(-np.sum(ids == e) // tm) for e in range(E))
    assert np.all(np.diff(tile_expert) >= 0) and not used[used.sum():].any()  # sorted, unused at the end


def test_routed_experts_match_float64():
    """`model.moe.routed_experts` on MXFP4 experts goes through the `moe_experts_mxfp4` op (its
    platform default, and the kernel pinned): both equal the float64 expert sum within the bound."""
    from deepinfer.model.moe import routed_experts

    ws = experts(36, E, D, F)
    stack = dict(zip(("w1", "w3", "w2"), ws))
    weights, ids = routing(37, 13, 2, E)
    for dtype in DTYPES.values():
        x = activations(38, (13, D), dtype)
        exact = moe_f64(x, weights, ids, *ws, 10.0)
        for kernels in (None, KernelConfig(ops=(("moe_experts_mxfp4", KERNEL_BACKEND),))):
            got = jax.jit(functools.partial(routed_experts, limit=10.0, kernels=kernels))(x, weights, ids, stack)
            _report("routed_experts", got, exact, moe_bound(x, weights, ids, *ws, 10.0, dtype))


# ---- registry and CUDA lowering --------------------------------------------------------------


def test_registered_backends():
    for op in ("fp8_block_matmul", "moe_experts_mxfp4"):
        assert set(registry.available(op)) == {REFERENCE, GPU_TRITON, INTERPRET}
        assert registry.resolve(op, None, PlatformInfo("gpu", "cuda", "NVIDIA H200", 90))[0].backend == GPU_TRITON
        assert registry.resolve(op)[0].backend == (GPU_TRITON if ON_DEVICE else REFERENCE)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_lowers_for_cuda_as_triton_custom_call(dtype):
    w = fp8_weight(40, 256, 384, (128, 128))
    x = activations(41, (7, 384), DTYPES[dtype])
    text = lower_for_cuda(lambda x, q, s: mm.fp8_block_matmul_pallas(x, q, s, w.block), x, w.q, w.scale)
    assert custom_call_targets(text) == [TRITON_TARGET]
    assert "fp8_block_matmul" in text


@pytest.mark.skipif(ON_DEVICE, reason="with a GPU present, lowering reads the real device's compute capability")
def test_fp8_below_sm89_decodes_bytes(monkeypatch):
    """Triton converts float8_e4m3fn only on sm_89+: lowering the float8 path for an A100 fails,
    and the registry's kernel, seeing an sm_80 device, takes the byte decode, which lowers."""
    w = fp8_weight(42, 128, 256, (128, 128))
    x = activations(43, (4, 256), jnp.bfloat16)
    a100 = "NVIDIA A100-SXM4-80GB"
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        lower_for_cuda(lambda x, q, s: mm.fp8_block_matmul_pallas(x, q, s, w.block), x, w.q, w.scale, device_kind=a100)
    monkeypatch.setattr(mm, "platform_info", lambda: PlatformInfo("gpu", "cuda", a100, 80))
    text = lower_for_cuda(mm.fp8_block_matmul_triton, x, w, device_kind=a100)
    assert custom_call_targets(text) == [TRITON_TARGET]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_moe_lowers_for_cuda_as_triton_custom_calls(dtype):
    ws = experts(44, E, D, F)
    weights, ids = routing(45, 13, 2, E)
    x = activations(46, (13, D), DTYPES[dtype])
    text = lower_for_cuda(lambda *a: mm.moe_experts_mxfp4_triton(*a, 10.0), x, weights, ids, *ws)
    assert custom_call_targets(text) == [TRITON_TARGET]
    assert "moe_mxfp4_gate_up" in text and "moe_mxfp4_down" in text  # two kernels


@pytest.mark.skipif(not ON_DEVICE, reason="needs the CUDA GPU")
def test_registry_picks_the_kernels_on_this_gpu():
    rows = {op: impl for op, impl, _ in registry.describe()}
    assert rows["fp8_block_matmul"] == GPU_TRITON and rows["moe_experts_mxfp4"] == GPU_TRITON
