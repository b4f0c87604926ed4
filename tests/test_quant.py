"""Tests of deepinfer.ops.quant against hand-computed values.

Grid facts used below (worked out by hand):
* e2m1 magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
* e4m3 (fn): 3 mantissa bits, so in [1, 2) the step is 1/8, in [256, 448] the step is 32; the
  largest finite value is 448 and the smallest subnormal 2^-9.
* UE8M0 byte b encodes 2^(b - 127).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer.ops import quant as Q

def bits(a) -> np.ndarray:
    """float32 bit pattern, for bit-exact comparisons."""
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def e8m0(*exponents) -> np.ndarray:
    return np.array([e + 127 for e in exponents], np.uint8).view(ml_dtypes.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------
# e2m1 table and nibble order
# ------------------------------------------------------------------------------------------------


def test_e2m1_table():
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert Q.E2M1_VALUES.dtype == np.float32
    assert Q.E2M1_VALUES.tolist() == expected
    # Same values as ml_dtypes' float4_e2m1fn decoding of the 16 codes (which gives -0.0 for 8).
    ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert ml.tolist() == expected
    assert bits(Q.E2M1_VALUES[8]) == 0  # +0.0, like the reference table


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_nibble_order_low_first(xp):
    packed = xp.asarray(np.array([[0x21, 0xF7]], np.uint8).view(np.int8))
    one = xp.asarray(e8m0(0))  # scale 1
    out = np.asarray(Q.dequantize_mxfp4(packed, one.reshape(1, 1), block=4, xp=xp))
    assert out.tolist() == [[0.5, 1.0, 6.0, -6.0]]
    assert np.asarray(Q.unpack_nibbles(packed, xp)).tolist() == [[1, 2, 7, 15]]


def test_pack_nibbles_even_index_low():
    codes = np.array([1, 2, 7, 15, 0, 8], np.uint8)
    assert Q.pack_nibbles(codes, np).tolist() == [0x21, 0xF7, 0x80]
    assert np.asarray(Q.pack_nibbles(jnp.asarray(codes), jnp)).tolist() == [0x21, 0xF7, 0x80]


def test_jax_native_float4_unpack_agrees_with_lut():
    # environment.md 11: bitcast uint8[N] -> float4_e2m1fn gives [N, 2], low nibble first.
    u = np.arange(256, dtype=np.uint8)
    native = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(u), jnp.float4_e2m1fn)).astype(np.float32)
    lut = Q.dequantize_mxfp4(u.reshape(1, 256), e8m0(*[0] * 16).reshape(1, 16), block=32)
    np.testing.assert_array_equal(native.reshape(1, 512), lut)  # == ignores the sign of zero


# ------------------------------------------------------------------------------------------------
# scales
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, byte",
    [
        (448.0 * 3, 129),  # 1344 / 448 = 3 -> 2^2
        (448.0, 127),  # exactly 1 -> 2^0
        (449.0, 128),  # just above 1 -> 2^1
        (448.0 * 4, 129),  # exactly 4 -> 2^2
        (224.0, 126),  # 0.5 -> 2^-1
        (0.0, 105),  # clamped to 1e-4: 1e-4 / 448 = 2.23e-7 = 2^-22.09, ceil -> 2^-22
    ],
)
def test_fp8_ue8m0_scale(amax, byte):
    w = np.zeros((32, 32), np.float32)
    w[5, 7] = -amax
    q, s = Q.quantize_fp8_blocks(w)
    assert s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (1, 1)
    assert s.view(np.uint8)[0, 0] == byte


def test_pow2_ceil_exponent_and_exp2_int():
    t = np.array([1.0, 1.5, 2.0, 3.0, 0.75, 2.0**-126, 2.0**-130, 2.0**127], np.float32)
    expected = [0, 1, 1, 2, 0, -126, -126, 127]  # subnormals give -126 (reference bit trick)
    assert Q.pow2_ceil_exponent(t, np).tolist() == expected
    assert np.asarray(Q.pow2_ceil_exponent(jnp.asarray(t), jnp)).tolist() == expected
    k = np.array([-149, -127, -126, -1, 0, 1, 127, 128, -150], np.int32)
    want = np.array([2.0**-149, 2.0**-127, 2.0**-126, 0.5, 1, 2, 2.0**127, np.inf, 0], np.float32)
    np.testing.assert_array_equal(bits(Q.exp2_int(k, np)), bits(want))
    np.testing.assert_array_equal(bits(Q.exp2_int(jnp.asarray(k), jnp)), bits(want))


def test_e8m0_decode():
    raw = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    for scale in (raw, raw.view(ml_dtypes.float8_e8m0fnu)):
        out = Q.e8m0_to_float32(scale, np)
        assert out[:6].tolist() == want and np.isnan(out[6])
        outj = np.asarray(Q.e8m0_to_float32(jnp.asarray(scale), jnp))
        np.testing.assert_array_equal(bits(outj), bits(out))


# ------------------------------------------------------------------------------------------------
# FP8 fake-quant (e4m3 rounding)
# ------------------------------------------------------------------------------------------------


def test_fake_quant_fp8_e4m3_rounding_scale_one():
    # amax 448 -> scale 1, so the block shows plain e4m3 rounding.
    x = np.zeros(32, np.float32)
    x[:10] = [448.0, 1.0625, 1.1875, 300.0, -1.0625, 2.0**-10, 3 * 2.0**-10, 0.3, 17.0, 100.0]
    want = np.zeros(32, np.float32)
    # 1.0625: tie between 1.0 (even) and 1.125 -> 1.0; 1.1875: tie between 1.125 (odd) and 1.25
    # -> 1.25; 300: step 32 -> 288; 2^-10: tie between 0 and 2^-9 -> 0; 3*2^-10: tie between 2^-9
    # (odd) and 2^-8 -> 2^-8; 0.3 in [0.25, 0.5), step 1/32: 0.3 -> 0.3125 (0.28125 is farther);
    # 17: step 2 in [16, 32) -> tie between 16 (even) and 18 -> 16; 100: step 8 -> 96 or 104, tie?
    # 100 - 96 = 4 = half step: 96 = 1.5*64 (mantissa 100, even) -> 96.
    want[:10] = [448.0, 1.0, 1.25, 288.0, -1.0, 0.0, 2.0**-8, 0.3125, 16.0, 96.0]
    out = np.asarray(Q.fake_quant_fp8(jnp.asarray(x)))
    np.testing.assert_array_equal(out, want)


def test_fake_quant_fp8_scaled_blocks():
    x = np.zeros((2, 64), np.float32)
    x[0, 0] = 448.0 * 3  # block scale 4: 1344/4 = 336, tie between 320 (even) and 352 -> 320
    x[0, 1] = 5.0  # 5/4 = 1.25 exact
    x[0, 32] = 460.0  # block scale 2: 230 -> 224 (step 16) -> 448
    x[0, 33] = -1.0  # -0.5 exact
    # amax clamped to 1e-4: scale 2^-22; 1e-5 * 2^22 = 41.94, step 4 in [32, 64) -> 40
    x[1, 0] = 1e-5
    out = np.asarray(Q.fake_quant_fp8(jnp.asarray(x)))
    want = np.zeros((2, 64), np.float32)
    want[0, :2] = [1280.0, 5.0]
    want[0, 32:34] = [448.0, -1.0]
    want[1, 0] = 40 * 2.0**-22
    np.testing.assert_array_equal(out, want)


def test_fake_quant_fp8_dtype_jit_and_passthrough():
    x = jnp.asarray(np.linspace(-3, 3, 4 * 64, dtype=np.float32).reshape(4, 64)).astype(jnp.bfloat16)
    out = jax.jit(Q.fake_quant_fp8, static_argnums=1)(x, 32)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    eager = Q.fake_quant_fp8(x, 32)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(eager, np.float32))
    odd = jnp.arange(48, dtype=jnp.float32) * 0.37
    assert Q.fake_quant_fp8(odd, 32) is odd  # 48 % 32 != 0: unchanged, as in the reference


def test_fake_quant_fp8_random_against_independent_reference():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 128)) * np.exp2(rng.integers(-12, 12, (64, 1)))).astype(np.float32)
    blocks = x.reshape(64, 4, 32).astype(np.float64)
    amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-4)
    scale = np.exp2(np.ceil(np.log2(amax / 448.0)))  # exact for these amax values
    want = (blocks / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    out = np.asarray(Q.fake_quant_fp8(jnp.asarray(x)))
    np.testing.assert_array_equal(out, want.reshape(64, 128).astype(np.float32))


# ------------------------------------------------------------------------------------------------
# FP4 fake-quant
# ------------------------------------------------------------------------------------------------

# A block of 16 with amax 6 (e4m3 scale = e4m3(6/6) = 1): every tie case and a few plain values.
FP4_BLOCK_IN = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -3.5, 0.3, 2.9, -5.5, 0.1]
FP4_BLOCK_OUT = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -2.0, -4.0, 0.5, 3.0, -6.0, 0.0]
FP4_BLOCK_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 12, 14, 1, 5, 15, 0]


def test_e2m1_codes_tie_rule():
    q = np.array(FP4_BLOCK_IN, np.float32)
    assert Q.e2m1_codes(q, np).tolist() == FP4_BLOCK_CODES
    assert np.asarray(Q.e2m1_codes(jnp.asarray(q), jnp)).tolist() == FP4_BLOCK_CODES
    # One ulp either side of a tie decides by distance.
    up = np.nextafter(np.float32(0.25), np.float32(1))
    down = np.nextafter(np.float32(0.75), np.float32(0))
    assert Q.e2m1_codes(np.array([up, down], np.float32), np).tolist() == [1, 1]


def test_fake_quant_fp4_e4m3_scale_hand_block():
    x = jnp.asarray(np.array(FP4_BLOCK_IN, np.float32))
    out = np.asarray(Q.fake_quant_fp4(x, 16, e4m3_scales=True))
    np.testing.assert_array_equal(out, FP4_BLOCK_OUT)
    # Scaled by 1.5 (amax 9 -> e4m3(1.5) = 1.5, exact): same codes, values times 1.5.
    out = np.asarray(Q.fake_quant_fp4(x * 1.5, 16, e4m3_scales=True))
    np.testing.assert_array_equal(out, np.array(FP4_BLOCK_OUT, np.float32) * 1.5)


def test_fake_quant_fp4_e4m3_scale_rounding_and_floor():
    # amax 7: 7/6 = 1.1667 -> e4m3 1.125 (1.25 is farther); 7/1.125 = 6.22 -> clamp 6 -> 6.75.
    x = np.zeros(16, np.float32)
    x[0], x[1] = 7.0, 1.125 * 2.6  # 2.6 -> 3 (nearest) -> 3.375
    out = np.asarray(Q.fake_quant_fp4(jnp.asarray(x), 16, True))
    assert out[0] == 6.75 and out[1] == 3.375 and not out[2:].any()
    # Tiny block: amax floored at 6*2^-9, scale 2^-9; 0.001 * 2^9 = 0.512 -> 0.5 -> 2^-10.
    tiny = jnp.full((16,), 0.001, jnp.float32)
    np.testing.assert_array_equal(np.asarray(Q.fake_quant_fp4(tiny, 16, True)), np.full(16, 2.0**-10))
    zeros = jnp.zeros((2, 16), jnp.float32)
    np.testing.assert_array_equal(np.asarray(Q.fake_quant_fp4(zeros, 16, True)), 0.0)


def test_fake_quant_fp4_ue8m0_scale():
    # amax 7: 7/6 -> 2^ceil(log2 1.1667) = 2. 7/2 = 3.5 ties UP -> 4 -> 8; 5/2 = 2.5 ties DOWN
    # -> 2 -> 4; 2.5/2 = 1.25 ties DOWN -> 1 -> 2; 1.5/2 = 0.75 ties UP -> 1 -> 2; -0.4/2 = -0.2
    # -> -0 -> 0.
    x = np.zeros(32, np.float32)
    x[:5] = [7.0, 5.0, 2.5, 1.5, -0.4]
    out = np.asarray(Q.fake_quant_fp4(jnp.asarray(x), 32, e4m3_scales=False))
    want = np.zeros(32, np.float32)
    want[:5] = [8.0, 4.0, 2.0, 2.0, 0.0]
    np.testing.assert_array_equal(out, want)
    # amax exactly 6 * 2^-3: scale exactly 2^-3 (no rounding up), grid values are kept.
    y = np.array([0.75, 0.0625, -0.5, 0.1875] + [0.0] * 28, np.float32)
    np.testing.assert_array_equal(np.asarray(Q.fake_quant_fp4(jnp.asarray(y), 32, False)), y)


def test_fake_quant_fp4_dtype_and_passthrough():
    x = jnp.asarray(np.array(FP4_BLOCK_IN * 2, np.float32)).astype(jnp.bfloat16)
    out = jax.jit(Q.fake_quant_fp4, static_argnums=(1, 2))(x, 16, True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), FP4_BLOCK_OUT * 2)
    odd = jnp.arange(24, dtype=jnp.float32)
    assert Q.fake_quant_fp4(odd, 16, True) is odd
    assert Q.fake_quant_fp4(odd, 32, False) is odd


def _fp4_reference(x: np.ndarray, block: int, e4m3_scales: bool) -> np.ndarray:
    """Independent brute-force reference: nearest e2m1 magnitude by distance, ties to the even
    code (the lower neighbour at 0.25/1.25/2.5/5, the upper at 0.75/1.75/3.5)."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(b).max(-1, keepdims=True)
    if e4m3_scales:
        s = (np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6)).astype(ml_dtypes.float8_e4m3fn)
        s = s.astype(np.float32)
    else:
        s = np.exp2(np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126).astype(np.float64) / 6))).astype(np.float32)
    q = np.clip(b / s, -6, 6).astype(np.float64)
    d = np.abs(np.abs(q)[..., None] - grid)
    best = d.min(-1, keepdims=True)
    idx = np.where(d == best, np.arange(8), 99)
    first, last = idx.min(-1), np.where(d == best, np.arange(8), -1).max(-1)
    pick = np.where(first % 2 == 0, first, last)  # on a tie the two codes differ by one
    mag = grid[pick] * np.where(np.signbit(q), -1, 1)
    return (mag * s).astype(np.float32).reshape(x.shape) + 0.0  # normalise -0.0


