"""What the tests that count XLA compilations listen for (`jax.monitoring` duration events).

A program that is not in memory yet is either compiled (a backend compile) or, with the
persistent compilation cache the suite runs with (tests/conftest.py), loaded from it (a cache
hit): both are what "compiles nothing mid-stream" rules out, and both are what a warm-up does.
"""

COMPILE_EVENTS = (
    "/jax/core/compile/backend_compile_duration",  # compiled by XLA
    "/jax/compilation_cache/cache_retrieval_time_sec",  # loaded from the persistent cache (a hit)
)
