"""Transcendental functions made of correctly rounded operations only, for batch-invariant programs.

XLA CPU computes `exp`, `logistic`, `log1p`, `rsqrt`, `tanh`, ... with one implementation in the
vectorised body of a loop and another in its scalar remainder, so the same input gives results one
ulp apart depending on where the element falls in the array (measured on XLA CPU, jax 0.12, against
the same rows among 300: `exp(h - max(h))` on `[n, 8]` differs for 18 of 37 `n`, `rsqrt` on `[n, 3]`
for 26 of 37; 1-D arrays and rows of 24 or more showed none).
A per-token `[T, 4]` value (mHC's mixing weights, the Engram gate) thus changes in the last bit with
the number of tokens in the step, and a decode step stops reproducing the prefill chunk's bits.

Here every function is range reduction and a polynomial in `+ - * /`, `sqrt`, `floor` and bit
casts, which IEEE rounds one way in any lane: the result depends on the input alone. Accuracy is a
few ulp over the float32 range (checked against float64 in the test); special values (±inf, NaN,
0) behave as the library functions' do. `ops.batch_invariant` evaluates a step's transcendental
primitives with these (`INVARIANT_PRIMITIVES`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["INVARIANT_PRIMITIVES", "exp", "log", "log1p", "logistic", "rsqrt", "tanh"]

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # 9 significant bits: k * _LN2_HI is exact for |k| < 2^15
_LN2_LO = -2.12194440e-4
# exp(r) - 1 - r on |r| <= ln2 / 2: Taylor terms through r^8 / 8! (truncation < 2e-10 relative)
_EXP_TAYLOR = tuple(1.0 / f for f in (40320.0, 5040.0, 720.0, 120.0, 24.0, 6.0, 2.0))


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _horner(r, coefficients):
    acc = jnp.full_like(r, coefficients[0])
    for c in coefficients[1:]:
        acc = acc * r + c
    return acc


def _pow2(k):
    """2^k for integral float32 `k` in [-126, 127], built from its exponent bits."""
    return lax.bitcast_convert_type(((k.astype(jnp.int32) + 127) << 23), jnp.float32)


def _exp32(x):
    x = _f32(x)
    clamped = jnp.clip(x, -104.0, 88.75)
    k = jnp.floor(clamped * _LOG2E + 0.5)
    r = (clamped - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 + (r + r * r * _horner(r, _EXP_TAYLOR))
    half = jnp.floor(k * 0.5)  # 2^k in two factors, so that subnormal results and 2^128 come out right
    y = p * _pow2(half) * _pow2(k - half)
    y = jnp.where(x > 88.72283, jnp.inf, y)
    y = jnp.where(x < -103.97, 0.0, y)
    return jnp.where(jnp.isnan(x), x, y)


def _frexp_sqrt2(u):
    """(m, e) with u = m * 2^e and m in [sqrt(1/2), sqrt(2)), for finite positive normal `u`."""
    bits = lax.bitcast_convert_type(u, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 127
    m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)  # [1, 2)
    big = m > 1.41421356
    return jnp.where(big, m * 0.5, m), (e + big.astype(jnp.int32)).astype(jnp.float32)


def _log_of_mantissa(m):
    """log(m) for m in [sqrt(1/2), sqrt(2)): 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172."""
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    # 2 (s + s^3/3 + ... + s^11/11): the next term is below 1e-10 relative
    return 2.0 * s + 2.0 * s * s2 * _horner(s2, (1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3))


def _log32(u):
    u = _f32(u)
    tiny = u < 1.1754944e-38  # subnormal inputs: scaled into the normal range first
    scaled = jnp.where(tiny, u * 8388608.0, u)  # * 2^23
    m, e = _frexp_sqrt2(jnp.where(scaled > 0, scaled, 1.0))
    e = e - jnp.where(tiny, 23.0, 0.0)
    y = e * _LN2_HI + (e * _LN2_LO + _log_of_mantissa(m))
    y = jnp.where(u == 0, -jnp.inf, y)
    y = jnp.where(u < 0, jnp.nan, y)
    y = jnp.where(u == jnp.inf, jnp.inf, y)
    return jnp.where(jnp.isnan(u), u, y)


def _log1p32(x):
    x = _f32(x)
    u = 1.0 + x
    # log(u) corrected by the rounding of 1 + x: log1p(x) = log(u) + (x - (u - 1)) / u
    correction = jnp.where(u == 1.0, 0.0, (x - (u - 1.0)) / jnp.where(u == 0, 1.0, u))
    y = _log32(u) + correction
    small = jnp.abs(x) < 1e-4  # x - x^2/2 + x^3/3 is exact to float32 there
    y = jnp.where(small, x * (1.0 - x * (0.5 - x * (1.0 / 3.0))), y)
    return jnp.where(x == jnp.inf, jnp.inf, y)


def _logistic32(x):
    x = _f32(x)
    e = _exp32(-jnp.abs(x))  # in (0, 1]: never overflows
    positive = 1.0 / (1.0 + e)
    return jnp.where(x >= 0, positive, e * positive)


def _rsqrt32(x):
    x = _f32(x)
    # a square root and a division, each rounded once; the barrier keeps XLA from fusing them
    # back into its own `rsqrt`
    return 1.0 / lax.optimization_barrier(jnp.sqrt(x))


def _tanh32(x):
    x = _f32(x)
    a = jnp.abs(x)
    e = _exp32(-2.0 * a)  # tanh(a) = (1 - e) / (1 + e)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a  # below 0.0625: odd Taylor series, free of the cancellation above
    small = a + a * a2 * _horner(a2, (-17 / 315, 2 / 15, -1 / 3))
    y = jnp.where(a < 0.0625, small, big)
    return jnp.where(jnp.isnan(x), x, jnp.sign(x) * y)


def _float32_only(fn, name):
    """`fn` for float32 inputs; other dtypes go through float32 (bfloat16, float16) or are refused."""

    def wrapped(x, **_):
        dtype = jnp.result_type(x)
        if dtype == jnp.float32:
            return fn(x)
        if dtype in (jnp.bfloat16, jnp.float16):
            return fn(x.astype(jnp.float32)).astype(dtype)
        raise NotImplementedError(f"invariant {name}: {dtype} inputs are not supported (float32, bfloat16, float16)")

    wrapped.__name__ = name
    return wrapped


exp = _float32_only(_exp32, "exp")
log = _float32_only(_log32, "log")
log1p = _float32_only(_log1p32, "log1p")
logistic = _float32_only(_logistic32, "logistic")
rsqrt = _float32_only(_rsqrt32, "rsqrt")
tanh = _float32_only(_tanh32, "tanh")

# primitive name -> the invariant function that replaces it (its params, e.g. `accuracy`, ignored)
INVARIANT_PRIMITIVES = {"exp": exp, "log": log, "log1p": log1p, "logistic": logistic, "rsqrt": rsqrt,
                        "tanh": tanh}