@pytest.mark.parametrize("block, e4m3", [(16, True), (32, False)])
def test_fake_quant_fp4_random_against_independent_reference(block, e4m3):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 256)) * np.exp2(rng.integers(-10, 8, (64, 1)))).astype(np.float32)
    out = np.asarray(Q.fake_quant_fp4(jnp.asarray(x), block, e4m3)) + 0.0
    np.testing.assert_array_equal(out, _fp4_reference(x, block, e4m3))


# ------------------------------------------------------------------------------------------------
# FP8 weights
# ------------------------------------------------------------------------------------------------


def test_fp8_weights_exact_for_grid_values():
    rng = np.random.default_rng(3)
    n, k = 64, 96
    q = rng.integers(0, 256, (n, k)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    q = np.where(np.isnan(q.astype(np.float32)), ml_dtypes.float8_e4m3fn(1.0), q)
    q[::32, ::32] = 448.0  # every 32x32 block has amax exactly 448 -> its scale is exactly 2^e
    e = rng.integers(-20, 10, (2, 3))
    w = q.astype(np.float32) * np.exp2(np.repeat(np.repeat(e, 32, 0), 32, 1)).astype(np.float32)
    q2, s2 = Q.quantize_fp8_blocks(w)
    assert s2.view(np.uint8).tolist() == (e + 127).tolist()
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(bits(Q.dequantize_fp8_blocks(q2, s2)), bits(w))


def test_fp8_weights_error_bound_non_divisible_shape():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((70, 100)) * 0.05).astype(np.float32)
    w[3, 3] = 9.0  # one outlier block
    q, s = Q.quantize_fp8_blocks(w)
    assert q.shape == (70, 100) and q.dtype == ml_dtypes.float8_e4m3fn
    assert s.shape == (3, 4) and s.dtype == ml_dtypes.float8_e8m0fnu
    d = Q.dequantize_fp8_blocks(q, s)
    assert d.dtype == np.float32 and d.shape == w.shape
    scale = np.repeat(np.repeat(Q.e8m0_to_float32(s, np), 32, 0), 32, 1)[:70, :100]
    # e4m3: relative error <= 2^-4 for normals; absolute <= 2^-10 * scale in the subnormal range.
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10)
    assert np.all(np.abs(d - w) <= bound)
    # Every block's amax lands in (224, 448] after scaling, i.e. the scale is the smallest
    # power of two that avoids clipping.
    amax_scaled = np.abs(w / scale)
    for i in range(3):
        for j in range(4):
            m = amax_scaled[32 * i : 32 * i + 32, 32 * j : 32 * j + 32].max()
            assert 224 < m <= 448


