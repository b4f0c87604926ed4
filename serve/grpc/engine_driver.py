"""The engine thread of the gRPC server: the only code that touches the `LLMEngine`.

It loads the model (when given a loader), compiles every step shape a request can need
(`deepinfer.serve.engine.warmup`; optional), then loops: apply the queued commands (add, abort,
call), run `engine.step()` while there is work, and post what each request gained to its
stream's asyncio queue (thread-safely), then the final `RequestOutput`. Handlers on the event
loop only talk to it through `submit`/`abort`/`call`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from deepinfer.serve.api.types import RequestOutput, SamplingParams
from deepinfer.serve.engine.cache import AdmissionError
from deepinfer.serve.engine.warmup import step_shapes, warm_up
from deepinfer.serve.grpc import convert
from deepinfer.serve.grpc.metrics import ServerMetrics

log = logging.getLogger("deepinfer.grpc")

@dataclass
class LoadedModel:
    """An engine plus what GetModelInfo reports about it."""

    engine: Any  # LLMEngine
    model_name: str = "deepinfer"
    model_path: str = ""
    tokenizer_path: str = ""


ModelSource = Any  # LLMEngine | LoadedModel | Callable[[], LLMEngine | LoadedModel]


def _as_loaded(value: Any) -> LoadedModel:
    if isinstance(value, LoadedModel):
        return value
    if hasattr(value, "step") and hasattr(value, "add_request"):
        return LoadedModel(value, model_name=getattr(value.config, "name", "deepinfer"))
    raise TypeError(f"expected an LLMEngine or a LoadedModel, got {type(value).__name__}")


# a field the engine refused (a structured-output spec it could not compile, a TTL class it does
# not know), named by the request's proto field
_CONSTRAINT_FIELDS = {"structured_outputs.json": "sampling_params.json_schema",
                      "structured_outputs.regex": "sampling_params.regex",
                      "structured_outputs.grammar": "sampling_params.ebnf_grammar",
                      "structured_outputs.choice": "sampling_params.choice",
                      "cache_ttl_class": "sampling_params.cache_ttl_class"}


def _proto_field_names(message: str) -> str:
    field, sep, rest = message.partition(":")
    return _CONSTRAINT_FIELDS[field] + sep + rest if sep and field in _CONSTRAINT_FIELDS else message


# ---- the engine thread ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    """One Generate call's request, shared by its handler and the engine thread."""

    rid: str
    prompt: convert.PreparedPrompt
    params: SamplingParams
    want_stream: bool
    interval: int
    n_top: int | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    # engine thread only, per sample (n > 1: one of each per sample index)
    sent_tokens: list[int] = field(default_factory=list)
    sent_text: list[int] = field(default_factory=list)
    seen_tokens: list[int] = field(default_factory=list)
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        n = self.params.n
        self.sent_tokens, self.sent_text, self.seen_tokens = [0] * n, [0] * n, [0] * n


