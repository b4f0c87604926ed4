"""Test-session setup: 8 virtual CPU devices, the CPU platform and no persistent compilation cache,
before JAX is imported."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
# LLM() and the commands keep JAX's persistent compilation cache under ~/.cache/deepinfer/xla by
# default: the suite (and the commands it starts) never writes the real home nor loads executables
# from an earlier run; the tests of the cache turn it on, in their own directories
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import pytest  # noqa: E402


def _memory_maps() -> tuple[int, int]:
    """(memory maps this process holds, the kernel's per-process limit) on Linux, else (0, 1)."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 1


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    """XLA's CPU backend maps memory for every compiled program. An xdist worker compiles
    thousands over the suite; once it reaches the kernel's `vm.max_map_count` (65,530 by
    default) the next compilation crashes the worker (a segfault or abort inside
    `backend_compile_and_load`, seen twice in full runs). Past half the limit, drop JAX's
    compilation caches between test modules: modules then recompile what they share."""
    yield
    count, limit = _memory_maps()
    if count > limit // 2:
        import jax

        jax.clear_caches()
