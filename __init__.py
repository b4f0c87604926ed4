"""DeepInfer-JAX: DeepSeek-V4.1-Flash / V4-Flash inference in JAX.

The repository root is this package; subpackages are `deepinfer.model` (pure model functions),
`deepinfer.sharding` (meshes and partitioning rules), `deepinfer.pallas_kernels` (kernel
registry) and `deepinfer.serve` (engine, API and command line).
"""

__version__ = "0.1.0"