class EngineDriver:
    """Owns the engine in one thread: load, warm up, then step while there is work.

    `on_failed` is called (from the engine thread) when loading or the warm-up fails, and when
    `MAX_CONSECUTIVE_FAILURES` steps in a row failed (the engine is then presumed broken).
    """

    MAX_CONSECUTIVE_FAILURES = 3

    def __init__(self, source: ModelSource, *, metrics: ServerMetrics, warmup: bool = True,
                 on_ready: Callable[[], None] = lambda: None,
                 on_failed: Callable[[BaseException], None] = lambda e: None):
        self._source = source
        self._metrics = metrics
        self._warmup_enabled = warmup
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._main, name="deepinfer-engine", daemon=True)
        self.model: LoadedModel | None = None
        self.warmup_seconds: float | None = None
        self.warmup_done = 0  # shapes compiled so far
        self.warmup_total = 0  # shapes to compile (known once the warm-up starts)
        self.max_token_bytes: int | None = None  # see convert.max_token_bytes
        self.step_failures = 0

    @property
    def engine(self):
        return None if self.model is None else self.model.engine

    # -- called from other threads
    def start(self) -> None:
        self._thread.start()

    def submit(self, stream: _Stream) -> None:
        self._cmds.put(("add", stream))

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps; returns a Future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", (fn, future)))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever is left, end the loop and join the thread."""
        self._cmds.put(("stop", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread
    def _main(self) -> None:
        try:
            source = self._source
            if callable(source) and not isinstance(source, LoadedModel) and not hasattr(source, "step"):
                source = source()
            self.model = _as_loaded(source)
            self.max_token_bytes = self._max_token_bytes()
            if self._warmup_enabled:
                t0 = time.perf_counter()
                self.warmup_total = len(step_shapes(self.engine))
                warm_up(self.engine, progress=self._warmup_progress)
                self.warmup_seconds = time.perf_counter() - t0
                log.info("warm-up done: %d step shapes compiled in %.1f s", self.warmup_done, self.warmup_seconds)
        except BaseException as e:  # noqa: BLE001 - reported to the server, which stays NOT_SERVING
            log.exception("model load / warm-up failed")
            self._on_failed(e)
            self._reject_until_stopped(f"the model failed to load: {type(e).__name__}: {e}")
            return
        self._on_ready()
        self._loop()

    def _warmup_progress(self, i: int, n: int, shape, seconds: float) -> None:
        self.warmup_done, self.warmup_total = i, n
        log.info("warm-up %d/%d: %s compiled in %.1f s", i, n, shape, seconds)

    def _max_token_bytes(self) -> int | None:
        try:
            return convert.max_token_bytes(self.engine.tokenizer)
        except Exception as e:  # noqa: BLE001 - a tokenizer without decode_batch: no early length check
            log.warning("cannot bound the bytes per token of the tokenizer (%s: %s): long texts are only "
                        "refused after tokenizing", type(e).__name__, e)
            return None

    def _reject_until_stopped(self, message: str) -> None:
        while True:
            cmd, arg = self._cmds.get()
            if cmd == "stop":
                return
            if cmd == "add":
                self._post(arg, ("error", message))
            elif cmd == "call":
                arg[1].set_exception(RuntimeError(message))

    def _loop(self) -> None:
        engine = self.engine
        consecutive = 0
        while True:
            stage = "step"
            try:
                if not self._apply_commands(block=not engine.has_unfinished()):
                    return
                if not engine.has_unfinished():
                    continue
                outputs = engine.step()
                stage = "publishing the step's results"
                self._publish(outputs)
            except Exception as e:  # noqa: BLE001 - reported in-band to every stream in flight
                log.exception("engine %s failed", stage)
                self.step_failures += 1
                consecutive += 1
                self._fail_all(f"engine {stage} failed: {type(e).__name__}: {e}")
                if consecutive == self.MAX_CONSECUTIVE_FAILURES:  # e.g. the device cache is gone
                    self._on_failed(RuntimeError(f"{consecutive} engine steps failed in a row; last: {e}"))
            else:
                consecutive = 0

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for the first one when `block`); False on stop."""
        while True:
            try:
                cmd, arg = self._cmds.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd == "add":
                self._add(arg)
            elif cmd == "abort":
                self._abort(arg)
            elif cmd == "call":
                fn, future = arg
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except BaseException as e:  # noqa: BLE001
                        future.set_exception(e)
            elif cmd == "stop":
                for rid in list(self._streams):
                    self._abort(rid)
                return False

    def _add(self, stream: _Stream) -> None:
        try:
            self.engine.add_request(stream.rid, stream.prompt.token_ids, stream.params, prompt=stream.prompt.text)
        except AdmissionError as e:  # the prompt can never fit
            self._post(stream, ("rejected", f"{stream.prompt.field}: {e}"))
            return
        except ValueError as e:  # the engine's own validation ("<field>: ...")
            self._post(stream, ("rejected", _proto_field_names(str(e))))
            return
        except Exception as e:  # noqa: BLE001
            log.exception("add_request failed")
            self._post(stream, ("error", f"add_request failed: {type(e).__name__}: {e}"))
            return
        self._streams[stream.rid] = stream

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        try:
            output = self.engine.abort(rid)
        except Exception as e:  # noqa: BLE001
            log.exception("abort of %s failed", rid)
            if stream is not None:
                self._post(stream, ("error", f"abort failed: {type(e).__name__}: {e}"))
            return
        if stream is not None and output is not None:
            self._final(stream, output, time.monotonic())

    def _fail_all(self, message: str) -> None:
        engine = self.engine
        for rid, stream in list(self._streams.items()):
            try:
                request = engine.requests.get(rid)
                if request is not None and request.finished:  # finished inside the failed step
                    engine.scheduler.finish(request)
                    engine.requests.pop(rid, None)
                else:
                    engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort: the stream gets the error either way
                log.exception("abort of %s after a failed step failed", rid)
            self._metrics.error()
            self._post(stream, ("error", message))
        self._streams.clear()

    def _count_tokens(self, stream: _Stream, index: int, n: int, now: float) -> None:
        """Time-to-first-token and inter-token latency (per token, spread evenly over a step) of
        sample `index`, which has `n` tokens now."""
        new = n - stream.seen_tokens[index]
        if new <= 0:
            return
        if stream.last_token_at is None:
            ttft, itl = now - stream.arrival, [0.0] * (new - 1)
        else:
            ttft, itl = None, [(now - stream.last_token_at) / new] * new
        self._metrics.tokens(ttft=ttft, itl=itl)
        stream.seen_tokens[index] = n
        stream.last_token_at = now

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                self._final(stream, output, now)
        requests = self.engine.requests
        for rid, stream in self._streams.items():
            for index, sample_id in enumerate(self.engine.sample_ids(rid)):
                request = requests.get(sample_id)
                if request is None:  # (waiting for the others: its tokens come with the final)
                    continue
                n = len(request.output_ids)
                self._count_tokens(stream, index, n, now)
                sent = stream.sent_tokens[index]
                if not stream.want_stream or n - sent < stream.interval:
                    continue
                ids = request.output_ids[sent:n]
                text = request.text[stream.sent_text[index]:]
                lps = request.logprobs[sent:n] if request.logprobs is not None else None
                stream.sent_tokens[index], stream.sent_text[index] = n, len(request.text)
                self._post(stream, ("chunk", ids, text, lps, n, index))

    def _final(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        """Post the request's output with each sample's tokens not streamed yet:
        `("final", output, [(index, ids, text, logprobs), ...])`."""
        rest = []
        for index, completion in enumerate(output.outputs):
            n = len(completion.token_ids)
            self._count_tokens(stream, index, n, now)
            sent = stream.sent_tokens[index]
            lps = completion.logprobs[sent:] if completion.logprobs is not None else None
            rest.append((index, list(completion.token_ids[sent:]), completion.text[stream.sent_text[index]:], lps))
            stream.sent_tokens[index], stream.sent_text[index] = n, len(completion.text)
        m = output.metrics
        queue_time = None
        if m is not None and m.first_scheduled_time is not None:
            queue_time = max(0.0, m.first_scheduled_time - m.arrival_time)
        self._metrics.finished(output.outputs[0].finish_reason or "abort",
                               prompt_tokens=len(output.prompt_token_ids or ()),
                               generation_tokens=sum(len(c.token_ids) for c in output.outputs),
                               e2e=now - stream.arrival, queue_time=queue_time)
        self._post(stream, ("final", output, rest))

    @staticmethod
    def _post(stream: _Stream, event: tuple) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
