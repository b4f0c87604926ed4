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


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    """XLA's CPU backend maps three memory regions per compiled kernel (an engine-step program:
    ~600-900). Once a worker reaches the kernel's `vm.max_map_count` (65,530 by default) the
    next compilation crashes it (a segfault or abort inside `backend_compile_and_load`, seen
    twice in full runs). The engines release their own step programs (`serve/engine/programs.py`);
    for every other jitted function, past half the limit, drop JAX's compilation caches between
    test modules: modules then recompile what they share."""
    yield
    from deepinfer.serve.engine.programs import memory_maps

    count, limit = memory_maps()
    if count > limit // 2:
        import jax

        jax.clear_caches()