@pytest.mark.parametrize("shape, block", [((70, 100), (32, 32)), ((3, 33, 64), (32, 32)), ((40, 256), (128, 128))])
def test_fp8_dequant_numpy_jax_bit_exact(shape, block):
    rng = np.random.default_rng(5)
    w = rng.standard_normal(shape).astype(np.float32)
    q, s = Q.quantize_fp8_blocks(w, block)
    a = Q.dequantize_fp8_blocks(q, s, block)
    b = np.asarray(jax.jit(lambda q, s: Q.dequantize_fp8_blocks(q, s, block, xp=jnp))(jnp.asarray(q), jnp.asarray(s)))
    np.testing.assert_array_equal(bits(a), bits(b))
    # Raw uint8 bytes (how vLLM holds E8M0/F8) decode identically.
    c = Q.dequantize_fp8_blocks(q.view(np.uint8), s.view(np.uint8), block)
    np.testing.assert_array_equal(bits(a), bits(c))


def test_fp8_rows_equal_fake_quant():
    # A (1, 32) block weight quantiser is the activation fake-quantiser.
    rng = np.random.default_rng(6)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    q, s = Q.quantize_fp8_blocks(w, (1, 32))
    np.testing.assert_array_equal(bits(Q.dequantize_fp8_blocks(q, s, (1, 32))), bits(Q.fake_quant_fp8(jnp.asarray(w))))


