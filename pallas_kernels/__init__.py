"""Kernels for the model's hot ops, reached only through `deepinfer.pallas_kernels.registry`.

Modules: `registry` (op -> backend -> implementation, platform choice, `describe`),
`reference/` (plain jnp: the CPU/Ascend path and the oracles), `sparse_attention`, `mhc`,
`indexer` (index scores), `compress_store` (compression + FP4 paged store) and `matmul` (FP8
block-scaled dense and MXFP4 grouped expert matmuls) (Pallas kernels, Pallas-Triton on CUDA,
interpretable on CPU), `lowering` (CUDA cross-lowering
from a CPU host), `ascend` (PJRT plugin registration, reference-only StableHLO export),
`cli` (`deepinfer kernels`), `bench` (kernel vs reference micro-benchmark).
"""
