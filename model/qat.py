"""The reference's quantization-aware-training (QAT) fake-quant, per model family.

The official references quantize and dequantize some activations in the forward pass, exactly as
the caches and kernels store them; the model was trained that way. `config.fake_quant` switches
all of it. V4.1 (HF port of the official code): window KV FP8 e4m3 over all dims (ue8m0 scale per
32); compressed KV FP4 (e4m3 scale per 16); indexer keys and queries FP4 (ue8m0 per 32).
V4 (official `model.py`): window and compressed KV FP8 on the non-RoPE dims only (ue8m0 per 64);
indexer keys and queries Hadamard-rotated, then FP4 (ue8m0 per 32).
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.ops import quant
from deepinfer.model.config import ModelConfig


def _fp8_nope(x: jax.Array, config: ModelConfig) -> jax.Array:
    nope = config.head_dim - config.qk_rope_head_dim
    return jnp.concatenate([quant.fake_quant_fp8(x[..., :nope], block=64), x[..., nope:]], axis=-1)


def window_kv(x: jax.Array, config: ModelConfig) -> jax.Array:
    if not config.fake_quant:
        return x
    return _fp8_nope(x, config) if config.is_v4 else quant.fake_quant_fp8(x, block=32)


def compressed_kv(x: jax.Array, config: ModelConfig) -> jax.Array:
    if not config.fake_quant:
        return x
    return _fp8_nope(x, config) if config.is_v4 else quant.fake_quant_fp4(x, block=16, e4m3_scales=True)


@lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix of size n (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def index_vector(x: jax.Array, config: ModelConfig) -> jax.Array:
    """Indexer queries and keys as the reference scores them."""
    if not config.fake_quant:
        return x
    if config.is_v4:
        rotated = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), jnp.asarray(hadamard_matrix(x.shape[-1])))
        x = rotated.astype(x.dtype)
    return quant.fake_quant_fp4(x, block=32, e4m3_scales=False)
