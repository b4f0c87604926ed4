"""Server-side metrics of the gRPC server, under vLLM's Prometheus names (`interfaces.md` §6).

The engine thread records token and request events; readers (GetServerInfo, a Prometheus scrape)
take consistent snapshots under a lock. Histograms keep fixed buckets plus a bounded window of
recent samples for the p50/p99 shown by GetServerInfo, so memory stays flat on a long-lived server.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Any, Callable

__all__ = ["HISTOGRAMS", "ServerMetrics", "percentile"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(21))

HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", _LATENCY_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", _LATENCY_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of end to end request latency in seconds.", _LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent waiting for a cache slot in seconds.",
                                        _LATENCY_BUCKETS),
    "vllm:request_prompt_tokens": ("Number of prefill tokens per request.", _TOKEN_BUCKETS),
    "vllm:request_generation_tokens": ("Number of generation tokens per request.", _TOKEN_BUCKETS),
}
_COUNTERS = {
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
}
_GAUGES = {
    "vllm:num_requests_running": "Number of requests holding a cache slot.",
    "vllm:num_requests_waiting": "Number of requests waiting for a cache slot.",
    "vllm:kv_cache_usage_perc": "KV-cache usage (fraction of pages in use, 0-1).",
}
FINISH_REASONS = ("stop", "length", "abort")


def percentile(samples, q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None without samples."""
    values = sorted(samples)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


class _Histogram:
    def __init__(self, bounds: tuple[float, ...], window: int):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.n = 0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1
        self.recent.append(value)


class ServerMetrics:
    """Counters and histograms of one server (thread-safe)."""

    def __init__(self, window: int = 4096):
        self._lock = threading.Lock()
        self._hist = {name: _Histogram(bounds, window) for name, (_, bounds) in HISTOGRAMS.items()}
        self._counters = {name: 0 for name in _COUNTERS}
        self._success = {reason: 0 for reason in FINISH_REASONS}
        self._errors = 0
        self._rejected = 0

    # -- recording (engine thread / event loop)
    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._hist[name].observe(float(value))

    def tokens(self, *, ttft: float | None = None, itl: list[float] | tuple = ()) -> None:
        with self._lock:
            if ttft is not None:
                self._hist["vllm:time_to_first_token_seconds"].observe(ttft)
            for v in itl:
                self._hist["vllm:inter_token_latency_seconds"].observe(v)
            self._counters["vllm:generation_tokens"] += (ttft is not None) + len(itl)

    def finished(self, reason: str, *, prompt_tokens: int, generation_tokens: int, e2e: float | None,
                 queue_time: float | None) -> None:
        with self._lock:
            self._success[reason if reason in self._success else "abort"] += 1
            self._counters["vllm:prompt_tokens"] += prompt_tokens
            self._hist["vllm:request_prompt_tokens"].observe(prompt_tokens)
            self._hist["vllm:request_generation_tokens"].observe(generation_tokens)
            if e2e is not None:
                self._hist["vllm:e2e_request_latency_seconds"].observe(e2e)
            if queue_time is not None:
                self._hist["vllm:request_queue_time_seconds"].observe(queue_time)

    def error(self) -> None:
        with self._lock:
            self._errors += 1

    def rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    # -- reading
    def snapshot(self, gauges: dict[str, float] | None = None) -> dict[str, Any]:
        """Plain values (JSON/Struct friendly): gauges, counters, `vllm:request_success` by finish
        reason, and per histogram its count, sum, p50 and p99 over the recent window."""
        with self._lock:
            out: dict[str, Any] = dict(gauges or {})
            out.update(self._counters)
            out["vllm:request_success"] = dict(self._success)
            out["deepinfer:request_errors"] = self._errors
            out["deepinfer:requests_rejected"] = self._rejected
            for name, h in self._hist.items():
                out[name] = {"count": h.n, "sum": h.total,
                             "p50": percentile(h.recent, 50), "p99": percentile(h.recent, 99)}
        return out

    def registry(self, gauges: Callable[[], dict[str, float]], model_name: str | Callable[[], str],
                 engine_counters: Callable[[], dict] = dict):
        """A `prometheus_client.CollectorRegistry` exposing these metrics at every scrape
        (vLLM's names and labels; see `deepinfer.serve.api.prometheus`). A callable `model_name`
        is asked at every scrape (the served model is only known once it is loaded);
        `engine_counters()` gives the engine's own counters (spec decode) as `LLM.get_metrics`
        names them."""
        from prometheus_client import CollectorRegistry

        from deepinfer.serve.api.prometheus import MetricValues, metrics_registry, engine_counter_values

        def scrape() -> MetricValues:
            current = gauges()
            spec, per_pos = engine_counter_values(engine_counters())
            with self._lock:
                return MetricValues(
                    gauges={name: (doc, current.get(name, 0.0)) for name, doc in _GAUGES.items()},
                    counters={**{name: (doc, self._counters[name]) for name, doc in _COUNTERS.items()}, **spec},
                    success=dict(self._success),
                    histograms={name: (doc, bounds, list(self._hist[name].counts), self._hist[name].total)
                                for name, (doc, bounds) in HISTOGRAMS.items()},
                    labelled=per_pos)

        class _Labelled:
            def collect(self):
                name = model_name() if callable(model_name) else model_name
                yield from metrics_registry(scrape, name).collect()

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Labelled())
        return registry
