"""How the kernel tests run the kernels.

Default (CI, CPU): the Pallas interpreter (`interpret=True`). With
`DEEPINFER_KERNELS_ON_DEVICE=1` (benchmarks/device_check.sh on a CUDA machine) the same tests run
the compiled Pallas-Triton kernels on the GPU against the reference on the GPU; fp32 matmuls
then need `JAX_DEFAULT_MATMUL_PRECISION=highest`, or XLA's TF32 default makes the reference the
less accurate side.
"""

from __future__ import annotations

import os

import jax

ON_DEVICE = os.environ.get("DEEPINFER_KERNELS_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
KERNEL_BACKEND = "gpu_triton" if ON_DEVICE else "interpret"

if ON_DEVICE and jax.default_backend() != "gpu":
    raise RuntimeError(f"DEEPINFER_KERNELS_ON_DEVICE=1 but JAX runs on {jax.default_backend()!r}; "
                       "set JAX_PLATFORMS=cuda on a machine with an NVIDIA GPU")