def test_fp8_errors():
    with pytest.raises(ValueError):
        Q.quantize_fp8_blocks(np.array([[np.inf, 1.0]], np.float32))
    q, s = Q.quantize_fp8_blocks(np.ones((64, 64), np.float32))
    with pytest.raises(ValueError):
        Q.dequantize_fp8_blocks(q, s[:1])
    with pytest.raises(TypeError):
        Q.dequantize_fp8_blocks(q.astype(np.float32), s)


# ------------------------------------------------------------------------------------------------
# MXFP4 experts
# ------------------------------------------------------------------------------------------------


def test_mxfp4_hand_row():
    # Row of 32: [0.5, 1, 6, -6, 0 ...] -> amax 6 -> scale 2^0 (byte 127); bytes 0x21, 0xF7, 0, ...
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [0.5, 1.0, 6.0, -6.0]
    packed, scale = Q.quantize_mxfp4(w)
    assert packed.dtype == np.int8 and packed.shape == (1, 16)
    assert scale.dtype == ml_dtypes.float8_e8m0fnu and scale.shape == (1, 1)
    assert packed.view(np.uint8)[0, :3].tolist() == [0x21, 0xF7, 0x00]
    assert scale.view(np.uint8)[0, 0] == 127
    # Scaled by 2^-5 (amax 6 * 2^-5): same codes, byte 122.
    p2, s2 = Q.quantize_mxfp4(w * 2.0**-5)
    np.testing.assert_array_equal(p2, packed)
    assert s2.view(np.uint8)[0, 0] == 122


