"""The kernel registry: every hot op of the model is reached through `get_kernel(op)`.

Each op has named implementations per backend:

* `reference`   plain jnp; runs on every platform (CPU, GPU, and the Ascend StableHLO path) and
                is the oracle every kernel is tested against.
* `gpu_mosaic`  a Pallas Mosaic GPU kernel (CUDA, sm_90+).
* `gpu_triton`  a Pallas-Triton kernel (CUDA, sm_80+).
* `interpret`   the Pallas kernels run by the Pallas interpreter: any platform, slow; for tests
                and for debugging a kernel inside the model on CPU.

The model asks the registry, never a kernel module. The platform's preference order is worked
out once per process and JAX backend (`platform_info()`; the backend is `KernelConfig.platform`,
JAX's default one unless an accelerator was chosen): CPU (and anything that is not a CUDA GPU) uses the
references; a CUDA GPU uses, per op, `gpu_mosaic` if that op has one, else `gpu_triton`, else
the reference. `KernelConfig(backend=...)` overrides the choice for every op that has an
implementation of that backend (the others keep the reference, and `describe()` says so);
`KernelConfig(ops=(("op", "backend"), ...))` pins single ops. Asking for a backend that cannot
run on this platform is an error naming the op, the backend and the reason, never a silent
fallback.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

REFERENCE = "reference"
GPU_MOSAIC = "gpu_mosaic"
GPU_TRITON = "gpu_triton"
INTERPRET = "interpret"
BACKENDS = (REFERENCE, GPU_MOSAIC, GPU_TRITON, INTERPRET)
AUTO = None

# Per CUDA GPU, the preferred kernels first.
_GPU_PREFERENCE = (GPU_MOSAIC, GPU_TRITON)
_MIN_COMPUTE_CAPABILITY = {GPU_TRITON: 80, GPU_MOSAIC: 90}


class KernelUnavailableError(ValueError):
    """A requested kernel implementation does not exist or cannot run on this platform."""


@dataclass(frozen=True)
class PlatformInfo:
    """What this process runs on, as far as kernel selection cares."""

    platform: str  # jax.default_backend(): "cpu", "gpu", "tpu", or a plugin's name
    vendor: str | None = None  # "cuda" / "rocm" on GPUs
    device_kind: str = ""
    compute_capability: int | None = None  # e.g. 90 for sm_90

    def describe(self) -> str:
        if self.platform == "gpu":
            cc = f", sm_{self.compute_capability}" if self.compute_capability else ""
            return f"gpu ({self.vendor or 'unknown vendor'}, {self.device_kind or 'unknown device'}{cc})"
        return self.platform


@functools.cache
def platform_info(backend: str | None = None) -> PlatformInfo:
    """The platform of JAX backend `backend` ("cpu", "cuda", a plugin's name; None: JAX's
    default backend), read once per process and backend."""
    import jax

    dev = jax.devices(backend)[0] if backend else jax.devices()[0]
    name = dev.platform if backend else jax.default_backend()
    if name != "gpu":
        return PlatformInfo(platform=name)
    version = str(getattr(dev.client, "platform_version", "")).lower()
    vendor = "rocm" if "rocm" in version or "hip" in version else "cuda"
    cc = None
    raw = getattr(dev, "compute_capability", None)
    if isinstance(raw, str) and raw[:1].isdigit():
        major, _, minor = raw.partition(".")
        cc = int(major) * 10 + int(minor or 0)
    return PlatformInfo(platform="gpu", vendor=vendor, device_kind=dev.device_kind, compute_capability=cc)


def cannot_run(backend: str, info: PlatformInfo) -> str | None:
    """None when `backend` can run on `info`, else the reason it cannot."""
    if backend in (REFERENCE, INTERPRET):
        return None
    if backend in _MIN_COMPUTE_CAPABILITY:
        need = _MIN_COMPUTE_CAPABILITY[backend]
        if info.platform != "gpu" or info.vendor != "cuda":
            return f"it needs a CUDA GPU (sm_{need}+) and this process's JAX platform is {info.describe()}"
        if info.compute_capability is not None and info.compute_capability < need:
            return f"it needs sm_{need}+ and the device is sm_{info.compute_capability}"
        return None
    return f"unknown backend; known: {', '.join(BACKENDS)}"


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    fn: Callable
    why: str  # what this implementation is, for `deepinfer kernels`


# op name -> {backend name -> implementation}
_IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {}


def register(op: str, backend: str, *, why: str = "") -> Callable[[Callable], Callable]:
    """Decorator: `fn` implements `op` for `backend`; `why` is a one-line description."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; known: {', '.join(BACKENDS)}")

    def wrap(fn: Callable) -> Callable:
        _IMPLEMENTATIONS.setdefault(op, {})[backend] = Implementation(op, backend, fn, why)
        return fn

    return wrap


