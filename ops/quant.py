"""Numeric formats of DeepSeek-V4.1-Flash: block FP8, MXFP4 experts, and the FP4 KV cache.

Why this module exists
----------------------
The released checkpoint and the model's trained numerics use four narrow formats, and an
inference engine has to reproduce each of them bit for bit:

* **FP8 dense weights** (attention projections, shared experts, indexer ``wq_b``): e4m3 values
  with one power-of-two (UE8M0) scale per 32 x 32 block, ``W = e4m3 * 2^(s - 127)``.
* **MXFP4 routed experts**: e2m1 codes packed two per byte along K (the *even* K index in the
  *low* nibble), stored as ``I8``, with one UE8M0 scale per 32 values along K.
* **QAT fake-quantisation** of activations. The model was trained with the window KV rounded
  through FP8 (UE8M0 scale per 32) and the compressed KV / indexer keys and queries rounded through
  FP4 (e4m3 scale per 16, resp. UE8M0 scale per 32). Those roundings change logits by whole units,
  so the engine must apply them exactly as the reference does, including its rounding of scales
  (``2^ceil(log2 t)`` taken from the float32 exponent and mantissa bits) and its e2m1 tie rule.
* **The persistent FP4 KV cache** (spec section 3.1): a 512-d main-KV latent is stored as 256
  bytes of e2m1 codes + 32 e4m3 scales (288 B) and a 128-d indexer key as 64 bytes + 4 UE8M0
  scales (68 B). Packing and unpacking must reproduce the fake-quantised values exactly, so that
  attention over the cache equals attention over the fake-quantised tensors.

Host-side helpers (checkpoint writing and reading) take numpy arrays; device-side helpers take
``jax.numpy`` arrays. Functions with an ``xp`` argument accept either (``xp=np`` or ``xp=jnp``) and
give bit-identical results. All arithmetic is float32.

Two deliberate details:

* ``2^k`` is built from its IEEE-754 bits, never with ``exp2``: XLA's ``exp2`` on CPU is not exact
  for integer arguments.
* The e2m1 table maps code 8 (negative zero) to ``+0.0``, as the reference table does; ``ml_dtypes``
  and ``jnp.float4_e2m1fn`` decode it as ``-0.0``. The values compare equal, but only this table
  is bit-identical to the reference.

Known, accepted divergences from a PyTorch reference run on CPU: XLA flushes float32 subnormals
to zero, so blocks whose absolute maximum is below about 1e-37 (FP4 with UE8M0 scale) can differ
in the last subnormal bits.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "KV_FP4_BLOCK",
    "INDEX_FP4_BLOCK",
    "pow2_ceil_exponent",
    "exp2_int",
    "e8m0_to_float32",
    "e2m1_codes",
    "e2m1_to_f32",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize_fp8_blocks",
    "dequantize_fp8_blocks",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "fake_quant_fp8",
    "fake_quant_fp4",
    "fake_quant_weight_fp8",
    "pack_fp4_kv",
    "unpack_fp4_kv",
    "pack_fp4_index",
    "unpack_fp4_index",
]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP4_E2M1_MAX = 6.0  # largest float4_e2m1fn
KV_FP4_BLOCK = 16  # main-KV latent: one e4m3 scale per 16 e2m1 values
INDEX_FP4_BLOCK = 32  # indexer keys/queries: one ue8m0 scale per 32 e2m1 values

# e2m1 code -> value. Bits: [sign | e1 e0 | m]; the sign is bit 3. Code 8 decodes to +0.0 (see
# the module docstring).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E2M1_VALUES.setflags(write=False)

# Magnitude thresholds of the e2m1 rounding: code = number of thresholds <= |q|. The midpoints
# 0.25, 1.25, 2.5, 5.0 lie above an even code and their ties round DOWN (threshold moved one ulp
# up); 0.75, 1.75, 3.5 lie above an odd code and their ties round UP (threshold at the midpoint).
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_TIES_UP = np.array([False, True, False, True, False, True, False])
_E2M1_THRESHOLDS = np.where(
    _E2M1_TIES_UP, _E2M1_MIDPOINTS, np.nextafter(_E2M1_MIDPOINTS, np.float32(np.inf))
).astype(np.float32)

_F32_INF_BITS = 0x7F800000
_INV_FP8_MAX = np.float32(1.0 / FP8_E4M3_MAX)
_INV_FP4_MAX = np.float32(1.0 / FP4_E2M1_MAX)
_FP8_AMAX_FLOOR = np.float32(1e-4)
_FP4_E4M3_AMAX_FLOOR = np.float32(6.0 * 2.0**-9)  # scale floor = 2^-9, the smallest e4m3
_FP4_UE8M0_AMAX_FLOOR = np.float32(6.0 * 2.0**-126)  # scale floor = 2^-126, the smallest normal


# ----------------------------------------------------------------------------------------------
# Small xp-generic primitives
# ----------------------------------------------------------------------------------------------


def _is_numpy(xp: Any) -> bool:
    return xp is np


def _bitcast(x, dtype, xp):
    """Reinterpret the bits of `x` as `dtype` (same item size)."""
    if _is_numpy(xp):
        return np.asarray(x).view(dtype)  # same item size: fine for 0-d and strided arrays
    return jax.lax.bitcast_convert_type(x, dtype)


def pow2_ceil_exponent(t, xp=jnp):
    """``ceil(log2(t))`` as int32 for float32 ``t > 0``, read from the IEEE-754 bits: the unbiased
    exponent, plus one if any mantissa bit is set (the reference's UE8M0 scale rounding).

    Subnormal ``t`` gives -126 (exponent field 0, mantissa nonzero), as in the reference."""
    t = np.asarray(t, np.float32) if _is_numpy(xp) else jnp.asarray(t, jnp.float32)
    bits = _bitcast(t, np.int32, xp)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return exponent - 127 + (mantissa != 0).astype(np.int32)


def exp2_int(k, xp=jnp):
    """Exact float32 ``2^k`` for int32 ``k``: normal and subnormal powers from their bits, 0 below
    2^-149 and +inf from 2^128 up."""
    k = np.asarray(k, np.int32) if _is_numpy(xp) else jnp.asarray(k, jnp.int32)
    normal = (xp.clip(k, -126, 127) + 127) << 23
    subnormal = xp.left_shift(np.int32(1), xp.clip(k + 149, 0, 22))
    bits = xp.where(k >= -126, normal, xp.where(k >= -149, subnormal, 0))
    bits = xp.where(k >= 128, np.int32(_F32_INF_BITS), bits).astype(np.int32)
    return _bitcast(bits, np.float32, xp)


def _scale_bits_u8(scale, xp):
    """Raw UE8M0 bytes of a scale array given as float8_e8m0fnu or uint8 (raw bytes, as vLLM
    loads them)."""
    dt = np.dtype(scale.dtype)
    if dt == np.dtype(ml_dtypes.float8_e8m0fnu):
        return _bitcast(scale, np.uint8, xp)
    if dt == np.dtype(np.uint8):
        return scale
    raise TypeError(f"UE8M0 scale must be float8_e8m0fnu or raw uint8 bytes, got {dt}")


def e8m0_to_float32(scale, xp=jnp):
    """Decode UE8M0 scales (float8_e8m0fnu, or raw uint8 bytes) to float32: ``2^(s - 127)``;
    byte 0xFF is NaN. Exact (byte 0 gives the subnormal 2^-127)."""
    u = _scale_bits_u8(scale, xp).astype(np.int32)
    value = exp2_int(u - 127, xp)
    return xp.where(u == 255, np.float32(np.nan), value)


def _e8m0_from_exponent(k, xp):
    """UE8M0 scale array (float8_e8m0fnu) holding ``2^k``; `k` must lie in [-127, 127]."""
    return _bitcast((k + 127).astype(np.uint8), ml_dtypes.float8_e8m0fnu, xp)


def e2m1_codes(q, xp=jnp):
    """Round float32 values (already clamped to [-6, 6]) to the nearest e2m1 code with the
    reference's tie rule. Returns uint8 codes, sign in bit 3 (set for -0.0 and negatives)."""
    magnitude = xp.abs(q)
    codes = (magnitude >= _E2M1_THRESHOLDS[0]).astype(np.uint8)
    for threshold in _E2M1_THRESHOLDS[1:]:
        codes = codes + (magnitude >= threshold).astype(np.uint8)
    return codes | (xp.signbit(q).astype(np.uint8) << 3)


def _e2m1_decode(codes, xp):
    """e2m1 codes -> float32 `E2M1_VALUES[codes]` (numpy: the table; jnp: `e2m1_to_f32`)."""
    if _is_numpy(xp):
        return E2M1_VALUES[codes.astype(np.int32)]
    return e2m1_to_f32(codes)


def e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """e2m1 codes (0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> float32
    `E2M1_VALUES[codes]` from the bits: `0.5 m` for exponent 0, else `2^(e-1) (1 + m/2)`; code 8
    (-0) is +0.0 as in the table. No table: XLA:CPU runs a lookup as one gather per value (it
    made decoding a decode step's FP4 indexer keys cost more than scoring them), and the Pallas
    kernels (Triton, Mosaic) decode MXFP4 tiles with it inside the kernel."""
    code = codes.astype(jnp.int32)
    e, m = (code >> 1) & 3, code & 1
    magnitude = jax.lax.bitcast_convert_type(jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)),
                                             jnp.float32)
    return jnp.where(code > 8, -magnitude, magnitude)