def test_mxfp4_round_trip_exact_for_grid_values():
    rng = np.random.default_rng(7)
    n, k = 16, 128
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    codes[:, ::32] = 7  # each block holds +6, so amax = 6 * 2^e
    codes[codes == 8] = 0  # code 8 decodes to +0.0, which quantises back to code 0
    e = rng.integers(-30, 30, (n, k // 32))
    w = Q.E2M1_VALUES[codes] * np.repeat(np.exp2(e), 32, 1).astype(np.float32)
    packed, scale = Q.quantize_mxfp4(w)
    assert scale.view(np.uint8).tolist() == (e + 127).tolist()
    want_bytes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    np.testing.assert_array_equal(packed.view(np.uint8), want_bytes)
    np.testing.assert_array_equal(Q.dequantize_mxfp4(packed, scale), w)


def test_mxfp4_numpy_jax_bit_exact_and_equal_to_fake_quant():
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((4, 48, 256)) * 0.02).astype(np.float32)
    packed, scale = Q.quantize_mxfp4(w)
    assert packed.shape == (4, 48, 128) and scale.shape == (4, 48, 8)
    a = Q.dequantize_mxfp4(packed, scale)
    b = np.asarray(jax.jit(lambda p, s: Q.dequantize_mxfp4(p, s, xp=jnp))(jnp.asarray(packed), jnp.asarray(scale)))
    np.testing.assert_array_equal(bits(a), bits(b))
    np.testing.assert_array_equal(bits(a), bits(Q.fake_quant_fp4(jnp.asarray(w), 32, False)))
    c = Q.dequantize_mxfp4(packed.view(np.uint8), scale.view(np.uint8))
    np.testing.assert_array_equal(bits(a), bits(c))


def test_mxfp4_errors():
    with pytest.raises(ValueError):
        Q.quantize_mxfp4(np.ones((2, 48), np.float32))
    with pytest.raises(ValueError):
        Q.quantize_mxfp4(np.full((2, 32), np.nan, np.float32))
    packed, scale = Q.quantize_mxfp4(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError):
        Q.dequantize_mxfp4(packed, scale[:, :1])


# ------------------------------------------------------------------------------------------------
# FP4 KV-cache records
# ------------------------------------------------------------------------------------------------


def test_kv_record_is_288_bytes_and_matches_fake_quant():
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((2, 5, 512)).astype(np.float32) * 3)
    codes, scales = Q.pack_fp4_kv(x)
    assert codes.dtype == jnp.uint8 and codes.shape == (2, 5, 256)
    assert scales.dtype == jnp.float8_e4m3fn and scales.shape == (2, 5, 32)
    assert codes[0, 0].nbytes + scales[0, 0].nbytes == 288
    out = Q.unpack_fp4_kv(codes, scales)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    np.testing.assert_array_equal(bits(out), bits(Q.fake_quant_fp4(x, 16, True)))


