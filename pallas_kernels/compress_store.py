"""Pallas kernels for `compress_store`: compress a chunk at a KV source and write its FP4 entries
and indexer keys in place into the paged pool.

Semantics are those of `reference/compress_store.py` (the engine step's own code path). Two
`pallas_call`s with the indexer-key projection between them as an XLA matmul:

1. entries, grid `(B, cdiv(T, block_t))`: per token the pair pooling (the token before it is a
   row gather, or the slot's held pending token for the first one; per-channel softmax of the two
   gates, gated sum) or the ratio-1 passthrough, RMSNorm, RoPE, then the entry record (FP4 codes
   packed two per byte + e4m3 scale per 16, or the (fake-quantized) float row) scattered into
   its pool row. The pre-RoPE latent of every token is also written out.
2. `linear(latent, wk)` in XLA: the same matmul, on the same `[B, T, D]` shape, as the reference,
   so the keys' inputs are bit-equal (a dot inside the kernel would sum in another order, and
   XLA picks its dot algorithm by shape: M=1 and M>1 already differ on CPU).
3. keys, same grid: RMSNorm(k_norm), RoPE, FP4 codes + UE8M0 scale per 32 (or float rows),
   scattered into the key pool.

Why per token and not per entry: the reference computes the latent of every token (odd ones
pair, even ones are discarded), and the key matmul must see the same shape to be bit-equal.

Paged writes happen inside the kernels: the pools are `input_output_aliases` of the calls and
each program stores its rows at `dest = page * per_page + offset` with a masked vector-indexed
store (Triton pointer tensor; rows not emitted, or whose page is -1 or past the pool, are masked
off: the reference's `mode="drop"`). XLA computes `dest`, the RoPE cos/sin tables (same ops and
shape as the reference, so the same values) and the next pending state. Without donation of the
pools (e.g. a non-donating jit) XLA copies them before the in-place write; the engine step donates
its cache.

Exactness: the kernels do the reference's operations as XLA actually runs them. XLA's algebraic
simplifier turns the reference's `e / sum` (softmax), `x / scale` (FP4) and `amax / 6` into
multiplications by a reciprocal (`fl(1/6)` for the constant), so the kernels multiply by IEEE
reciprocals (`_recip`; compiled: `div.rn.f32` inline PTX, since Triton's fp32 `/` is the
approximate `div.full.f32`); e4m3 scales are rounded on the bits (`e4m3_round`: no fp8 convert
needed, so sm_80 works). In interpret mode they are bit-equal to the reference when both are
compiled with XLA's own CPU math (tests/kernels/test_compress_store_kernel.py: XLA:CPU otherwise
hands some reference fusions to YNNPACK, whose exp differs in the last bit). Compiled for a GPU,
an ulp can still differ where the orders of operations are the compiler's: the 512-channel sum
of squares of RMSNorm (a Triton tree vs XLA's row reduction), FMA contraction, and the libdevice
exp/rsqrt builds; an FP4 code flips only where a value sits on a rounding boundary. Not yet run
on a GPU. Preconditions: D, Dk and `rope_dim` powers of two, rope_dim <= Dk.

GPU lowering: Pallas-Triton, like the other kernels here (the row gathers and scattered stores are
vector-indexed ref accesses, which Mosaic GPU does not lower on jax 0.12; see sparse_attention).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from deepinfer.ops import quant
from deepinfer.ops.cache_codec import FLOAT
from deepinfer.pallas_kernels.linear import linear
from deepinfer.pallas_kernels.reference.compress_store import OP, check_args, entry_targets, next_pending, page_slots

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

_F32 = jnp.float32


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


# ---- in-kernel math (each step mirrors the reference's jnp op) -------------------------------


def _recip(x: jax.Array, interpret: bool) -> jax.Array:
    """`1 / x` rounded to nearest. The reference's divisions reach XLA as `a / broadcast(b)` and
    `a / constant`, which XLA's algebraic simplifier rewrites to `a * broadcast(1 / b)` and
    `a * fl(1 / c)`; the kernel writes those forms out (so it does not depend on whether its own
    code gets rewritten) and needs only IEEE reciprocals. Triton's fp32 `/` is the approximate
    div.full.f32, so the compiled kernel divides with div.rn.f32 through inline PTX."""
    one = jnp.ones(x.shape, _F32)
    if interpret:
        return one / x
    from jax.experimental.pallas import triton as pltr

    return pltr.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[one, x], constraints="=r,r,r", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, _F32)])[0]


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    """`layers.rms_norm`: fp32 mean of squares (XLA: sum times fl(1/n)), rsqrt, cast, then the
    weight in the input dtype."""
    xf = x.astype(_F32)
    mean = jnp.sum(xf * xf, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])
    y = (xf * jax.lax.rsqrt(mean + eps)).astype(dtype)
    return weight.astype(dtype)[None, :] * y


def _rope_halves(x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`layers.apply_rope` on rows `x [bt, W]`, returned as (even, odd) channels `[bt, W/2]`: the
    pairs (2i, 2i+1) of the last `2 * cos.shape[1]` channels rotate in fp32, the rest pass."""
    bt, w = x.shape
    half = cos.shape[1]
    even, odd = jax.lax.unstack(x.reshape(bt, w // 2, 2), axis=-1)
    shape = (bt, w // (2 * half), half)  # the last row of axis 1 is the rotated part
    e, o = even.reshape(shape), odd.reshape(shape)
    ef, of = e.astype(_F32), o.astype(_F32)
    c, s = cos[:, None, :], sin[:, None, :]
    rot = jax.lax.broadcasted_iota(jnp.int32, shape, 1) == shape[1] - 1
    even = jnp.where(rot, (ef * c - of * s).astype(x.dtype), e)
    odd = jnp.where(rot, (ef * s + of * c).astype(x.dtype), o)
    return even.reshape(bt, w // 2), odd.reshape(bt, w // 2)


def _interleave(even: jax.Array, odd: jax.Array) -> jax.Array:
    """(even, odd) channels `[bt, ..., n]` -> rows `[bt, 2 * n * ...]` in channel order."""
    bt = even.shape[0]
    return jax.lax.stack([even, odd], axis=even.ndim).reshape(bt, -1)


def e4m3_round(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`v.astype(float8_e4m3fn)` for fp32 `v >= 2^-9` (an FP4 block scale) from the bits:
    returns (the e4m3 value as fp32, its byte). Triton converts to fp8 only on sm_89+, and this
    also keeps XLA's overflow rule (from 464 up, and NaN, give NaN). Normal results round the
    fp32 mantissa to 3 bits, ties to even; below 2^-6 they are multiples of 2^-9 (subnormals),
    rounded to even by the 2^23 trick on `v * 512`."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    rounded = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
    normal = jax.lax.bitcast_convert_type(rounded, _F32)
    units = (v * 512.0 + 8388608.0) - 8388608.0  # multiples of 2^-9, ties to even
    small = v < 2.0 ** -6
    value = jnp.where(small, units * (1.0 / 512.0), normal)
    byte = jnp.where(small, units.astype(jnp.int32),
                     ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 7))
    bad = (normal > quant.FP8_E4M3_MAX) | jnp.isnan(v)
    return jnp.where(bad, jnp.nan, value).astype(_F32), jnp.where(bad, 0x7F, byte).astype(jnp.uint8)


def _fp4_halves(even: jax.Array, odd: jax.Array, block: int, e4m3_scales: bool, interpret: bool):
    """`quant._fp4_blocks` on rows given as (even, odd) channels `[bt, W/2]`: per `block`
    channels one scale; returns (even codes, odd codes) uint8 `[bt, W/block, block/2]`, the fp32
    scale `[bt, W/block]` and its stored byte (e4m3 or UE8M0 bits) as uint8."""
    bt, h = even.shape
    shape = (bt, 2 * h // block, block // 2)
    e, o = even.astype(_F32).reshape(shape), odd.astype(_F32).reshape(shape)
    amax = jnp.maximum(jnp.max(jnp.abs(e), axis=-1), jnp.max(jnp.abs(o), axis=-1))
    if e4m3_scales:
        scale, stored = e4m3_round(jnp.maximum(amax, quant._FP4_E4M3_AMAX_FLOOR) * np.float32(1.0 / quant.FP4_E2M1_MAX))
    else:
        exponent = quant.pow2_ceil_exponent(jnp.maximum(amax, quant._FP4_UE8M0_AMAX_FLOOR) * quant._INV_FP4_MAX)
        scale = quant.exp2_int(exponent)
        stored = (jnp.clip(exponent, -127, 127) + 127).astype(jnp.uint8)
    lim = quant.FP4_E2M1_MAX
    inv = _recip(scale, interpret)[..., None]
    codes = [quant.e2m1_codes(jnp.clip(v * inv, -lim, lim)) for v in (e, o)]
    return codes[0], codes[1], scale, stored


def _store_rows(ref, rows: jax.Array, dest: jax.Array, ok: jax.Array) -> None:
    """Masked scatter of rows `[bt, W]` into pool rows `dest [bt]` of `ref [N, W]` (the
    reference's `.at[...].set(mode="drop")`); masked-off lanes point one past the pool."""
    from jax.experimental.pallas import triton as pltr

    bt, w = rows.shape
    where = jnp.where(ok, dest, ref.shape[0])
    row_idx = jnp.broadcast_to(where[:, None], (bt, w))
    col_idx = jnp.broadcast_to(jax.lax.broadcasted_iota(jnp.int32, (1, w), 1), (bt, w))
    pltr.store(ref.at[row_idx, col_idx], rows.astype(ref.dtype), mask=jnp.broadcast_to(ok[:, None], (bt, w)))


def _encode_and_store(rows: jax.Array, cos, sin, dest, ok, pool_refs, *, block: int, e4m3_scales: bool,
                      packed: bool, fake_quant: bool, interpret: bool) -> None:
    """RoPE then the pool record of rows `[bt, W]` (compute dtype), stored at `dest`."""
    even, odd = _rope_halves(rows, cos, sin)
    if packed or fake_quant:
        ce, co, scale, stored = _fp4_halves(even, odd, block, e4m3_scales, interpret)
    if packed:
        codes_ref, scales_ref = pool_refs
        _store_rows(codes_ref, (ce | (co << 4)).reshape(rows.shape[0], -1), dest, ok)
        _store_rows(scales_ref, stored, dest, ok)
        return
    if fake_quant:  # quant.fake_quant_fp4: decoded codes times the scale, in the input dtype
        even = quant.e2m1_to_f32(ce) * scale[..., None]
        odd = quant.e2m1_to_f32(co) * scale[..., None]
    (float_ref,) = pool_refs
    _store_rows(float_ref, _interleave(even, odd).astype(rows.dtype), dest, ok)


# ---- kernels -----------------------------------------------------------------------------------


def _entries_kernel(*refs, ratio: int, n_tokens: int, block_t: int, eps: float, dtype, n_pool: int,
                    packed: bool, fake_quant: bool, interpret: bool):
    if ratio == 2:
        kv_ref, gate_ref, held_ref, norm_ref, cos_ref, sin_ref, dest_ref, *rest = refs
    else:
        kv_ref, norm_ref, cos_ref, sin_ref, dest_ref, *rest = refs
    pool_refs = rest[n_pool + 1:]  # after the aliased pool inputs and the latent output
    latent_ref = rest[n_pool]
    t = pl.program_id(1) * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    cur = jnp.minimum(t, n_tokens - 1)
    x = kv_ref[cur, :]
    if ratio == 2:
        # the token before (the held pending token before the first), then the reference's
        # jax.nn.softmax over the pair and jnp.sum of the gated pair, the pair on a (last) axis
        first = (t == 0)[:, None]
        prev = jnp.maximum(cur - 1, 0)
        kv_p = jnp.where(first, held_ref[0, :][None, :], kv_ref[prev, :])
        g_p = jnp.where(first, held_ref[1, :][None, :], gate_ref[prev, :])
        g = jax.lax.stack([g_p, gate_ref[cur, :]], axis=2)  # [bt, D, 2]
        e = jnp.exp(g - jnp.max(g, axis=2, keepdims=True))
        w = e * _recip(jnp.sum(e, axis=2, keepdims=True), interpret)
        x = jnp.sum(jax.lax.stack([kv_p, x], axis=2) * w, axis=2).astype(dtype)
    latent = _rms_norm(x, norm_ref[...], eps, dtype)
    latent_ref[...] = latent
    dest = dest_ref[...]
    ok = (t < n_tokens) & (dest >= 0)  # lanes past the row end load no defined dest on a GPU
    _encode_and_store(latent, cos_ref[...], sin_ref[...], dest, ok, pool_refs, block=quant.KV_FP4_BLOCK,
                      e4m3_scales=True, packed=packed, fake_quant=fake_quant, interpret=interpret)


def _keys_kernel(k_ref, k_norm_ref, cos_ref, sin_ref, dest_ref, *refs, n_tokens: int, block_t: int, eps: float,
                 dtype, n_pool: int, packed: bool, fake_quant: bool, interpret: bool):
    pool_refs = refs[n_pool:]
    t = pl.program_id(1) * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    keys = _rms_norm(k_ref[...], k_norm_ref[...], eps, dtype)
    dest = dest_ref[...]
    ok = (t < n_tokens) & (dest >= 0)
    _encode_and_store(keys, cos_ref[...], sin_ref[...], dest, ok, pool_refs, block=quant.INDEX_FP4_BLOCK,
                      e4m3_scales=False, packed=packed, fake_quant=fake_quant, interpret=interpret)


# ---- wrappers ----------------------------------------------------------------------------------


def _flat_pool(pool: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`[P, per_page, W]` arrays as `[P * per_page, W]`, fp8 scales as their bytes (uint8)."""
    out = []
    for a in pool:
        if a.dtype != jnp.uint8 and jnp.dtype(a.dtype).itemsize == 1:
            a = jax.lax.bitcast_convert_type(a, jnp.uint8)
        out.append(a.reshape(a.shape[0] * a.shape[1], a.shape[2]))
    return tuple(out)


def _unflat_pool(flat, like: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    out = []
    for a, ref in zip(flat, like):
        a = a.reshape(ref.shape)
        if a.dtype != ref.dtype:
            a = jax.lax.bitcast_convert_type(a, ref.dtype)
        out.append(a)
    return tuple(out)


def _params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltr

    return {"compiler_params": pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def _block_t(block_t: int | None, width: int, n_tokens: int) -> int:
    bt = block_t or max(1, 4096 // width)  # about 16 KiB of fp32 per operand tile
    return max(1, min(_pow2_at_least(bt), _pow2_at_least(n_tokens)))


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "dtype", "packed", "fake_quant", "interpret",
                                             "block_t", "num_warps", "num_stages"))
def entries_pallas(kv, gate, held, norm, cos, sin, dest, pool, *, ratio: int, eps: float, dtype, packed: bool,
                   fake_quant: bool, interpret: bool = False, block_t: int | None = None,
                   num_warps: int | None = None, num_stages: int = 1):
    """Kernel 1: per-token latents `[B, T, D]` (dtype) and the entry pool with the emitted rows
    (`dest [B, T]` flat pool row, -1 = none) written in place. `held [B, 2, D]` fp32 (ratio 2)."""
    B, T, D = kv.shape
    bt = _block_t(block_t, D, T)
    flat = _flat_pool(pool)
    n_pool = len(flat)
    tokens = [kv, gate, held] if ratio == 2 else [kv]
    row = lambda b, j: (b, 0, 0)  # noqa: E731
    token_specs = [pl.BlockSpec((None, T, D), row)] * (2 if ratio == 2 else 1)
    if ratio == 2:
        token_specs.append(pl.BlockSpec((None, 2, D), row))
    half = cos.shape[-1]
    in_specs = [*token_specs, pl.BlockSpec((D,), lambda b, j: (0,)),
                pl.BlockSpec((None, bt, half), lambda b, j: (b, j, 0)),
                pl.BlockSpec((None, bt, half), lambda b, j: (b, j, 0)),
                pl.BlockSpec((None, bt), lambda b, j: (b, j)),
                *[pl.BlockSpec(a.shape, lambda b, j: (0, 0)) for a in flat]]
    out_specs = [pl.BlockSpec((None, bt, D), lambda b, j: (b, j, 0)),
                 *[pl.BlockSpec(a.shape, lambda b, j: (0, 0)) for a in flat]]
    out_shape = [jax.ShapeDtypeStruct((B, T, D), dtype), *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]]
    first_pool = len(tokens) + 4
    kernel = functools.partial(_entries_kernel, ratio=ratio, n_tokens=T, block_t=bt, eps=float(eps),
                               dtype=dtype, n_pool=n_pool, packed=packed, fake_quant=fake_quant, interpret=interpret)
    latent, *out = pl.pallas_call(
        kernel, grid=(B, pl.cdiv(T, bt)), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={first_pool + i: 1 + i for i in range(n_pool)}, interpret=interpret,
        name="compress_store_entries", **_params(interpret, num_warps or (8 if D >= 512 else 4), num_stages),
    )(*tokens, norm, cos, sin, dest, *flat)
    return latent, _unflat_pool(out, pool)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "packed", "fake_quant", "interpret", "block_t",
                                             "num_warps", "num_stages"))
def keys_pallas(k, k_norm, cos, sin, dest, pool, *, eps: float, dtype, packed: bool, fake_quant: bool,
                interpret: bool = False, block_t: int | None = None, num_warps: int = 4, num_stages: int = 1):
    """Kernel 2: indexer keys from the projected latents `k [B, T, Dk]` into the key pool."""
    B, T, Dk = k.shape
    bt = _block_t(block_t, Dk, T)
    flat = _flat_pool(pool)
    n_pool = len(flat)
    half = cos.shape[-1]
    in_specs = [pl.BlockSpec((None, bt, Dk), lambda b, j: (b, j, 0)), pl.BlockSpec((Dk,), lambda b, j: (0,)),
                pl.BlockSpec((None, bt, half), lambda b, j: (b, j, 0)),
                pl.BlockSpec((None, bt, half), lambda b, j: (b, j, 0)),
                pl.BlockSpec((None, bt), lambda b, j: (b, j)),
                *[pl.BlockSpec(a.shape, lambda b, j: (0, 0)) for a in flat]]
    out_specs = [pl.BlockSpec(a.shape, lambda b, j: (0, 0)) for a in flat]
    out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
    kernel = functools.partial(_keys_kernel, n_tokens=T, block_t=bt, eps=float(eps), dtype=dtype, n_pool=n_pool,
                               packed=packed, fake_quant=fake_quant, interpret=interpret)
    out = pl.pallas_call(
        kernel, grid=(B, pl.cdiv(T, bt)), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={5 + i: i for i in range(n_pool)}, interpret=interpret,
        name="compress_store_keys", **_params(interpret, num_warps, num_stages),
    )(k, k_norm, cos, sin, dest, *flat)
    return _unflat_pool(out, pool)


def _check_widths(D: int, Dk: int, rope_dim: int) -> None:
    if not (_pow2(D) and _pow2(Dk) and _pow2(rope_dim)) or rope_dim > Dk or rope_dim > D:
        raise ValueError(f"compress_store kernel: head dim {D}, index head dim {Dk} and rope dim {rope_dim} "
                         "must be powers of two with rope dim <= both (Triton block shapes)")
    if D % quant.KV_FP4_BLOCK or Dk % quant.INDEX_FP4_BLOCK:
        raise ValueError(f"compress_store kernel: widths {D}, {Dk} must be multiples of the FP4 blocks")


def compress_store_pallas(kv, gate, positions, valid, page_table, entries, index_keys, pending=None, slots=None,
                          last_index=None, *, ratio: int, norm, wk, k_norm, inv_freq, eps: float, dtype, storage: str,
                          fake_quant: bool, interpret: bool = False, block_t: int | None = None,
                          num_warps: int | None = None):
    """Same contract as the reference `compress_store`; `interpret=True` runs the kernels in the
    Pallas interpreter (any platform), otherwise they lower through Pallas-Triton."""
    check_args(kv, gate, pending, slots, last_index, entries, ratio, storage)
    D = kv.shape[-1]
    Dk = k_norm.shape[-1]
    _check_widths(D, Dk, 2 * len(inv_freq))
    packed = storage != FLOAT
    emit, entry_idx, entry_pos = entry_targets(positions, valid, ratio)
    per_page, num_pages = entries[0].shape[1], entries[0].shape[0]
    page, offset = page_slots(page_table, entry_idx, emit, per_page, num_pages)
    dest = jnp.where(page < num_pages, page * per_page + offset, -1).astype(jnp.int32)
    angles = entry_pos.astype(_F32)[..., None] * jnp.asarray(inv_freq)  # as layers.apply_rope
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    held = None
    if ratio == 2:
        held = pending[slots]
        pending = next_pending(kv, gate, held, pending, slots, positions, last_index)
    latent_dtype = kv.dtype if ratio == 1 else dtype  # the reference's latent dtype
    kw = dict(eps=eps, dtype=jnp.dtype(latent_dtype), packed=packed, fake_quant=fake_quant, interpret=interpret,
              block_t=block_t)
    latent, entries = entries_pallas(kv, gate, held, norm, cos, sin, dest, tuple(entries), ratio=ratio,
                                     num_warps=num_warps, **kw)
    index_keys = keys_pallas(linear(latent, wk), k_norm, cos, sin, dest, tuple(index_keys), **kw)
    return entries, index_keys, pending


# ---- registry entries -----------------------------------------------------------------------

from deepinfer.pallas_kernels.registry import GPU_TRITON, INTERPRET, register  # noqa: E402


@register(OP, GPU_TRITON, why="Pallas-Triton: pooling+RMSNorm+RoPE+FP4 pack fused, scattered in place into the pages")
def compress_store_triton(*args, **kwargs):
    return compress_store_pallas(*args, **kwargs)


@register(OP, INTERPRET, why="the Pallas kernels run by the Pallas interpreter (slow; tests)")
def compress_store_interpret(*args, **kwargs):
    return compress_store_pallas(*args, **kwargs, interpret=True)
