"""Lower kernels for a GPU from a machine without one, and read custom_call targets.

On jax 0.12.0.1, `jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` alone fails for a
Pallas-Triton kernel on a CPU-only host with `RuntimeError: No supported GPU devices found, please
specify an abstract GPU device using AbstractDevice` (the Triton lowering reads the target's
compute capability from the device). `lower_for_cuda` supplies that device through an abstract
mesh (`jax.sharding.use_abstract_mesh`) with a `jax.sharding.AbstractDevice`.
"""

from __future__ import annotations

import re
from typing import Callable

# The custom_call target of a Pallas-Triton kernel (jax.experimental.pallas.triton.CUSTOM_CALL_TARGET_NAME).
TRITON_TARGET = "__gpu$xla.gpu.triton"
# The custom_call target of a Mosaic GPU kernel (plgpu.kernel) on jax 0.12.
MOSAIC_GPU_TARGET = "mosaic_gpu_v2"


def abstract_gpu_mesh(device_kind: str = "NVIDIA H200", num_cores: int | None = 132):
    import jax

    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("gpu",), (jax.sharding.AxisType.Explicit,), abstract_device=dev)


def lower_for_cuda(fn: Callable, *args, device_kind: str = "NVIDIA H200") -> str:
    """StableHLO text of `jax.jit(fn)` at `args`, lowered for CUDA as if on `device_kind`."""
    import jax

    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(device_kind)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_call_targets(stablehlo_text: str) -> list[str]:
    """Every distinct `custom_call` target in a StableHLO module's text, sorted."""
    found = set(re.findall(r"custom_call\s*@([^\s(]+)\s*\(", stablehlo_text))
    found.update(re.findall(r'call_target_name\s*=\s*"([^"]+)"', stablehlo_text))
    return sorted(found)
