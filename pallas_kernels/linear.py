"""The linear layer that dequantizes checkpoint-format weights at use, dispatching block-FP8
weights to the registry's `fp8_block_matmul`: one definition for the model and for kernels that
contain a projection (compress_store), so both compute it the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.ops.quant_weight import FP8, QuantWeight, dequantize
from deepinfer.pallas_kernels.registry import KernelConfig, get_kernel


def linear(x: jax.Array, w, kernels: KernelConfig | None = None) -> jax.Array:
    """`x @ w.T` for a weight stored `[out, in]` as in the checkpoint, in x's dtype.

    A block-FP8 `QuantWeight` goes through the registry's `fp8_block_matmul` (the reference on
    CPU, bit for bit the dequantize + einsum below; on a CUDA GPU a kernel that dequantizes
    tile by tile instead of writing the dense weight to HBM). Callers need not pass `kernels`:
    `None` is the platform's choice."""
    if isinstance(w, QuantWeight) and w.kind == FP8:
        return get_kernel("fp8_block_matmul", kernels)(x, w)
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))
