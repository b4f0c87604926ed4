"""Pallas kernels for the two matmul hot ops on checkpoint-format weights, dequantizing each
weight tile inside the kernel instead of materialising the dense weight in HBM.

Semantics are those of `reference/matmul.py` (the oracles). Both kernels lower through
Pallas-Triton (`pallas.triton.CompilerParams`), like `sparse_attention`; the in-kernel row
gathers of the MoE kernel are vector-indexed loads, which the Mosaic GPU lowering of jax 0.12
rejects (see `sparse_attention.py`).

`fp8_block_matmul` (x `[M, K]` @ e4m3 `[N, K]`^T with one UE8M0 scale per `(bn, bk)` block):

* grid `(M / tm, N / tn)`, a loop over K in steps of `tk` that either hold whole scale blocks
  (`bk` a power of two below `tk`, e.g. V4.1's 32 x 32) or lie inside one (`tk` divides `bk`).
  A step's scales are gathered per row from the unexpanded scale array by row block,
  `scale[(n0 + r) // bn, k0 // bk ...]`, and repeated over their `bk` columns in registers.
* The tile is dequantized as the reference does (e4m3 -> fp32, times `2^(s - 127)`, then the
  activation dtype; exact in bf16 too, since e4m3 times a power of two fits bf16's 8-bit
  mantissa and fp32's exponent range), and accumulated in fp32 by `dot`. Triton converts
  float8_e4m3fn only on sm_89+; below that the registry's kernel decodes the e4m3 bytes with
  integer ops (`decode_bits`, bit-identical values).

`moe_experts_mxfp4` (routed experts with MXFP4 weights), in three steps:

1. Routing -> schedule (XLA, O(N k)): the (token, choice) pairs are sorted by expert (stable),
   and each expert's group is padded to a multiple of `tm` rows, so every row tile belongs to
   one expert (the vLLM `moe_align_block_size` layout): per padded row the token it reads
   and its routing weight, per tile its expert (`E` for tiles past the end), per pair its
   padded row. The grid has a static bound of tiles, `min(P, (P + E (tm - 1)) // tm)` for
   `P = N k` pairs; tiles past the end do nothing.
2. `gate_up` kernel, grid `(tiles, F / tn)`: gathers the tile's token rows of x **inside the
   kernel** (no sorted copy of the activations), dequantizes the expert's w1 and w3 tiles
   (unpack two e2m1 codes per byte, decode them arithmetically, times the UE8M0 scale of
   each 32 along K), two fp32 dots per K step; epilogue: round gate/up to the activation
   dtype (the reference's einsum output dtype), DeepSeek's clamps, SwiGLU, times the routing
   weight -> `h` in the activation dtype.
3. `down` kernel, grid `(tiles, D / tn)`: `h` tile @ the expert's dequantized w2 tile ->
   per-pair outputs in the activation dtype (the reference's einsum output dtype); XLA then
   gathers each pair's row (the unsort) and sums a token's k rows in fp32.

Triton shape rules: every loaded tile dimension is a power of two and every `dot` operand
dimension is at least 16. The FP8 wrapper zero-pads M, and N/K only when no power-of-two tile
of at least 16 divides them (never for the model's shapes, so no copy of the weight); MXFP4
dimensions are multiples of 32, so the MoE kernels never pad a weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer.ops import quant
from deepinfer.pallas_kernels.sparse_attention import _MIN_DOT, _pad_axis, _pow2_at_least

MXFP4_BLOCK = 32  # one UE8M0 scale per 32 values along K (OCP MX)


# ---- in-kernel decoding ----------------------------------------------------------------------


def _e8m0_to_f32(u8: jax.Array) -> jax.Array:
    """UE8M0 bytes -> fp32 `2^(s - 127)`, exactly as `quant.e8m0_to_float32`: byte 0 is the
    subnormal 2^-127, byte 255 NaN. Built from the IEEE bits (no exp2)."""
    u = u8.astype(jnp.int32)
    bits = jnp.where(u == 0, 0x400000, u << 23)
    bits = jnp.where(u == 255, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _e4m3_bits_to_f32(u8: jax.Array) -> jax.Array:
    """Raw e4m3fn bytes -> fp32 by integer ops (sign bit 7, exponent bits 6-3 with bias 7,
    mantissa bits 2-0; exponent 0 is subnormal `m 2^-9`; 0x7F/0xFF are NaN): the e4m3 decode
    for GPUs below sm_89, where Triton has no float8_e4m3fn conversion."""
    u = u8.astype(jnp.int32) & 0xFF
    e = (u >> 3) & 0xF
    m = u & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 2.0 ** -9, normal)
    mag = jnp.where((u & 0x7F) == 0x7F, jnp.nan, mag)
    return jnp.where(u >= 0x80, -mag, mag)


def _mxfp4_tile(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Packed bytes `[R, C/2]` (int8, low nibble = even column) and UE8M0 scales `[R, C/32]`
    -> the dequantized tile `[R, C]` in `dtype` (through fp32, as the reference)."""
    rows, half = packed.shape
    b = packed.astype(jnp.int32) & 0xFF
    codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(rows, 2 * half)  # interleave (tl.join)
    n_s = scale.shape[1]
    s = _e8m0_to_f32(scale)
    s = jnp.broadcast_to(s[:, :, None], (rows, n_s, MXFP4_BLOCK)).reshape(rows, 2 * half)
    return (quant.e2m1_to_f32(codes) * s).astype(dtype)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a `[M, K]` . b `[N, K]`^T -> fp32 `[M, N]` (full fp32 precision for fp32 inputs)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltr

    return {"compiler_params": pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n (1 for odd n)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _as_bytes(a: jax.Array, what: str) -> jax.Array:
    """An 8-bit float array as raw uint8 (a free bitcast; Triton has no e8m0 type)."""
    if a.dtype == jnp.uint8:
        return a
    if a.dtype.itemsize != 1:
        raise TypeError(f"{what} must be an 8-bit type, got {a.dtype}")
    return jax.lax.bitcast_convert_type(a, jnp.uint8)


# ---- fp8_block_matmul ------------------------------------------------------------------------


def _fp8_kernel(x_ref, q_ref, s_ref, o_ref, *, tk: int, bn: int, bk: int, n_k: int, n_scale_rows: int,
                decode_bits: bool):
    tn = q_ref.shape[0]
    dt = x_ref.dtype
    rows = pl.program_id(1) * tn + jnp.arange(tn, dtype=jnp.int32)
    srow = jnp.minimum(rows // bn, n_scale_rows - 1)  # padded rows (zero weights) reuse the last

    n_sc = max(1, tk // bk)  # scale columns per K step

    def step(k, acc):
        start = pl.multiple_of(k * tk, tk)
        x = x_ref[:, pl.ds(start, tk)]
        if n_sc == 1:  # the step lies inside one scale block: one scale per row, [tn, 1]
            s = _e8m0_to_f32(s_ref[srow, pl.ds((k * tk) // bk, 1)])
        else:  # n_sc whole blocks: [tn, n_sc] scales, each repeated over its bk columns
            s = _e8m0_to_f32(s_ref[srow, pl.ds(k * n_sc, n_sc)])
            s = jnp.broadcast_to(s[:, :, None], (tn, n_sc, bk)).reshape(tn, tk)
        q = q_ref[:, pl.ds(start, tk)]
        q = _e4m3_bits_to_f32(q) if decode_bits else q.astype(jnp.float32)
        w = (q * s).astype(dt)
        return acc + _dot_nt(x, w)

    acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block", "interpret", "decode_bits", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages"))
def fp8_block_matmul_pallas(x: jax.Array, q: jax.Array, scale: jax.Array, block: tuple[int, int], *,
                            interpret: bool = False, decode_bits: bool = False, block_m: int = 64,
                            block_n: int = 128, block_k: int = 128, num_warps: int = 4,
                            num_stages: int = 3) -> jax.Array:
    """Same contract as the reference `fp8_block_matmul` on `QuantWeight(q, scale, block)`:
    x `[..., K]` -> `[..., N]` in x's dtype, fp32 accumulation. `interpret=True` runs the kernel
    with the Pallas interpreter (any platform), otherwise it lowers through Pallas-Triton.

    Tiles: `tm <= block_m` rows of x, `tn <= block_n` weight rows, `tk <= block_k` columns per
    K step: several whole scale blocks when `bk` is a smaller power of two (V4.1's 32 x 32),
    else a power-of-two divisor of `bk` (at least 16, or an error). 128 x 128 e4m3 + 64 x 128
    bf16 per stage keeps 3 stages in shared memory.
    `decode_bits=True` decodes e4m3 from its bytes with integer ops (identical values) instead
    of Triton's float8 conversion, which needs sm_89+."""
    *lead, K = x.shape
    N = q.shape[0]
    bn, bk = (int(b) for b in block)
    if q.shape[1] != K:
        raise ValueError(f"fp8_block_matmul: x has K={K}, weight {tuple(q.shape)}")
    if q.dtype == jnp.uint8:
        q = jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn)
    if q.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"fp8_block_matmul: weight must be float8_e4m3fn (or raw uint8), got {q.dtype}")
    want = (-(-N // bn), -(-K // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_block_matmul: scale {tuple(scale.shape)} does not fit weight {tuple(q.shape)} "
                         f"with block {(bn, bk)}: expected {want}")
    tk = _pow2_at_least(block_k)
    if bk & (bk - 1) == 0:  # power-of-two block: steps of tk, several blocks per step if bk < tk
        tk = min(tk, max(_pow2_at_least(K), bk))
    else:  # a step must lie inside one block
        tk = _pow2_divisor(bk, tk)
        if tk < _MIN_DOT:
            raise ValueError(f"fp8_block_matmul kernel: a scale block along K ({bk}) that is not a power of two "
                             f"must be a multiple of {_MIN_DOT} (Triton's smallest dot)")
    xm = x.reshape(-1, K)
    M = xm.shape[0]
    if M == 0:
        return jnp.zeros((*lead, N), x.dtype)
    tm = min(_pow2_at_least(block_m), _pow2_at_least(M))
    tn = _pow2_divisor(N, _pow2_at_least(block_n))  # a divisor of N: no padded copy of the weight
    if tn < _MIN_DOT:
        tn = min(_pow2_at_least(block_n), _pow2_at_least(N))
    m_pad, n_pad, k_pad = (-(-d // t) * t for d, t in ((M, tm), (N, tn), (K, tk)))
    xm = _pad_axis(_pad_axis(xm, 0, m_pad), 1, k_pad)
    qp = _pad_axis(_pad_axis(q, 0, n_pad), 1, k_pad)  # no copy when the shape is aligned
    if decode_bits:
        qp = jax.lax.bitcast_convert_type(qp, jnp.uint8)
    sb = _as_bytes(scale, "fp8_block_matmul scale")
    if tk > bk:  # whole scale columns per step: pad the columns of the padded K (zero weights there)
        sb = _pad_axis(sb, 1, k_pad // bk, value=127)

    kernel = functools.partial(_fp8_kernel, tk=tk, bn=bn, bk=bk, n_k=k_pad // tk, n_scale_rows=want[0],
                               decode_bits=decode_bits)
    out = pl.pallas_call(
        kernel,
        grid=(m_pad // tm, n_pad // tn),
        in_specs=[
            pl.BlockSpec((tm, k_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((tn, k_pad), lambda i, j: (j, 0)),
            pl.BlockSpec(sb.shape, lambda i, j: (0, 0)),  # all scales; rows gathered in the kernel
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), x.dtype),
        interpret=interpret,
        name="fp8_block_matmul",
        **_compiler_params(interpret, num_warps, num_stages),
    )(xm, qp, sb)
    return out[:M, :N].reshape(*lead, N)


# ---- moe_experts_mxfp4 -----------------------------------------------------------------------


def moe_schedule(ids: jax.Array, weights: jax.Array, n_experts: int, tm: int):
    """Routing `[N, k]` -> the grouped-matmul layout (see the module docstring):
    `(row_token [R], row_weight [R], tile_expert [T], pair_row [N*k])` with `R = T * tm`.
    Padding rows read token `N` (masked to row 0 in the kernel) with weight 0; unused tiles
    have expert `E`; pairs with an id outside `[0, E)` get row `R` (dropped)."""
    n, k = ids.shape
    P = n * k
    E = n_experts
    T = max(1, min(P, (P + E * (tm - 1)) // tm))
    R = T * tm
    e = ids.reshape(-1).astype(jnp.int32)
    e = jnp.where((e >= 0) & (e < E), e, E)
    token = jnp.arange(P, dtype=jnp.int32) // k
    order = jnp.argsort(e, stable=True)
    e_sorted = e[order]
    sizes = jnp.zeros((E + 1,), jnp.int32).at[e].add(1)
    starts = jnp.cumsum(sizes) - sizes  # unpadded group starts in the sorted order
    padded = -(-sizes[:E] // tm) * tm
    pends = jnp.cumsum(padded)
    pstarts = pends - padded
    rank = jnp.arange(P, dtype=jnp.int32) - starts[e_sorted]
    row_sorted = jnp.where(e_sorted < E, pstarts[jnp.minimum(e_sorted, E - 1)] + rank, R)
    row_token = jnp.full((R,), n, jnp.int32).at[row_sorted].set(token[order], mode="drop")
    row_weight = jnp.zeros((R,), jnp.float32).at[row_sorted].set(
        weights.reshape(-1).astype(jnp.float32)[order], mode="drop")
    pair_row = jnp.zeros((P,), jnp.int32).at[order].set(row_sorted)
    tile_start = jnp.arange(T, dtype=jnp.int32) * tm
    tile_expert = jnp.searchsorted(pends, tile_start, side="right").astype(jnp.int32)  # E: unused
    return row_token, row_weight, tile_expert, pair_row


def _gate_up_kernel(te_ref, tok_ref, rw_ref, x_ref, q1_ref, s1_ref, q3_ref, s3_ref, h_ref, *,
                    n_tokens: int, n_experts: int, tk: int, n_k: int, limit: float):
    e = te_ref[0]
    tm, tn = h_ref.shape
    n0 = pl.multiple_of(pl.program_id(1) * tn, tn)  # outside the `when`: the interpreter needs it there

    @pl.when(e < n_experts)
    def _():
        dt = x_ref.dtype
        tok = tok_ref[...]
        rows = jnp.where(tok < n_tokens, tok, 0)  # padding rows read row 0; weight 0, never used

        def step(kk, carry):
            g, u = carry
            k0 = pl.multiple_of(kk * tk, tk)
            kb = pl.multiple_of(kk * (tk // 2), tk // 2)
            ks = kk * (tk // MXFP4_BLOCK)
            x = x_ref[rows, pl.ds(k0, tk)]  # in-kernel gather of the tile's tokens, [tm, tk]
            w1 = _mxfp4_tile(q1_ref[e, pl.ds(n0, tn), pl.ds(kb, tk // 2)],
                             s1_ref[e, pl.ds(n0, tn), pl.ds(ks, tk // MXFP4_BLOCK)], dt)
            w3 = _mxfp4_tile(q3_ref[e, pl.ds(n0, tn), pl.ds(kb, tk // 2)],
                             s3_ref[e, pl.ds(n0, tn), pl.ds(ks, tk // MXFP4_BLOCK)], dt)
            return g + _dot_nt(x, w1), u + _dot_nt(x, w3)

        zero = jnp.zeros((tm, tn), jnp.float32)
        g, u = jax.lax.fori_loop(0, n_k, step, (zero, zero))
        # the reference's einsums return the activation dtype: round there before the SwiGLU
        g = g.astype(dt).astype(jnp.float32)
        u = u.astype(dt).astype(jnp.float32)
        if limit > 0:
            u = jnp.clip(u, -limit, limit)
            g = jnp.minimum(g, limit)
        h = jax.nn.silu(g) * u * rw_ref[...][:, None]
        h_ref[...] = h.astype(h_ref.dtype)


def _down_kernel(te_ref, h_ref, q2_ref, s2_ref, y_ref, *, n_experts: int, tk: int, n_k: int):
    e = te_ref[0]
    tm, tn = y_ref.shape
    n0 = pl.multiple_of(pl.program_id(1) * tn, tn)

    @pl.when(e < n_experts)
    def _():

        def step(kk, acc):
            k0 = pl.multiple_of(kk * tk, tk)
            kb = pl.multiple_of(kk * (tk // 2), tk // 2)
            h = h_ref[:, pl.ds(k0, tk)]
            w2 = _mxfp4_tile(q2_ref[e, pl.ds(n0, tn), pl.ds(kb, tk // 2)],
                             s2_ref[e, pl.ds(n0, tn), pl.ds(kk * (tk // MXFP4_BLOCK), tk // MXFP4_BLOCK)],
                             h.dtype)
            return acc + _dot_nt(h, w2)

        acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((tm, tn), jnp.float32))
        y_ref[...] = acc.astype(y_ref.dtype)


def _check_mxfp4(name: str, q: jax.Array, s: jax.Array, E: int, out: int, inner: int) -> None:
    if tuple(q.shape) != (E, out, inner // 2) or tuple(s.shape) != (E, out, inner // MXFP4_BLOCK):
        raise ValueError(f"moe_experts_mxfp4: {name} q {tuple(q.shape)} / scale {tuple(s.shape)} do not fit "
                         f"[{E}, {out}, {inner}] with one scale per {MXFP4_BLOCK}")


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "interpret", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages"))
def moe_experts_mxfp4_pallas(x: jax.Array, weights: jax.Array, ids: jax.Array, w1q: jax.Array, w1s: jax.Array,
                             w3q: jax.Array, w3s: jax.Array, w2q: jax.Array, w2s: jax.Array, swiglu_limit: float,
                             *, interpret: bool = False, block_m: int | None = None, block_n: int = 64,
                             block_k: int = 128, num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """Same contract as the reference `moe_experts_mxfp4` with the experts as arrays: w1/w3
    `q` int8 `[E, F, D/2]`, `scale` UE8M0 `[E, F, D/32]`; w2 `[E, D, F/2]` / `[E, D, F/32]`.
    -> `[N, D]` fp32. `block_m` (rows per tile) defaults to the mean pairs per expert, clamped
    to [16, 64]: decode batches put a few tokens on each expert, and padding a group to 64 rows
    would multiply the MMA work. `block_n` 64: the gate/up kernel holds two dequantized weight
    tiles and two fp32 accumulators at once."""
    N, D = x.shape
    k = ids.shape[1]
    E, F = w1q.shape[0], w1q.shape[1]
    if D % MXFP4_BLOCK or F % MXFP4_BLOCK:
        raise ValueError(f"moe_experts_mxfp4: D={D} and F={F} must be multiples of {MXFP4_BLOCK}")
    _check_mxfp4("w1", w1q, w1s, E, F, D)
    _check_mxfp4("w3", w3q, w3s, E, F, D)
    _check_mxfp4("w2", w2q, w2s, E, D, F)
    if N == 0 or k == 0:
        return jnp.zeros((N, D), jnp.float32)
    P = N * k
    tm = block_m or min(64, _pow2_at_least(-(-P // E)))
    tm = _pow2_at_least(tm)
    row_token, row_weight, tile_expert, pair_row = moe_schedule(ids, weights, E, tm)
    T = tile_expert.shape[0]
    R = T * tm
    dt = x.dtype
    w1s, w3s, w2s = (_as_bytes(s, "moe_experts_mxfp4 scale") for s in (w1s, w3s, w2s))

    # gate/up: K = D, outputs F
    tk1 = _pow2_divisor(D, _pow2_at_least(block_k, MXFP4_BLOCK))
    tn1 = _pow2_divisor(F, _pow2_at_least(block_n))
    full3 = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0, 0, 0))  # noqa: E731 (expert chosen in-kernel)
    gate_up = functools.partial(_gate_up_kernel, n_tokens=N, n_experts=E, tk=tk1, n_k=D // tk1,
                                limit=float(swiglu_limit))
    h = pl.pallas_call(
        gate_up,
        grid=(T, F // tn1),
        in_specs=[
            pl.BlockSpec((1,), lambda t, j: (t,)),  # tile expert
            pl.BlockSpec((tm,), lambda t, j: (t,)),  # row tokens
            pl.BlockSpec((tm,), lambda t, j: (t,)),  # row routing weights
            pl.BlockSpec((N, D), lambda t, j: (0, 0)),  # x, rows gathered in the kernel
            full3(w1q), full3(w1s), full3(w3q), full3(w3s),
        ],
        out_specs=pl.BlockSpec((tm, tn1), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((R, F), dt),
        interpret=interpret,
        name="moe_mxfp4_gate_up",
        **_compiler_params(interpret, num_warps, num_stages),
    )(tile_expert, row_token, row_weight, x, w1q, w1s, w3q, w3s)

    # down: K = F, outputs D
    tk2 = _pow2_divisor(F, _pow2_at_least(block_k, MXFP4_BLOCK))
    tn2 = _pow2_divisor(D, _pow2_at_least(block_n))
    down = functools.partial(_down_kernel, n_experts=E, tk=tk2, n_k=F // tk2)
    y = pl.pallas_call(
        down,
        grid=(T, D // tn2),
        in_specs=[
            pl.BlockSpec((1,), lambda t, j: (t,)),
            pl.BlockSpec((tm, F), lambda t, j: (t, 0)),
            full3(w2q), full3(w2s),
        ],
        out_specs=pl.BlockSpec((tm, tn2), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((R, D), dt),
        interpret=interpret,
        name="moe_mxfp4_down",
        **_compiler_params(interpret, num_warps, num_stages),
    )(tile_expert, h, w2q, w2s)

    # unsort + combine: each pair's output row (rows of unused tiles are never read)
    pairs = jnp.take(y, pair_row, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    return jnp.sum(pairs.reshape(N, k, D), axis=1)


# ---- registry entries -----------------------------------------------------------------------

from deepinfer.pallas_kernels.registry import GPU_TRITON, INTERPRET, platform_info, register  # noqa: E402


def _fp8(x, w, interpret: bool):
    # Triton converts float8_e4m3fn only on sm_89+ (jax's Pallas-Triton lowering refuses it
    # below); older GPUs decode the bytes with integer ops instead.
    cc = platform_info().compute_capability
    decode_bits = not interpret and cc is not None and cc < 89
    return fp8_block_matmul_pallas(x, w.q, w.scale, tuple(w.block), interpret=interpret, decode_bits=decode_bits)


def _mxfp4(x, weights, ids, w1, w3, w2, swiglu_limit, interpret: bool):
    for w in (w1, w3, w2):
        if w.block[1] != MXFP4_BLOCK:
            raise ValueError(f"moe_experts_mxfp4 kernel: MXFP4 has one scale per {MXFP4_BLOCK} along K, "
                             f"got block {w.block}")
    return moe_experts_mxfp4_pallas(x, weights, ids, w1.q, w1.scale, w3.q, w3.scale, w2.q, w2.scale,
                                    float(swiglu_limit), interpret=interpret)


@register("fp8_block_matmul", GPU_TRITON,
          why="Pallas-Triton kernel: FP8 weight tiles dequantized in the kernel (UE8M0 per block), fp32 accumulation")
def fp8_block_matmul_triton(x, w):
    return _fp8(x, w, interpret=False)


@register("fp8_block_matmul", INTERPRET, why="the Pallas kernel run by the Pallas interpreter (slow; tests)")
def fp8_block_matmul_interpret(x, w):
    return _fp8(x, w, interpret=True)


@register("moe_experts_mxfp4", GPU_TRITON,
          why="Pallas-Triton grouped matmul: tokens sorted by expert, MXFP4 tiles dequantized in the kernel")
def moe_experts_mxfp4_triton(x, weights, ids, w1, w3, w2, swiglu_limit):
    return _mxfp4(x, weights, ids, w1, w3, w2, swiglu_limit, interpret=False)


@register("moe_experts_mxfp4", INTERPRET, why="the Pallas kernels run by the Pallas interpreter (slow; tests)")
def moe_experts_mxfp4_interpret(x, weights, ids, w1, w3, w2, swiglu_limit):
    return _mxfp4(x, weights, ids, w1, w3, w2, swiglu_limit, interpret=True)