def pack_nibbles(codes, xp=jnp):
    """Pack 4-bit codes two per byte along the last axis: element 2j in the low nibble, 2j+1 in
    the high nibble. Returns uint8 with half the last dimension."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension {codes.shape[-1]} into nibbles")
    codes = codes.astype(np.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed, xp=jnp):
    """Inverse of `pack_nibbles`: uint8/int8 [..., m] -> uint8 codes [..., 2m], low nibble first."""
    if np.dtype(packed.dtype) == np.dtype(np.int8):
        packed = _bitcast(packed, np.uint8, xp)
    low = packed & 0xF
    high = packed >> 4
    return xp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _as_f32(x, xp):
    return np.asarray(x, dtype=np.float32) if _is_numpy(xp) else jnp.asarray(x).astype(jnp.float32)


def _check_finite_host(w: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{what}: input has non-finite values; no finite scale can represent it")


def _pad_to_blocks(w: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """Zero-pad the last two axes to block multiples (zeros never raise a block's amax)."""
    n, k = w.shape[-2:]
    pad_n, pad_k = -n % bn, -k % bk
    if pad_n or pad_k:
        w = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pad_n), (0, pad_k)])
    return w


def _repeat_blocks(s, block, shape, xp):
    """Expand per-block values [..., nb, kb] to element resolution [..., n, k]."""
    bn, bk = block
    s = xp.repeat(xp.repeat(s, bn, axis=-2), bk, axis=-1)
    return s[..., : shape[-2], : shape[-1]]


