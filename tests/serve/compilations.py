"""What the tests that count XLA compilations listen for (`jax.monitoring` duration events), and
the warm-up engine they share.

A program that is not in memory yet is either compiled (a backend compile) or, with the
persistent compilation cache the suite runs with (tests/conftest.py), loaded from it (a cache
hit): both are what "compiles nothing mid-stream" rules out, and both are what a warm-up does.

`WARM_ENGINE` (tiny-v4.1 with fake-quant, the model of test_grpc.py and test_warmup.py): the
engine configuration of the two end-to-end warm-up tests. One configuration makes one set of
step programs: whichever test runs second loads them from the run's cache instead of compiling
them (~100 s of CPU).
"""

import contextlib

from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig

COMPILE_EVENTS = (
    "/jax/core/compile/backend_compile_duration",  # compiled by XLA
    "/jax/compilation_cache/cache_retrieval_time_sec",  # loaded from the persistent cache (a hit)
)

# 2 slots, page buckets 1 and 2 (64-token pages up to 128 tokens, the narrowest table one page
# instead of the default 2,048 tokens' worth, so that generations cross a bucket): 6 shapes,
# 1 and 2 prefill rows and a decode per bucket
WARM_ENGINE = EngineConfig(budget=CacheBudget(num_slots=2, max_model_len=128, page_size=64), prefill_chunk=128,
                           min_page_bucket_tokens=64)


@contextlib.contextmanager
def counting_compiles():
    """A list that collects the duration of every compilation (or persistent-cache load) while
    the block runs."""
    import jax.monitoring

    compiles: list[float] = []

    def on_event(name, seconds, **_):
        if name in COMPILE_EVENTS:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
