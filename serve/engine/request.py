"""A request's life inside the engine: its tokens, where its cache lives, how far it has been
computed, and the text and stop state of its output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepinfer.serve.engine.placeholders import PLACEHOLDER
from deepinfer.serve.engine.types import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams
from deepinfer.serve.text.detokenizer import IncrementalDetokenizer
from deepinfer.serve.text.stops import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stops: StopChecker
    arrival_order: int
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    computed: int = 0  # tokens of the sequence whose KV is in the cache
    # tokens sampled by steps whose results the host has not read yet (asynchronous scheduling):
    # they count in `length` and appear as PLACEHOLDER in `ids` until `output_ids` gets them
    pending: int = 0
    # its last token is pending and it will take no more steps: its slot and pages are released,
    # the token read, stop rules applied, else it ends with this finish reason ("length")
    closing: str | None = None
    floor: int = 0  # decoder replay start (compact prefill); set when the prefill starts
    # prefix cache: tokens whose pages came from the cache at admission; the step never writes
    # global KV below it (`StepBatch.write_floor`) while replaying them
    write_floor: int = 0
    # speculative decoding: the drafts its next verify step checks (set by the scheduler, which
    # reserves their pages) and, when not None, drafts proposed on the host to check instead of
    # the drafter's (tests' oracle drafts; used once)
    lookahead: int = 0
    host_drafts: list[int] | None = None
    # confidence-scheduled verification: the moving average of its drafter's confidences per
    # draft position (`verify_schedule.VerifySchedule.observe`); None before its first verify step
    confidence: Any = None
    # structured output: the request's grammar state (`serve.structured.RequestConstraint`), or None
    constraint: Any = None
    # prompt logprobs: each scored chunk's (tokens, pending scores) by its start (`prompt_logprobs.py`)
    prompt_scores: dict = field(default_factory=dict)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    seed: int = 0  # of the counter-based sampling noise: the params' seed, or one the engine drew
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output: a new list of the whole sequence (O(length); steps use `ids`)."""
        return self.prompt_token_ids + self.output_ids

    def ids(self, start: int, end: int) -> np.ndarray:
        """int32 token ids at positions `[start, end)` of prompt + output + pending (clipped to
        the sequence), read from the two lists without joining them: O(end - start)."""
        n, known = len(self.prompt_token_ids), self.known
        start, end = max(0, start), min(end, self.length)
        out = self.prompt_token_ids[start:min(end, n)] + self.output_ids[max(start - n, 0):max(min(end, known) - n, 0)]
        return np.asarray(out + [PLACEHOLDER] * (end - max(start, known)) if end > known else out, np.int32)

    @property
    def known(self) -> int:
        """Tokens the host has: prompt + read output."""
        return len(self.prompt_token_ids) + len(self.output_ids)

    @property
    def length(self) -> int:
        return self.known + self.pending

    @property
    def to_feed(self) -> int:
        """Tokens not in the cache yet; the last of them yields the next sample."""
        return self.length - self.computed

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def flush_text(self) -> None:
        """The text the detokenizer and the stop-string checker still hold back, appended (the
        request ends)."""
        if self.detokenizer is not None:
            self.text += self.stops.feed(self.detokenizer.flush()).text
            self.text += self.stops.flush()

    def check_stop(self, token: int, eos_token_id: int, max_len: int) -> bool:
        """The stop rules for `token`, just appended to `output_ids`, in vLLM's order: a stop
        string completed by its text, EOS (unless `ignore_eos`) and `stop_token_ids` (these three
        once `min_tokens` are out), then `max_tokens` and the context of `max_len` tokens. True
        when the request ends here, with its finish and stop reasons set and its text flushed."""
        params = self.params
        n_out = len(self.output_ids)
        if self.detokenizer is not None:
            update = self.stops.feed(self.detokenizer.push(token))
            self.text += update.text
            if update.stopped and n_out >= params.min_tokens:
                self.finish_reason, self.stop_reason = "stop", update.stop_reason
                return True
        if n_out >= params.min_tokens:
            if token == eos_token_id and not params.ignore_eos:
                self.finish_reason = "stop"
                self.flush_text()
                return True
            if params.stop_token_ids and token in params.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token
                self.flush_text()
                return True
        limit = params.max_tokens if params.max_tokens is not None else float("inf")
        if n_out >= limit or self.length >= max_len:
            self.finish_reason = "length"
            self.flush_text()
            return True
        return False

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_ids),
            cumulative_logprob=self.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), None, [completion],
                             self.finished, self.metrics, self.write_floor)
