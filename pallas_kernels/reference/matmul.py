"""The two matmul hot ops on checkpoint-format weights, in plain jnp: dequantize the whole
weight, then the same matmul the model ran before these ops existed. They are the CPU/Ascend
path and the oracles of the Pallas kernels in `pallas_kernels/matmul.py`; they must stay bit
for bit equal to that older model path (dequantize + `einsum`), so they are written with the
same expressions.

Weights are duck-typed `QuantWeight`s (`.q`, `.scale`, `.block`; `model/params.py`):

* `fp8_block_matmul(x, w)`: `w.q` float8_e4m3fn `[N, K]` (or raw uint8), `w.scale` UE8M0
  (float8_e8m0fnu or raw uint8) `[ceil(N/bn), ceil(K/bk)]`, `w.block = (bn, bk)`.
* `moe_experts_mxfp4(x, weights, ids, w1, w3, w2, swiglu_limit)`: MXFP4 experts, `q` int8
  `[E, out, in/2]` (two e2m1 codes per byte, even `in` index in the low nibble), `scale` UE8M0
  `[E, out, in/32]`, `block = (1, 32)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.ops import quant
from deepinfer.pallas_kernels.reference.moe import moe_experts
from deepinfer.pallas_kernels.registry import REFERENCE, register


def dequantize_fp8(w, dtype) -> jax.Array:
    """The dense `[N, K]` weight in `dtype` (through fp32, as `model.layers.dequantize`)."""
    return quant.dequantize_fp8_blocks(w.q, w.scale, block=w.block, xp=jnp).astype(dtype)


def dequantize_mxfp4(w, dtype) -> jax.Array:
    """The dense `[E, out, in]` expert stack in `dtype` (through fp32)."""
    return quant.dequantize_mxfp4(w.q, w.scale, block=w.block[1], xp=jnp).astype(dtype)


@register("fp8_block_matmul", REFERENCE, why="plain jnp: dequantize the whole FP8 weight, then einsum")
def fp8_block_matmul(x: jax.Array, w) -> jax.Array:
    """x `[..., K]` (bf16/fp32) @ FP8 block-scaled `w` `[N, K]`^T -> `[..., N]` in x's dtype."""
    return jnp.einsum("...i,oi->...o", x, dequantize_fp8(w, x.dtype))


def dense_combine(weights: jax.Array, ids: jax.Array, n_experts: int) -> jax.Array:
    """Routing `[N, k]` (ids, fp32 weights) -> dense `[N, E]` combine weights; an id outside
    `[0, E)` (e.g. -1: no expert) adds nothing."""
    rows = jnp.arange(ids.shape[0])[:, None]
    ids = jnp.where((ids >= 0) & (ids < n_experts), ids, n_experts)  # out of range: dropped
    combine = jnp.zeros((ids.shape[0], n_experts), jnp.float32)
    return combine.at[rows, ids].add(weights, mode="drop")


@register("moe_experts_mxfp4", REFERENCE,
          why="plain jnp: dequantize every MXFP4 expert, every expert on every token, dense combine")
def moe_experts_mxfp4(x: jax.Array, weights: jax.Array, ids: jax.Array, w1, w3, w2,
                      swiglu_limit: float) -> jax.Array:
    """x `[N, D]`, routing `weights` fp32 / `ids` int32 `[N, k]`, MXFP4 experts w1/w3
    `[E, F, D]`, w2 `[E, D, F]` -> `[N, D]` fp32: the reference `moe_experts` on the
    dequantized stacks with the dense combine matrix of the routing."""
    combine = dense_combine(weights, ids, w1.q.shape[0])
    return moe_experts(x, combine, dequantize_mxfp4(w1, x.dtype), dequantize_mxfp4(w3, x.dtype),
                       dequantize_mxfp4(w2, x.dtype), swiglu_limit)
