"""JAX's persistent compilation cache for the engine: on by default, under ~/.cache/deepinfer/xla.

A later process that compiles the same step shapes loads the executables from there instead of
compiling them again (minutes for a real model). `LLM(compilation_cache=...)` and the commands'
`--compilation-cache DIR` / `--no-compilation-cache` choose the directory (the command line reads
its environment variable once, into that option's default: `serve/cli.py`).

JAX keeps ONE persistent cache per process: its directory is a process-global config value, and
the cache opens at the first compilation that uses it. So it is set once, idempotently: when JAX
already has a directory (an earlier call, the application, `JAX_COMPILATION_CACHE_DIR`), that one
stays and a different request is logged and ignored; turning the cache off for one `LLM` leaves a
directory set earlier in the process in place.
"""

from __future__ import annotations

import logging
import os

__all__ = ["MIN_COMPILE_SECONDS", "default_compilation_cache_dir", "enable_compilation_cache",
           "resolve_compilation_cache"]

log = logging.getLogger("deepinfer.engine")

# programs that compile faster than this are not written (the sampler, small helpers)
MIN_COMPILE_SECONDS = 0.5


def default_compilation_cache_dir() -> str:
    """`~/.cache/deepinfer/xla`, next to the embedded checkpoints."""
    return os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", "xla")


def resolve_compilation_cache(setting, name: str = "compilation_cache") -> str | None:
    """The directory a `compilation_cache` setting names: True -> the default directory, a path
    -> that path (absolute), None or False -> None (off). Anything else, or a path that exists
    and is not a directory, is a `ValueError` naming `name`."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return default_compilation_cache_dir()
    if not isinstance(setting, (str, os.PathLike)) or not os.fspath(setting):
        raise ValueError(f"{name}: must be a directory, True (the default ~/.cache/deepinfer/xla) or "
                         f"None/False (off), got {setting!r}")
    path = os.path.abspath(os.path.expanduser(os.fspath(setting)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name}: {path} exists and is not a directory")
    return path


def enable_compilation_cache(directory: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `directory` (JAX creates it at the first
    compilation); returns the directory JAX uses now, or None. `None` changes nothing. Set once
    per process (see the module docstring): calling it again with the same directory is a no-op."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if directory is None:
        return current or None
    if current:
        if os.path.abspath(current) != os.path.abspath(directory):
            log.warning("the JAX compilation cache of this process is already %s (process-wide, set once); "
                        "%s is not used", current, directory)
        return current
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    log.info("JAX persistent compilation cache: %s", directory)
    return directory
