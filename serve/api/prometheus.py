"""Prometheus exposition of vLLM-named metrics from plain values, shared by `run-batch` and the
gRPC server: labels `model_name` and `engine` ("0") as in vLLM, counters exposed with `_total`,
`vllm:request_success` labelled by `finished_reason`, histograms from per-bucket counts."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class MetricValues:
    """One scrape: name -> (help, value) for gauges and counters; finish reason -> count;
    histogram name -> (help, upper bounds, per-bucket counts with the overflow last, sum)."""

    gauges: dict[str, tuple[str, float]] = field(default_factory=dict)
    counters: dict[str, tuple[str, float]] = field(default_factory=dict)
    success: dict[str, int] = field(default_factory=dict)
    histograms: dict[str, tuple[str, tuple[float, ...], list[int], float]] = field(default_factory=dict)
    # name -> (help, label name, {label value: count}): counters with one label of their own
    labelled: dict[str, tuple[str, str, dict[str, float]]] = field(default_factory=dict)


# the engine's own counters (`LLMEngine.counters`), present only with their feature on
ENGINE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
}
# counters with a label of their own: name -> (help, label)
LABELLED_COUNTERS = {
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("Accepted tokens per draft position.", "position"),
    "deepinfer:prefix_cache_hits_by_tier": ("Prefix cache hits by the tier the pages came from, in tokens.",
                                            "tier"),
}


def engine_counter_values(metrics: dict) -> tuple[dict, dict]:
    """The engine counters of an `LLM.get_metrics()`-style dict (spec decode, prefix cache) as
    `MetricValues.counters` and `.labelled` entries (empty with those features off)."""
    counters = {name: (doc, metrics[name]) for name, doc in ENGINE_COUNTERS.items() if name in metrics}
    labelled = {name: (doc, label, metrics[name]) for name, (doc, label) in LABELLED_COUNTERS.items()
                if name in metrics}
    return counters, labelled


def bucket_counts(bounds, samples) -> list[int]:
    """Per-bucket counts (a sample lands in the first bucket whose bound is >= it; overflow last)."""
    counts = [0] * (len(bounds) + 1)
    for s in samples:
        counts[bisect.bisect_left(bounds, s)] += 1
    return counts


def metrics_registry(scrape: Callable[[], MetricValues], model_name: str):
    """A `prometheus_client.CollectorRegistry` that calls `scrape` at every scrape."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["model_name", "engine"]
    values = [str(model_name), "0"]

    class _Collector:
        def collect(self):
            m = scrape()
            for name, (doc, value) in m.gauges.items():
                g = GaugeMetricFamily(name, doc, labels=labels)
                g.add_metric(values, float(value))
                yield g
            for name, (doc, value) in m.counters.items():
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric(values, float(value))
                yield c
            c = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                    labels=[*labels, "finished_reason"])
            for reason, count in sorted(m.success.items()):
                c.add_metric([*values, reason], float(count))
            yield c
            for name, (doc, label, counts) in m.labelled.items():
                c = CounterMetricFamily(name, doc, labels=[*labels, label])
                for key, count in counts.items():
                    c.add_metric([*values, str(key)], float(count))
                yield c
            for name, (doc, bounds, counts, total) in m.histograms.items():
                cumulative, buckets = 0, []
                for bound, count in zip(bounds, counts):
                    cumulative += count
                    buckets.append((repr(bound), float(cumulative)))
                buckets.append(("+Inf", float(cumulative + counts[-1])))
                h = HistogramMetricFamily(name, doc, labels=labels)
                h.add_metric(values, buckets, float(total))
                yield h

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return registry
