"""Kernel registry, Pallas kernels (interpret mode and CUDA cross-lowering) and the Ascend path."""