def test_index_record_is_68_bytes_and_matches_fake_quant():
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((7, 128)).astype(np.float32))
    codes, scales = Q.pack_fp4_index(x)
    assert codes.dtype == jnp.uint8 and codes.shape == (7, 64)
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (7, 4)
    assert codes[0].nbytes + scales[0].nbytes == 68
    out = Q.unpack_fp4_index(codes, scales)
    np.testing.assert_array_equal(bits(out), bits(Q.fake_quant_fp4(x, 32, False)))


def test_kv_record_hand_values():
    x = np.zeros(32, np.float32)
    x[:16] = FP4_BLOCK_IN  # block 0: scale e4m3(1) = 0x38
    x[16:20] = [9.0, 3.0, -1.5, 0.0]  # block 1: amax 9 -> scale 1.5 (0x3C); codes 7, 4, 10, 0
    codes, scales = Q.pack_fp4_kv(jnp.asarray(x))
    assert np.asarray(scales).view(np.uint8).tolist() == [0x38, 0x3C]
    c = np.asarray(codes).tolist()
    assert c[:8] == [a | (b << 4) for a, b in zip(FP4_BLOCK_CODES[0::2], FP4_BLOCK_CODES[1::2])]
    assert c[8:10] == [7 | (4 << 4), 10 | (0 << 4)]
    out = np.asarray(Q.unpack_fp4_kv(codes, scales))
    np.testing.assert_array_equal(out[:16], FP4_BLOCK_OUT)
    np.testing.assert_array_equal(out[16:20], [9.0, 3.0, -1.5, 0.0])


