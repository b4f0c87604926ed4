"""The model's building blocks in one import: RMSNorm and RoPE (`ops.norm_rope`), the linear layer
that dequantizes checkpoint-format weights at use (`pallas_kernels.linear`), embedding-row gathers,
and each layer's RoPE frequencies from the config."""

from __future__ import annotations

import jax
import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.ops.norm_rope import apply_rope, rms_norm, rope_inv_freq  # noqa: F401  (the model's building blocks)
from deepinfer.ops.quant_weight import QuantWeight, dequantize
from deepinfer.pallas_kernels.linear import linear  # noqa: F401  (the model's building block)


def gather_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """Rows of an embedding-like table (dense or FP8 rows with 1x32 scales) without
    dequantizing the whole table."""
    if isinstance(table, QuantWeight):
        rows = QuantWeight(table.q[ids], table.scale[ids], kind=table.kind, block=table.block)
        return dequantize(rows, dtype)
    return table[ids].astype(dtype)


def layer_inv_freq(config: ModelConfig, layer: int) -> np.ndarray:
    """Ratio-0 layers: `rope_theta`, no YaRN; layers with a compressed branch: the compress rope."""
    if config.compress_ratios[layer] == 0:
        return rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, None)
    return compress_inv_freq(config)


def compress_inv_freq(config: ModelConfig) -> np.ndarray:
    yarn = (config.rope_factor, config.original_seq_len, config.beta_fast, config.beta_slow)
    return rope_inv_freq(config.qk_rope_head_dim, config.compress_rope_theta, yarn)
