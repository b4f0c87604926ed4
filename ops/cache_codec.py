"""How KV-cache rows are stored: the codec of the window ring ("window": FP8 e4m3 + UE8M0 per 32),
compressed entries ("entry": FP4 e2m1 + e4m3 per 16) and indexer keys ("index": FP4 + UE8M0 per
32), or the compute dtype as is (`FLOAT`, for exact float runs). Shared by the model's cache and the
kernels that write it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.ops import quant

FLOAT = "float"
PACKED = "packed"


def encode(kind: str, x: jax.Array, storage: str) -> tuple[jax.Array, ...]:
    """Rows `[..., width]` of `kind` ("window", "entry" or "index") -> the stored arrays."""
    if storage == FLOAT:
        return (x,)
    if kind == "window":
        return quant.pack_fp8_blocks(x, 32)
    if kind == "entry":
        return quant.pack_fp4_kv(x, 16)
    return quant.pack_fp4_index(x, 32)


def decode(kind: str, rows: tuple[jax.Array, ...], dtype) -> jax.Array:
    """The stored arrays of `kind` -> rows of `dtype` (exact: stored values lie on their grid)."""
    if len(rows) == 1:
        return rows[0].astype(dtype)
    if kind == "window":
        return quant.unpack_fp8_blocks(*rows).astype(dtype)
    if kind == "entry":
        return quant.unpack_fp4_kv(*rows, 16).astype(dtype)
    return quant.unpack_fp4_index(*rows, 32).astype(dtype)


def row_shapes(kind: str, width: int, storage: str, dtype) -> list[tuple[tuple[int, ...], object]]:
    """(shape, dtype) of each stored array of one row of `kind` and `width`."""
    if storage == FLOAT:
        return [((width,), dtype)]
    if kind == "window":
        return [((width,), jnp.float8_e4m3fn), ((width // 32,), jnp.float8_e8m0fnu)]
    if kind == "entry":
        return [((width // 2,), jnp.uint8), ((width // 16,), jnp.float8_e4m3fn)]
    return [((width // 2,), jnp.uint8), ((width // 32,), jnp.float8_e8m0fnu)]
