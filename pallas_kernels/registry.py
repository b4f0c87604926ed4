"""The kernel registry: every hot op of the model is reached through `get_kernel(op)`.

Each op has named implementations per backend. The model asks the registry, never a kernel
module, so the CPU/Ascend path (plain jnp references) and accelerated paths are swapped in one
place. A backend is chosen once, from the platform or an explicit `KernelConfig`; asking for an
implementation that cannot run here is an error, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

REFERENCE = "reference"

# op name -> {backend name -> implementation}
_IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        _IMPLEMENTATIONS.setdefault(op, {})[backend] = fn
        return fn

    return wrap


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation family to use; `reference` runs everywhere."""

    backend: str = REFERENCE


def _load_builtin() -> None:
    # Importing the reference package registers its ops.
    from deepinfer.pallas_kernels import reference  # noqa: F401


def available(op: str) -> dict[str, Callable]:
    _load_builtin()
    if op not in _IMPLEMENTATIONS:
        raise KeyError(f"unknown kernel op {op!r}; known: {sorted(_IMPLEMENTATIONS)}")
    return _IMPLEMENTATIONS[op]


def get_kernel(op: str, config: KernelConfig | None = None) -> Callable:
    backend = (config or KernelConfig()).backend
    impls = available(op)
    if backend not in impls:
        raise ValueError(
            f"kernel op {op!r} has no {backend!r} implementation here (available: {sorted(impls)})"
        )
    return impls[backend]


def ops() -> list[str]:
    _load_builtin()
    return sorted(_IMPLEMENTATIONS)