@dataclass(frozen=True)
class KernelConfig:
    """Which implementations run. `backend=None` (the default) chooses from the platform;
    a backend name applies to every op that has that implementation (the rest keep the
    reference); `ops` pins single ops, e.g. `ops=(("sparse_attention", "interpret"),)`.
    `platform`: the JAX backend the model runs on ("cpu", "cuda", "ascend"; None: JAX's
    default backend), set from the chosen accelerator (`pallas_kernels.accelerator`).
    `batch_invariant`: the step computes each token from its own inputs only, bit for bit
    whatever the batch (`EngineConfig(deterministic=True)`): products in fixed tiles
    (`deepinfer.ops.batch_invariant`), attention keys in one order (`model.invariant_attention`).
    Frozen and hashable: the model passes it to `jax.jit` as a static argument."""

    backend: str | None = AUTO
    ops: tuple[tuple[str, str], ...] = field(default=())
    platform: str | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        for name in [self.backend, *(b for _, b in self.ops)]:
            if name is not None and name not in BACKENDS:
                raise KernelUnavailableError(f"unknown kernel backend {name!r}; known: {', '.join(BACKENDS)}")


def _load_builtin() -> None:
    # Importing these modules registers their implementations.
    from deepinfer.pallas_kernels import compress_store, indexer, matmul, mhc, reference, sparse_attention  # noqa: F401


def available(op: str) -> dict[str, Callable]:
    """The implementations of `op` by backend (registered, not necessarily runnable here)."""
    _load_builtin()
    if op not in _IMPLEMENTATIONS:
        raise KeyError(f"unknown kernel op {op!r}; known: {sorted(_IMPLEMENTATIONS)}")
    return {b: impl.fn for b, impl in _IMPLEMENTATIONS[op].items()}


def resolve(op: str, config: KernelConfig | None = None,
            info: PlatformInfo | None = None) -> tuple[Implementation, str]:
    """The implementation of `op` that runs under `config` on `info` (default: this process),
    and why it was chosen. Raises `KernelUnavailableError` for an impossible request."""
    _load_builtin()
    if op not in _IMPLEMENTATIONS:
        raise KeyError(f"unknown kernel op {op!r}; known: {sorted(_IMPLEMENTATIONS)}")
    config = config or KernelConfig()
    info = info or platform_info(config.platform)
    impls = _IMPLEMENTATIONS[op]
    unknown = sorted({o for o, _ in config.ops} - set(_IMPLEMENTATIONS))
    if unknown:
        raise KernelUnavailableError(f"KernelConfig.ops names unknown kernel ops {unknown}; known: "
                                     f"{sorted(_IMPLEMENTATIONS)}")
    pinned = dict(config.ops).get(op)

    def checked(backend: str, how: str) -> tuple[Implementation, str]:
        reason = cannot_run(backend, info)
        if reason is not None:
            raise KernelUnavailableError(f"kernel op {op!r}: backend {backend!r} cannot run here: {reason}")
        return impls[backend], how

    if pinned is not None:
        if pinned not in impls:
            raise KernelUnavailableError(
                f"kernel op {op!r} has no {pinned!r} implementation (it has: {', '.join(sorted(impls))})")
        return checked(pinned, f"pinned by KernelConfig.ops to {pinned}")
    if config.backend is not None:
        if config.backend in impls:
            return checked(config.backend, f"KernelConfig(backend={config.backend!r})")
        # The backend itself must still be able to run here: asking for GPU kernels on a CPU is
        # an error even for an op that has none.
        reason = cannot_run(config.backend, info)
        if reason is not None:
            raise KernelUnavailableError(f"kernel op {op!r}: backend {config.backend!r} cannot run here: {reason}")
        return impls[REFERENCE], f"KernelConfig(backend={config.backend!r}) but no {config.backend} implementation yet"
    # Automatic: the platform's preference order (GPU kernels first where they can run).
    gpu_kernels = [b for b in _GPU_PREFERENCE if b in impls]
    for backend in gpu_kernels:
        if cannot_run(backend, info) is None:
            return impls[backend], f"auto on {info.describe()}"
    if not gpu_kernels:
        return impls[REFERENCE], f"auto on {info.describe()}: no GPU kernel for this op yet"
    return impls[REFERENCE], (f"auto on {info.describe()}: its {gpu_kernels[0]} kernel cannot run here "
                              f"({cannot_run(gpu_kernels[0], info)})")


def get_kernel(op: str, config: KernelConfig | None = None) -> Callable:
    """The callable for `op` (see `resolve`); `get_kernel(op)` on CPU is the reference."""
    return resolve(op, config)[0].fn


def describe(config: KernelConfig | None = None,
             info: PlatformInfo | None = None) -> list[tuple[str, str, str]]:
    """`(op, implementation, reason)` for every op, as `deepinfer kernels` prints them."""
    rows = []
    for op in ops():
        impl, how = resolve(op, config, info)
        rows.append((op, impl.backend, f"{how}; {impl.why}" if impl.why else how))
    return rows


def ops() -> list[str]:
    _load_builtin()
    return sorted(_IMPLEMENTATIONS)
