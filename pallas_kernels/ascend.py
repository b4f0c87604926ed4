"""Huawei Ascend: a PJRT plugin when one is configured, otherwise the reference-ops StableHLO path.

No public JAX PJRT plugin for Ascend exists (as of jax 0.12.0.1), so this module does two things:

1. `register_ascend_plugin()` finds a PJRT plugin library from configuration and registers it
   with JAX before JAX starts its backends. Sources, in order: the explicit `library_path`
   argument (a `.so`, or a JSON file with `library_path` and optional `create_options`, the
   format JAX's `PJRT_NAMES_AND_LIBRARY_PATHS` accepts; the command line maps its own option or
   environment variable onto this argument); an `ascend:` entry of JAX's own
   `PJRT_NAMES_AND_LIBRARY_PATHS`; a package advertising a `jax_plugins` entry point whose name
   contains "ascend". JAX registers the last two itself when it starts its backends. `ascend_devices()` then
   returns the plugin's devices, or raises `AscendUnavailableError` saying what to install.
   On that platform the kernel registry picks the `reference` implementations (they are
   plain jnp, so the plugin compiles ordinary StableHLO).
2. `export_stablehlo()` / `custom_call_targets()` / `gpu_only_targets()`: the forward pass
   exported with the reference kernels is portable StableHLO; the test suite checks it holds
   no GPU-only `custom_call`, so the module can be handed to a vendor compiler or a future plugin.

JAX has no public `register_plugin`; `jax._src.xla_bridge.register_plugin` is the function that
`jax_plugins` packages call from their `initialize()`, so it is used here behind one import.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

from deepinfer.pallas_kernels.lowering import custom_call_targets  # noqa: F401  (re-exported)

PLUGIN_NAME = "ascend"
JAX_PLUGIN_ENV = "PJRT_NAMES_AND_LIBRARY_PATHS"  # read by JAX itself: "name:path,name:path"
ENTRY_POINT_GROUP = "jax_plugins"

INSTALL_HINT = (
    "install a PJRT plugin for Ascend (a shared library exporting GetPjrtApi, built on CANN; none is "
    "published for JAX as of jax 0.12) and pass its path (library_path=..., a .so or a JSON config), "
    f"set {JAX_PLUGIN_ENV}={PLUGIN_NAME}:/path/to/plugin.so, or install a package with a "
    f"'{ENTRY_POINT_GROUP}' entry point named '{PLUGIN_NAME}'. Without a plugin, run on CPU with the "
    "reference kernels and hand the StableHLO from deepinfer.pallas_kernels.ascend.export_stablehlo "
    "to the vendor toolchain"
)


class AscendUnavailableError(RuntimeError):
    """The Ascend accelerator was requested but no usable PJRT plugin is configured."""


@dataclass(frozen=True)
class PluginSource:
    kind: str  # "path" (argument), "jax_env" (PJRT_NAMES_AND_LIBRARY_PATHS) or "entry_point"
    location: str  # library path, or the entry point's module
    options: dict | None = None


def _from_path(path: str, kind: str, origin: str) -> PluginSource:
    if not os.path.isfile(path):
        raise AscendUnavailableError(f"Ascend PJRT plugin {path!r} (from the {origin}) does not exist; {INSTALL_HINT}")
    if path.endswith(".json"):
        with open(path) as f:
            cfg = json.load(f)
        if "library_path" not in cfg:
            raise AscendUnavailableError(f"Ascend PJRT plugin config {path!r} has no 'library_path' field")
        library = _from_path(cfg["library_path"], kind, f"{origin} via {path}")
        return PluginSource(kind, library.location, cfg.get("create_options"))
    return PluginSource(kind, path)


def find_plugin(library_path: str | os.PathLike | None = None,
                environ: dict[str, str] | None = None) -> PluginSource | None:
    """Where the Ascend PJRT plugin comes from, or None when nothing is configured."""
    if library_path is not None:
        return _from_path(os.fspath(library_path), "path", "library_path argument")
    env = os.environ if environ is None else environ
    for entry in filter(None, env.get(JAX_PLUGIN_ENV, "").split(",")):
        name, sep, path = entry.partition(os.path.pathsep)
        if sep and name == PLUGIN_NAME:
            return _from_path(path, "jax_env", f"{JAX_PLUGIN_ENV} setting")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if PLUGIN_NAME in ep.name.lower():
            return PluginSource("entry_point", ep.value)
    return None


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def register_ascend_plugin(library_path: str | os.PathLike | None = None, *,
                           environ: dict[str, str] | None = None,
                           _register: Callable[..., Any] | None = None) -> PluginSource:
    """Find the plugin and register it with JAX as platform "ascend". Must run before JAX
    starts its backends (before the first `jax.devices()` or array). Raises
    `AscendUnavailableError` when no plugin is configured or it cannot be registered."""
    source = find_plugin(library_path, environ)
    if source is None:
        raise AscendUnavailableError(f"the Ascend accelerator was requested but no PJRT plugin is configured: "
                                     f"{INSTALL_HINT}")
    if source.kind in ("entry_point", "jax_env"):
        return source  # JAX registers these itself when it starts its backends
    if _register is None:
        if _backends_started():
            raise AscendUnavailableError(
                "JAX has already started its backends, so a PJRT plugin can no longer be added; call "
                "register_ascend_plugin() before the first jax.devices()/array, or set "
                f"PJRT_NAMES_AND_LIBRARY_PATHS={PLUGIN_NAME}:{source.location} before starting Python")
        from jax._src import xla_bridge

        _register = xla_bridge.register_plugin
    try:
        _register(PLUGIN_NAME, library_path=source.location, options=source.options)
    except Exception as e:  # the loader's own message says what is wrong with the library
        raise AscendUnavailableError(f"could not load the Ascend PJRT plugin {source.location!r}: {e}") from e
    return source


def ascend_devices(library_path: str | os.PathLike | None = None) -> list:
    """The Ascend devices, registering the plugin first when it is not registered yet."""
    import jax
    from jax._src import xla_bridge

    if PLUGIN_NAME not in xla_bridge._backend_factories:  # not yet registered in this process
        register_ascend_plugin(library_path)
    try:
        return jax.devices(PLUGIN_NAME)
    except RuntimeError as e:
        raise AscendUnavailableError(f"the Ascend PJRT plugin is registered but JAX cannot start it: {e}") from e


# ---- the reference-ops StableHLO path ----------------------------------------------------------

# custom_call targets that only a GPU (or TPU) runtime can execute.
_ACCELERATOR_ONLY = re.compile(r"triton|mosaic|__gpu\$|cu(dnn|blas|b?lt|solver|sparse|fft)|hip|rocm|"
                               r"tpu_custom_call|__cub|gpu", re.IGNORECASE)


def gpu_only_targets(targets: list[str]) -> list[str]:
    return [t for t in targets if _ACCELERATOR_ONLY.search(t)]


def export_stablehlo(fn: Callable, *args, platforms: tuple[str, ...] = ("cpu",)) -> str:
    """`jax.export` of `fn` (jitted if needed) at `args` (arrays or ShapeDtypeStructs): the
    StableHLO module text."""
    import jax

    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    return jax.export.export(jitted, platforms=platforms)(*args).mlir_module()