def test_fp4_records_general_last_dim_and_jit():
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    kv = jax.jit(lambda v: Q.unpack_fp4_kv(*Q.pack_fp4_kv(v)))(x)
    np.testing.assert_array_equal(bits(kv), bits(Q.fake_quant_fp4(x, 16, True)))
    ix = jax.jit(lambda v: Q.unpack_fp4_index(*Q.pack_fp4_index(v)))(x)
    np.testing.assert_array_equal(bits(ix), bits(Q.fake_quant_fp4(x, 32, False)))
    with pytest.raises(ValueError):
        Q.pack_fp4_kv(jnp.zeros((2, 40)))
    with pytest.raises(ValueError):
        Q.pack_fp4_index(jnp.zeros((2, 48)))


# ---- straight-through gradients (quantization-aware training) ------------------------------


@pytest.mark.parametrize("fq", [
    lambda x: Q.fake_quant_fp8(x, block=32),
    lambda x: Q.fake_quant_fp4(x, block=16, e4m3_scales=True),
    lambda x: Q.fake_quant_fp4(x, block=32, e4m3_scales=False),
    lambda x: Q.fake_quant_weight_fp8(x, block=(32, 32)),
], ids=["fp8", "fp4_e4m3", "fp4_ue8m0", "weight_fp8"])
def test_fake_quant_gradient_is_straight_through(fq):
    """The backward passes the cotangent unchanged, including tiny values an FP8 cast of the
    cotangent would flush to zero, while the forward still quantizes."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((64, 64)) * 1e-6, jnp.float32)
    out, vjp = jax.vjp(fq, x)
    assert not np.array_equal(np.asarray(out), np.asarray(x))
    (grad,) = vjp(cot)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(cot))


@pytest.mark.parametrize("shape,block", [((64, 96), (32, 32)), ((3, 40, 72), (32, 32)), ((8, 20), (1, 32))])
def test_fake_quant_weight_fp8_equals_host_round_trip(shape, block):
    """What training sees is bit for bit what the checkpoint writer stores and the loader reads."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 10.0, shape[:-2] + (shape[-2], 1))).astype(np.float32)
    q, s = Q.quantize_fp8_blocks(w, block=block)
    expected = Q.dequantize_fp8_blocks(q, s, block=block)
    np.testing.assert_array_equal(np.asarray(Q.fake_quant_weight_fp8(jnp.asarray(w), block)), expected)


def test_e2m1_decode_on_device_equals_the_table():
    """The device decode computes values from the bits (no table gather); code 8 is +0.0."""
    got = np.asarray(Q._e2m1_decode(jnp.arange(16, dtype=jnp.uint8), jnp))
    np.testing.assert_array_equal(got.view(np.uint32), Q.E2M1_VALUES.view(np.uint32))


def test_e2m1_decode_from_the_bits_matches_the_table():
    """What the kernels decode MXFP4 tiles with, bit for bit (code 8 is +0.0 in both)."""
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(Q.e2m1_to_f32(codes)).view(np.uint32),
                                  Q.E2M1_VALUES.view(np.uint32))
