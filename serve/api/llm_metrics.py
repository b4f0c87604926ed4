"""The metrics an `LLM` keeps of its requests, under vLLM's names (`interfaces.md` §6): what the
engine cannot count by itself (prompt tokens counted at a request's first token, finish reasons,
per-request latency and size samples), the snapshot `LLM.get_metrics()` returns, and vLLM's
periodic log lines (the `LoggingStatLogger` line and, with speculative decoding, the
spec-decode line). `get_metrics()` may be called from another thread while a call steps."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from deepinfer.serve.api.types import RequestOutput
from deepinfer.serve.engine.speculative import SpecDecodeCounts

__all__ = ["LLMMetrics", "spec_decode_line"]

log = logging.getLogger("deepinfer.llm")

SAMPLES = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
           "vllm:request_prompt_tokens", "vllm:request_generation_tokens")


class LLMMetrics:
    """Request metrics of one engine (`LLMEngine`), fed each step's outputs."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._prompt_counted: set[str] = set()  # requests whose prompt is counted, still running
        self._prompt_tokens = 0
        self._success = {"stop": 0, "length": 0, "abort": 0}
        self._samples: dict[str, list[float]] = {name: [] for name in SAMPLES}
        self._last_log = (time.monotonic(), 0, 0)
        self._last_spec: SpecDecodeCounts | None = None  # the spec-decode counters at the last log line

    def finished(self, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs (its finished requests, or aborted ones) and the prompts that started."""
        with self._lock:
            self._count_prompts(outputs)
            for output in outputs:
                self._record(output)

    def snapshot(self) -> dict[str, Any]:
        """`LLM.get_metrics()` (see there)."""
        with self._lock:
            self._count_prompts()
            scheduler = self.engine.scheduler
            metrics: dict[str, Any] = {
                "vllm:num_requests_running": len(scheduler.running),
                "vllm:num_requests_waiting": len(scheduler.waiting),
                "vllm:kv_cache_usage_perc": float(self.engine.cache.usage()),
                "vllm:prompt_tokens": self._prompt_tokens,
                "vllm:generation_tokens": int(self.engine.stats["generation_tokens"]),
                "vllm:num_preemptions": int(scheduler.num_preemptions),
                "vllm:request_success": dict(self._success),
            }
            for name, samples in self._samples.items():
                metrics[name] = list(samples)
            metrics.update(self.engine.counters())
        return metrics

    def stats_line(self, prompt_throughput: float, generation_throughput: float) -> str:
        """vLLM's `LoggingStatLogger` line for the given throughputs and the current engine state
        (the prefix-cache hit rate: tokens found of tokens looked up since the engine started)."""
        scheduler = self.engine.scheduler
        counters = self.engine.counters()
        queries = counters.get("vllm:prefix_cache_queries", 0)
        hit_rate = 100.0 * counters.get("vllm:prefix_cache_hits", 0) / queries if queries else 0.0
        return (f"Engine 000: Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
                f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
                f"Running: {len(scheduler.running)} reqs, Waiting: {len(scheduler.waiting)} reqs, "
                f"GPU KV cache usage: {100.0 * self.engine.cache.usage():.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%")

    def maybe_log(self, interval: float | None) -> None:
        """Log `stats_line` (logger `deepinfer.llm`, INFO) when `interval` seconds passed since the
        last, with the throughputs over them; None: never."""
        if interval is None:
            return
        now = time.monotonic()
        last_time, last_prompt, last_gen = self._last_log
        elapsed = now - last_time
        if elapsed < interval:
            return
        prompt = int(self.engine.stats["prompt_tokens"])
        gen = int(self.engine.stats["generation_tokens"])
        span = max(elapsed, 1e-9)
        log.info("%s", self.stats_line((prompt - last_prompt) / span, (gen - last_gen) / span))
        self._last_log = (now, prompt, gen)
        counts = self.engine.spec_counts
        if counts is not None:
            recent, self._last_spec = counts.since(self._last_spec), counts.snapshot()
            if recent.num_drafts:  # (vLLM logs it only over intervals with verify steps too)
                log.info("%s", spec_decode_line(recent, span))

    def _count_prompts(self, finished: Sequence[RequestOutput] = ()) -> None:
        """vLLM counts a request's prompt tokens once, when it produced its first token."""
        for request in list(self.engine.requests.values()):
            if request.output_ids and request.request_id not in self._prompt_counted:
                self._prompt_counted.add(request.request_id)
                self._prompt_tokens += len(request.prompt_token_ids)
        for output in finished:
            if output.request_id in self._prompt_counted:
                self._prompt_counted.discard(output.request_id)
            elif any(c.token_ids for c in output.outputs):
                self._prompt_tokens += len(output.prompt_token_ids or ())

    def _record(self, output: RequestOutput) -> None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        if reason is not None:
            self._success[reason] = self._success.get(reason, 0) + 1
        m = output.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self._samples["vllm:time_to_first_token_seconds"].append(m.time_to_first_token)
        if m.e2e_latency is not None:
            self._samples["vllm:e2e_request_latency_seconds"].append(m.e2e_latency)
        if m.time_in_queue is not None:
            self._samples["vllm:request_queue_time_seconds"].append(m.time_in_queue)
        self._samples["vllm:request_prompt_tokens"].append(float(len(output.prompt_token_ids or ())))
        self._samples["vllm:request_generation_tokens"].append(float(sum(len(c.token_ids) for c in output.outputs)))


def spec_decode_line(counts: SpecDecodeCounts, seconds: float) -> str:
    """vLLM's spec-decode log line for the verify rows of an interval of `seconds` (`counts`,
    at least one row)."""
    accepted, drafted = counts.num_accepted_tokens, counts.num_draft_tokens
    per_pos = ", ".join(f"{a / counts.num_drafts:.3f}" for a in counts.accepted_per_pos)
    return (f"SpecDecoding metrics: Mean acceptance length: {counts.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
            f"Drafted throughput: {drafted / seconds:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}%")
