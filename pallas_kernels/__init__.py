"""Kernels for the model's hot ops, reached only through `deepinfer.pallas_kernels.registry`."""
