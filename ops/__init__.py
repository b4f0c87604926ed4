"""The bottom layer: numeric formats and small pure ops that the model and the kernels share.

Quantization formats (`quant`, `quant_weight`), the KV-cache row codec (`cache_codec`) and the
RMSNorm / RoPE helpers (`norm_rope`). Nothing here imports any other part of DeepInfer, so the
import direction stays serve -> engine -> sharding -> model -> kernel registry -> kernels -> ops.
"""
