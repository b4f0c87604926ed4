"""Kernels for the model's hot ops, reached only through `deepinfer.pallas_kernels.registry`.

Modules: `registry` (op -> backend -> implementation, platform choice, `describe`),
`reference/` (plain jnp: the CPU/Ascend path and the oracles), `sparse_attention` and `mhc`
(Pallas kernels, Pallas-Triton on CUDA, interpretable on CPU), `lowering` (CUDA cross-lowering
from a CPU host), `ascend` (PJRT plugin registration, reference-only StableHLO export),
`cli` (`deepinfer kernels`), `bench` (kernel vs reference micro-benchmark).
"""
