"""Plain-jnp implementations of every hot op: the CPU and Ascend path, and the oracle that
every accelerated kernel is tested against."""

from deepinfer.pallas_kernels.reference import compress_store, indexer, matmul, mhc, moe, sparse_attention  # noqa: F401
