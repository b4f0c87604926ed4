"""Test-session setup, before JAX is imported: 8 virtual CPU devices, the CPU platform, and a
persistent compilation cache of this run only."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
# LLM() and the commands keep JAX's persistent compilation cache under ~/.cache/deepinfer/xla by
# default: the suite (and the commands it starts) never writes the real home nor loads executables
# from an earlier run. It shares one cache of its own instead, a new directory per run, made by the
# controlling process before the xdist workers start (they inherit it): the step programs that
# several tests, both workers and the subprocesses of the CLI and multi-process tests compile are
# compiled once. JAX takes it as the process's one directory, so LLM() keeps it (set once per
# process, `serve.compilation_cache`); the tests of the cache set their own.
_RUN_CACHE = "DEEPINFER_TEST_RUN_XLA_CACHE"
if _RUN_CACHE not in os.environ:
    os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="deepinfer-test-xla-")
    _OWNS_RUN_CACHE = True
else:
    _OWNS_RUN_CACHE = False
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "true"
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"

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


def pytest_sessionfinish(session, exitstatus):
    """The process that made this run's compilation cache removes it."""
    if _OWNS_RUN_CACHE and "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)
