"""A weight kept in its checkpoint format (`QuantWeight`), its storage kinds, and dense
reconstruction. Shared by the model (params, loading) and the kernels (which consume the format)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

from deepinfer.ops import quant

FP8 = "fp8"  # float8_e4m3fn [out, in] + float8_e8m0fnu scale per weight block (32x32 in V4.1)
FP8_ROWS = "fp8_rows"  # Engram tables: e4m3 rows with one e8m0 scale per 1x32 block
FP4 = "fp4"  # routed experts: int8 [out, in/2] packed e2m1 (even k low nibble) + e8m0 scale per 1x32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantWeight:
    """A weight kept in its checkpoint format. `kind` is FP8, FP8_ROWS or FP4 (static)."""

    q: jax.Array
    scale: jax.Array
    kind: str = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))


def dequantize(w, dtype) -> jax.Array:
    """A dense array of `dtype` from a plain array or a checkpoint-format `QuantWeight`."""
    if not isinstance(w, QuantWeight):
        return w.astype(dtype)
    if w.kind in (FP8, FP8_ROWS):
        return quant.dequantize_fp8_blocks(w.q, w.scale, block=w.block, xp=jax.numpy).astype(dtype)
    if w.kind == FP4:
        return quant.dequantize_mxfp4(w.q, w.scale, block=w.block[1], xp=jax.numpy).astype(dtype)
    raise ValueError(f"unknown quantized weight kind {w.kind!r}")