def _normalize_block(block) -> tuple[int, int]:
    if isinstance(block, int):
        block = (block, block)
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block sizes must be positive, got {block}")
    return bn, bk


# ----------------------------------------------------------------------------------------------
# FP8 dense weights (host quantiser, host/device dequantiser)
# ----------------------------------------------------------------------------------------------


def quantize_fp8_blocks(w: np.ndarray, block=(32, 32)) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a weight matrix ``[..., n, k]`` to float8_e4m3fn with one UE8M0 scale per
    ``block`` (rows x cols) block, like the official converter: ``amax`` clamped to >= 1e-4,
    ``scale = 2^ceil(log2(amax / 448))``, values ``clip(w / scale, +-448)`` rounded to nearest even.

    Returns ``(q float8_e4m3fn [..., n, k], scale float8_e8m0fnu [..., ceil(n/bn), ceil(k/bk)])``.
    Edge blocks of shapes not divisible by the block use only their real elements."""
    bn, bk = _normalize_block(block)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize_fp8_blocks expects [..., n, k], got shape {w.shape}")
    _check_finite_host(w, "quantize_fp8_blocks")
    n, k = w.shape[-2:]
    padded = _pad_to_blocks(w, bn, bk)
    nb, kb = padded.shape[-2] // bn, padded.shape[-1] // bk
    blocks = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = np.maximum(np.abs(blocks).max(axis=(-3, -1)), _FP8_AMAX_FLOOR)
    exponent = pow2_ceil_exponent(amax * _INV_FP8_MAX, np)
    scale_f32 = exp2_int(exponent, np)
    q = np.clip(blocks / scale_f32[..., :, None, :, None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(padded.shape)[..., :n, :k]
    return q.astype(ml_dtypes.float8_e4m3fn), _e8m0_from_exponent(exponent, np)


def dequantize_fp8_blocks(q, scale, block=(32, 32), xp=np):
    """``W[..., i, j] = e4m3(q[..., i, j]) * 2^(scale[..., i // bn, j // bk] - 127)`` in float32.

    `q` is float8_e4m3fn (or raw uint8 bytes); `scale` is float8_e8m0fnu (or raw uint8 bytes) of
    shape ``[..., ceil(n/bn), ceil(k/bk)]``. Works on numpy (``xp=np``) and jax (``xp=jnp``)
    arrays with identical results."""
    bn, bk = _normalize_block(block)
    if np.dtype(q.dtype) == np.dtype(np.uint8):
        q = _bitcast(q, ml_dtypes.float8_e4m3fn, xp)
    if np.dtype(q.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError(f"FP8 weight must be float8_e4m3fn (or raw uint8), got {q.dtype}")
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not fit weight {tuple(q.shape)}"
                         f" with block {(bn, bk)}: expected {want}")
    s = e8m0_to_float32(scale, xp)
    if n % bn == 0 and k % bk == 0:  # broadcast per block, no scale array of the full size
        blocks = q.astype(np.float32).reshape(*q.shape[:-2], n // bn, bn, k // bk, bk)
        return (blocks * s[..., :, None, :, None]).reshape(q.shape)
    return q.astype(np.float32) * _repeat_blocks(s, (bn, bk), q.shape, xp)


# ----------------------------------------------------------------------------------------------
# MXFP4 routed experts
# ----------------------------------------------------------------------------------------------


def _fp4_blocks(x, block: int, e4m3_scales: bool, xp):
    """Shared FP4 block quantiser (the reference's `_fake_quant_fp4_block` up to the codes).

    Returns (codes uint8 [..., n], scale_f32 [..., n/block], scale_store [..., n/block]) where
    scale_store is float8_e4m3fn (e4m3_scales) or float8_e8m0fnu."""
    n = x.shape[-1]
    blocks = _as_f32(x, xp).reshape(*x.shape[:-1], n // block, block)
    amax = xp.max(xp.abs(blocks), axis=-1)
    if e4m3_scales:
        scale_store = (xp.maximum(amax, _FP4_E4M3_AMAX_FLOOR) / np.float32(FP4_E2M1_MAX)).astype(
            ml_dtypes.float8_e4m3fn
        )
        scale = scale_store.astype(np.float32)
    else:
        exponent = pow2_ceil_exponent(xp.maximum(amax, _FP4_UE8M0_AMAX_FLOOR) * _INV_FP4_MAX, xp)
        scale = exp2_int(exponent, xp)
        scale_store = _e8m0_from_exponent(xp.clip(exponent, -127, 127), xp)
    q = xp.clip(blocks / scale[..., None], -FP4_E2M1_MAX, FP4_E2M1_MAX)
    codes = e2m1_codes(q, xp).reshape(x.shape)
    return codes, scale, scale_store


def quantize_mxfp4(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``[..., n, k]`` to MXFP4: e2m1 codes packed two per byte along K (even K index in
    the low nibble), returned as int8 ``[..., n, k // 2]``, and one UE8M0 scale per `block` values
    along K, float8_e8m0fnu ``[..., n, k // block]``.

    ``scale = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))``; values ``clip(w / scale, +-6)`` rounded to
    the nearest e2m1 value (ties as in `e2m1_codes`). This is the indexer quantiser of the
    reference, so ``dequantize_mxfp4(*quantize_mxfp4(w))`` equals
    ``fake_quant_fp4(w, 32, e4m3_scales=False)``."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 1 or w.shape[-1] % block or block % 2:
        raise ValueError(f"quantize_mxfp4: last dimension of {w.shape} must be a multiple of the "
                         f"even block {block}")
    _check_finite_host(w, "quantize_mxfp4")
    codes, _, scale = _fp4_blocks(w, block, False, np)
    return pack_nibbles(codes, np).view(np.int8), scale


def dequantize_mxfp4(packed, scale, block: int = 32, xp=np):
    """Decode MXFP4 ``packed`` (int8/uint8 ``[..., n, k // 2]``, low nibble = even k) with UE8M0
    ``scale`` (``[..., n, k // block]``, float8_e8m0fnu or raw uint8) to float32 ``[..., n, k]``.
    Works on numpy and jax arrays with identical results."""
    codes = unpack_nibbles(packed, xp)
    k = codes.shape[-1]
    if k % block or tuple(scale.shape) != (*codes.shape[:-1], k // block):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not fit packed "
                         f"{tuple(packed.shape)} with block {block}")
    values = _e2m1_decode(codes, xp).reshape(*codes.shape[:-1], k // block, block)
    return (values * e8m0_to_float32(scale, xp)[..., None]).reshape(codes.shape)


# ----------------------------------------------------------------------------------------------
# QAT fake-quantisation (device)
# ----------------------------------------------------------------------------------------------


def fake_quant_fp8(x, block: int = 32):
    """FP8 e4m3 quantise-dequantise with one UE8M0 scale per `block` values of the last axis (the
    reference's window-KV quantiser). fp32 math; returns x's dtype. A last dimension not divisible
    by `block` returns `x` unchanged, as the reference does."""
    x = jnp.asarray(x)
    if x.shape[-1] % block:
        return x
    return _fake_quant_fp8_ste(x, block)


@partial(jax.jit, static_argnums=1)
def _fake_quant_fp8_jit(x, block):
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), _FP8_AMAX_FLOOR)
    scale = exp2_int(pow2_ceil_exponent(amax * _INV_FP8_MAX, jnp), jnp)[..., None]
    q = jnp.clip(blocks / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    out = q.astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return out.reshape(x.shape).astype(x.dtype)


def fake_quant_fp4(x, block: int, e4m3_scales: bool):
    """FP4 e2m1 quantise-dequantise per `block` values of the last axis.

    ``e4m3_scales=True`` (compressed-KV quantiser, block 16): ``scale = e4m3(max(amax, 6*2^-9)/6)``.
    ``e4m3_scales=False`` (indexer quantiser, block 32): ``scale = 2^ceil(log2(max(amax,
    6*2^-126)/6))``. Then ``clip(x / scale, +-6)`` is rounded onto the e2m1 grid (ties at 0.25,
    1.25, 2.5, 5 down; at 0.75, 1.75, 3.5 up) and multiplied by the scale. fp32 math; returns x's
    dtype; a last dimension not divisible by `block` returns `x` unchanged."""
    x = jnp.asarray(x)
    if x.shape[-1] % block:
        return x
    return _fake_quant_fp4_ste(x, block, bool(e4m3_scales))


@partial(jax.jit, static_argnums=(1, 2))
def _fake_quant_fp4_jit(x, block, e4m3_scales):
    codes, scale, _ = _fp4_blocks(x, block, e4m3_scales, jnp)
    values = _e2m1_decode(codes, jnp).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return (values * scale[..., None]).reshape(x.shape).astype(x.dtype)


# Straight-through estimators: the forward is the fake-quant itself (bit for bit), the backward
# passes the cotangent unchanged. Without them training gets no useful gradient through the casts:
# e2m1 codes come from comparisons (zero gradient) and the e4m3 cast would round the cotangent
# itself to FP8 (small gradients flush to zero). Scales are treated as constants.


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant_fp8_ste(x, block):
    return _fake_quant_fp8_jit(x, block)


_fake_quant_fp8_ste.defvjp(lambda x, block: (_fake_quant_fp8_jit(x, block), None),
                           lambda block, _, g: (g,))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant_fp4_ste(x, block, e4m3_scales):
    return _fake_quant_fp4_jit(x, block, e4m3_scales)


_fake_quant_fp4_ste.defvjp(lambda x, block, e4m3: (_fake_quant_fp4_jit(x, block, e4m3), None),
                           lambda block, e4m3, _, g: (g,))


def fake_quant_weight_fp8(w, block=(32, 32)):
    """Device quantise-dequantise of a weight ``[..., n, k]`` exactly as `quantize_fp8_blocks`
    then `dequantize_fp8_blocks` (2-D blocks, edge blocks use their real elements), with a
    straight-through gradient: quantization-aware training of FP8-stored weights."""
    return _fake_quant_weight_fp8_ste(jnp.asarray(w), _normalize_block(block))


@partial(jax.jit, static_argnums=1)
def _fake_quant_weight_fp8_jit(w, block):
    bn, bk = block
    n, k = w.shape[-2:]
    wf = w.astype(jnp.float32)
    padded = jnp.pad(wf, [(0, 0)] * (w.ndim - 2) + [(0, -n % bn), (0, -k % bk)])
    nb, kb = padded.shape[-2] // bn, padded.shape[-1] // bk
    blocks = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), _FP8_AMAX_FLOOR)
    scale = exp2_int(pow2_ceil_exponent(amax * _INV_FP8_MAX, jnp), jnp)[..., :, None, :, None]
    q = jnp.clip(blocks / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    out = (q.astype(jnp.float32) * scale).reshape(padded.shape)[..., :n, :k]
    return out.astype(w.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant_weight_fp8_ste(w, block):
    return _fake_quant_weight_fp8_jit(w, block)


_fake_quant_weight_fp8_ste.defvjp(lambda w, block: (_fake_quant_weight_fp8_jit(w, block), None),
                                  lambda block, _, g: (g,))


# ----------------------------------------------------------------------------------------------
# FP4 KV-cache records (device)
# ----------------------------------------------------------------------------------------------


def _pack_fp4(x, block: int, e4m3_scales: bool):
    x = jnp.asarray(x)
    n = x.shape[-1]
    if n % block or block % 2:
        raise ValueError(f"last dimension {n} is not a multiple of the FP4 block {block}")
    return _pack_fp4_jit(x, block, e4m3_scales)


@partial(jax.jit, static_argnums=(1, 2))
def _pack_fp4_jit(x, block, e4m3_scales):
    codes, _, scale_store = _fp4_blocks(x, block, e4m3_scales, jnp)
    return pack_nibbles(codes, jnp), scale_store


def _unpack_fp4(codes, scales, block: int, e4m3_scales: bool):
    codes, scales = jnp.asarray(codes), jnp.asarray(scales)
    if e4m3_scales and scales.dtype == jnp.uint8:  # raw bytes of e4m3 scales
        scales = jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    if codes.shape[:-1] != scales.shape[:-1] or 2 * codes.shape[-1] != scales.shape[-1] * block:
        raise ValueError(f"codes {codes.shape} do not match scales {scales.shape} of block {block}")
    return _unpack_fp4_jit(codes, scales, block, e4m3_scales)


@partial(jax.jit, static_argnums=(2, 3))
def _unpack_fp4_jit(codes, scales, block, e4m3_scales):
    scale = scales.astype(jnp.float32) if e4m3_scales else e8m0_to_float32(scales, jnp)
    values = _e2m1_decode(unpack_nibbles(codes, jnp), jnp)
    n = values.shape[-1]
    values = values.reshape(*values.shape[:-1], n // block, block) * scale[..., None]
    return values.reshape(*values.shape[:-2], n)


def pack_fp4_kv(x, block: int = KV_FP4_BLOCK):
    """Main-KV record: ``x [..., d]`` -> (codes uint8 [..., d/2], even index in the low nibble;
    scales float8_e4m3fn [..., d/16]). For d = 512: 256 + 32 = 288 bytes.
    ``unpack_fp4_kv(*pack_fp4_kv(x)) == fake_quant_fp4(x, 16, e4m3_scales=True)`` bit for bit."""
    return _pack_fp4(x, block, True)


def unpack_fp4_kv(codes, scales, block: int = KV_FP4_BLOCK):
    """Decode a main-KV record to float32 ``[..., 2 * codes.shape[-1]]``."""
    return _unpack_fp4(codes, scales, block, True)


def pack_fp4_index(x, block: int = INDEX_FP4_BLOCK):
    """Indexer-key record: ``x [..., d]`` -> (codes uint8 [..., d/2]; scales float8_e8m0fnu
    [..., d/32]). For d = 128: 64 + 4 = 68 bytes.
    ``unpack_fp4_index(*pack_fp4_index(x)) == fake_quant_fp4(x, 32, e4m3_scales=False)``."""
    return _pack_fp4(x, block, False)


def unpack_fp4_index(codes, scales, block: int = INDEX_FP4_BLOCK):
    """Decode an indexer-key record to float32 ``[..., 2 * codes.shape[-1]]``."""
    return _unpack_fp4(codes, scales, block, False)


# ----------------------------------------------------------------------------------------------
# FP8 window-KV records (device)
# ----------------------------------------------------------------------------------------------


def pack_fp8_blocks(x, block: int = 32):
    """Window-KV record: ``x [..., d]`` -> (float8_e4m3fn [..., d], float8_e8m0fnu [..., d/block]).
    For d = 512: 512 + 16 = 528 bytes. ``unpack_fp8_blocks(*pack_fp8_blocks(x)) ==
    fake_quant_fp8(x, block)`` bit for bit (same amax floor, scale rounding and clamp)."""
    x = jnp.asarray(x)
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the FP8 block {block}")
    return _pack_fp8_jit(x, block)


@partial(jax.jit, static_argnums=1)
def _pack_fp8_jit(x, block):
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), _FP8_AMAX_FLOOR)
    k = pow2_ceil_exponent(amax * _INV_FP8_MAX, jnp)
    q = jnp.clip(blocks / exp2_int(k, jnp)[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.astype(jnp.float8_e4m3fn).reshape(x.shape), _e8m0_from_exponent(k, jnp)


def unpack_fp8_blocks(q, scale):
    """Decode a `pack_fp8_blocks` record to float32."""
    q, scale = jnp.asarray(q), jnp.asarray(scale)
    block = q.shape[-1] // scale.shape[-1]
    values = q.astype(jnp.float32).reshape(*q.shape[:-1], scale.shape[-1], block)
    return (values * e8m0_to_float32(scale, jnp)[..., None]).reshape(q.shape)
