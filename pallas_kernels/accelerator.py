"""Which accelerator a model runs on: `auto`, `cuda`, `ascend` or `cpu`.

`select_accelerator(name)` turns the user's choice into an `Accelerator`: the JAX backend name
and its devices, which the caller passes on explicitly (no global JAX setting is changed):

* the devices of the mesh (`sharding.make_mesh(spec, devices=accelerator.devices)`) and of the
  one-device placement of the params (`accelerator.first_local_device`);
* the kernel registry's platform (`accelerator.kernel_config(...)`: `KernelConfig.platform`),
  so kernels are chosen for that backend and not for JAX's default one.

`auto` is JAX's default backend (its first platform in priority order: a GPU when jax has
one, else the CPU). `ascend` registers the Ascend PJRT plugin when one is configured
(`pallas_kernels.ascend`); it must be selected before JAX starts its backends (the first
`jax.devices()` or array of the process). Asking for a backend that JAX does not have is an
`AcceleratorUnavailableError` saying what to install, never a silent fallback.

JAX itself still starts every backend it finds; to keep a GPU untouched by a CPU run, set
`JAX_PLATFORMS=cpu` in the environment as well.

Upstream DeepInfer's accelerator setting says `nvidia` for CUDA GPUs; `normalize` accepts that
name too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deepinfer.pallas_kernels.registry import KernelConfig

AUTO, CUDA, ASCEND, CPU = "auto", "cuda", "ascend", "cpu"
ACCELERATORS = (AUTO, CUDA, ASCEND, CPU)
ALIASES = {"nvidia": CUDA}
GPU_INSTALL_HINT = "install deepinfer-jax[gpu] (jax[cuda12]) on a machine with an NVIDIA GPU and driver"

__all__ = ["ACCELERATORS", "Accelerator", "AcceleratorUnavailableError", "normalize", "select_accelerator"]


class AcceleratorUnavailableError(ValueError):
    """The requested accelerator's JAX backend or plugin is not there."""


def normalize(name: str, what: str = "accelerator") -> str:
    """`name` (any case, `nvidia` = `cuda`) -> one of ACCELERATORS; a ValueError naming `what`."""
    if not isinstance(name, str):
        raise ValueError(f"{what}: must be one of {', '.join(ACCELERATORS)}, got {name!r}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ValueError(f"{what}: must be one of {', '.join(ACCELERATORS)}, got {name!r}")
    return key


@dataclass(frozen=True)
class Accelerator:
    """A chosen accelerator: `name` as asked (normalized), `backend` the JAX backend name
    (None for auto: JAX's default) and `devices`, the backend's devices over all processes."""

    name: str
    backend: str | None
    devices: tuple

    @property
    def platform(self) -> str:
        """The devices' platform as JAX reports it ("cpu", "gpu", or a plugin's name)."""
        return self.devices[0].platform

    @property
    def first_local_device(self):
        """This process's first device: where one-device runs put the params and the cache."""
        import jax

        here = jax.process_index()
        return next(d for d in self.devices if d.process_index == here)

    def kernel_config(self, base: KernelConfig | None = None) -> KernelConfig | None:
        """`base` with this accelerator's platform; None (the registry's default) for auto."""
        if self.backend is None:
            return base
        return dataclasses.replace(base or KernelConfig(), platform=self.backend)


def _devices(backend: str | None) -> tuple:
    import jax

    return tuple(jax.devices(backend) if backend else jax.devices())


def select_accelerator(name: str = AUTO, *, ascend_plugin: str | None = None) -> Accelerator:
    """The `Accelerator` for `name` (see the module docstring); `ascend_plugin`: a plugin
    library or JSON config (`ascend.register_ascend_plugin`), else JAX's own configuration."""
    name = normalize(name)
    if name == AUTO:
        return Accelerator(AUTO, None, _devices(None))
    if name == ASCEND:
        from deepinfer.pallas_kernels.ascend import AscendUnavailableError, ascend_devices

        try:
            return Accelerator(ASCEND, ASCEND, tuple(ascend_devices(ascend_plugin)))
        except AscendUnavailableError as e:
            raise AcceleratorUnavailableError(f"accelerator 'ascend': {e}") from None
    try:
        return Accelerator(name, name, _devices(name))
    except RuntimeError as e:  # jax: "Unknown backend ..." / "Backend 'cuda' failed to initialize ..."
        if name == CUDA:
            raise AcceleratorUnavailableError(f"accelerator 'cuda' requested but jax has no CUDA backend: "
                                              f"{GPU_INSTALL_HINT} (jax: {e})") from None
        raise AcceleratorUnavailableError(f"accelerator 'cpu' requested but JAX's CPU backend is not enabled: "
                                          f"include cpu in JAX_PLATFORMS (jax: {e})") from None
