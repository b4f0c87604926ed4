"""OpenAI batch JSONL runner, the file format `vllm run-batch` reads and writes (`interfaces.md` §1.3).

Input, one request per line::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`url` is `/v1/chat/completions` (body: `messages`, optional `tools`, `tool_choice`,
`response_format`, `thinking` / `reasoning_effort` / vLLM's `chat_template_kwargs`, and the
sampling fields) or `/v1/completions` (body: `prompt` as text or token ids, `echo`, and the
sampling fields; vLLM's `echo`: the prompt's text, and with `logprobs` its tokens' logprobs, come
before the completion's; `max_tokens: 0` with `echo` scores the prompt only). Sampling fields:
OpenAI's `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `stop`, `seed`,
`logprobs` / `top_logprobs`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `n` (one
choice per sample), plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `spaces_between_special_tokens`).

Output, one line per input line and in input order::

    {"id": "batch-...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "batch-req-...", "body": {<chat.completion |
                  text_completion>}},
     "error": null}

A line that cannot run (not UTF-8, bad or too deeply nested JSON, no `custom_id` or one an
earlier line already used, an unknown `url`, `stream: true`, an invalid or unknown field, a token
id outside the vocabulary, a prompt too long for the context) gets `status_code` 400, `body` null
and `error = {"message": "line N: <field>: <problem>", "type": "invalid_request_error", "param":
..., "line": N}`; the rest of the batch runs. Blank lines are skipped. Every valid line is queued
in the engine at once (continuous batching); results are written as soon as every earlier line is
written, so the file grows in input order. If an engine step raises, the unfinished requests are
run again in halves until the failure is down to one line, which gets it as its error (status
500, `server_error`); the other lines complete.

Resuming (`previous=read_previous(output)`, `deepinfer run-batch --resume`): input lines whose
custom_id already has a successful result in the output file are skipped; that file is rewritten
to hold only those results (error lines and a truncated last line are dropped, so their lines run
again) and the new results are appended after them, in input order.

Chat requests go through deepseek-recipe's request conversion (`prepare_chat`): its validation,
template and effort rules. Thinking is off unless the body asks for it (`thinking`,
`reasoning_effort` or `chat_template_kwargs.thinking`), as in vLLM's DeepSeek templates. The
request's own sampling values are used as given (the library's forced thinking-mode temperature
and top_p are not applied); `max_tokens` defaults to the library's value clamped to the context
(`resolve_max_tokens`). `response_format` and `tools` are enforced by constrained decoding
(`LLM.chat_constraint`).

With `prometheus_port`, the `LLM.get_metrics()` values are served at
`http://0.0.0.0:PORT/metrics` under vLLM's names while the batch runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TextIO

from deepinfer.serve.api.batch_lines import (CHAT_URL, COMPLETIONS_URL, Line, LineError, parse_line, queue_error,
                                             split_lines)
from deepinfer.serve.api.batch_resume import PreviousOutput, read_previous, rewrite_kept
from deepinfer.serve.api.llm import LLM, parse_chat_completion
from deepinfer.serve.api.types import CompletionOutput, RequestOutput

__all__ = ["CHAT_URL", "COMPLETIONS_URL", "BatchSummary", "PreviousOutput", "metrics_registry", "read_previous",
           "run_batch"]

_log = logging.getLogger("deepinfer.batch")
_MAX_MESSAGE = 1000  # characters of an error line's message


@dataclass
class BatchSummary:
    total: int = 0  # result lines written by this run
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0  # input lines whose result the previous output already had (resume)
    elapsed_s: float = 0.0
    failures: list[str] = field(default_factory=list)


# ---- response bodies -------------------------------------------------------------------------------


def _top(llm: LLM, entry: dict, k: int | None) -> list[tuple[str, float]]:
    """(text, logprob) of a position's `k` most likely tokens, best first."""
    ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if (lp.rank or 0) >= 1),
                    key=lambda x: x[0])
    return [(lp.decoded_token if lp.decoded_token is not None else llm.tokenizer.decode([tid]), lp.logprob)
            for _, tid, lp in ranked[: (k or 0)]]


def _chat_logprobs(llm: LLM, completion: CompletionOutput, k: int | None) -> dict | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[token_id]
        text = chosen.decoded_token if chosen.decoded_token is not None else llm.tokenizer.decode([token_id])
        top = [{"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}
               for tok, logprob in _top(llm, entry, k)]
        content.append({"token": text, "logprob": chosen.logprob, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(llm: LLM, token_ids: list[int], entries: list, k: int | None, echoed: int = 0) -> dict:
    """OpenAI's completion logprobs of `token_ids`, from their `{token: Logprob}` entries (None:
    no score, the first prompt token of an echo: its logprob and top are null). The first
    `echoed` tokens are the prompt's: the echoed text leaves out special tokens (BOS), so their
    `text_offset`s advance by what they show there."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for i, (token_id, entry) in enumerate(zip(token_ids, entries)):
        chosen = None if entry is None else entry[token_id]
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
            else llm.tokenizer.decode([token_id], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(None if chosen is None else chosen.logprob)
        offsets.append(offset)
        offset += len(llm.tokenizer.decode([token_id]) if i < echoed else text)
        top_logprobs.append(None if entry is None else dict(_top(llm, entry, k)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _completion_choice(llm: LLM, line: Line, output: RequestOutput, completion: CompletionOutput) -> dict:
    """One choice of a text completion; with `echo` (vLLM's), the prompt's text and, when logprobs
    were asked, its tokens' logprobs come first (`echo_only`: nothing else)."""
    k, echoed = line.sampling.logprobs, 0
    token_ids = [] if line.echo_only else list(completion.token_ids)
    entries = None if completion.logprobs is None else ([] if line.echo_only else list(completion.logprobs))
    text = "" if line.echo_only else completion.text
    if line.echo:
        prompt_ids = list(output.prompt_token_ids or ())
        prompt_text = line.prompt_text if line.prompt_text is not None else llm.tokenizer.decode(prompt_ids)
        text = prompt_text + text
        if entries is not None:
            if output.prompt_logprobs is None:
                raise ValueError("echo: the prompt's logprobs are missing")
            token_ids, entries = prompt_ids + token_ids, list(output.prompt_logprobs) + entries
            echoed = len(prompt_ids)
    return {
        "index": completion.index,
        "text": text,
        "logprobs": None if entries is None else _completion_logprobs(llm, token_ids, entries, k, echoed),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def _usage(output: RequestOutput, reasoning_tokens: int | None = None, echo_only: bool = False) -> dict:
    """OpenAI's usage: the prompt once, the tokens of every choice (none shown: `echo_only`)."""
    prompt = len(output.prompt_token_ids or ())
    completion = 0 if echo_only else sum(len(c.token_ids) for c in output.outputs)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _chat_body(llm: LLM, line: Line, output: RequestOutput) -> dict:
    choices, reasoning = [], None
    for completion in output.outputs:
        parsed = parse_chat_completion(llm.tokenizer, line.chat_prompt, output, completion.index)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": parsed.content if (parsed.content or not parsed.tool_calls) else None}
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        if line.chat_prompt.thinking:
            details = (parsed.usage or {}).get("completion_tokens_details") or {}
            reasoning = (reasoning or 0) + int(details.get("reasoning_tokens") or 0)
        choices.append({
            "index": completion.index,
            "message": message,
            "logprobs": _chat_logprobs(llm, completion, line.sampling.logprobs),
            "finish_reason": "tool_calls" if parsed.finish_reason == "tool_calls" else completion.finish_reason,
            "stop_reason": completion.stop_reason,
        })
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": llm.model_name,
        "choices": choices,
        "usage": _usage(output, reasoning),
    }


def _completion_body(llm: LLM, line: Line, output: RequestOutput) -> dict:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": llm.model_name,
        "choices": [_completion_choice(llm, line, output, completion) for completion in output.outputs],
        "usage": _usage(output, echo_only=line.echo_only),
    }


def _ok_line(line: Line, body: dict) -> dict:
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": body},
            "error": None}


def _error_line(line: Line, message: str, param: str | None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if len(message) > _MAX_MESSAGE:  # e.g. the repr of a huge or deeply nested value
        message = message[: _MAX_MESSAGE - 3] + "..."
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": None},
            "error": {"message": f"line {line.number}: {message}", "type": kind, "param": param,
                      "code": status, "line": line.number}}


# ---- ordered writer --------------------------------------------------------------------------------


class _OrderedWriter:
    """Writes results in input order: a result waits until every earlier line is written."""

    def __init__(self, out: TextIO, lines: list[Line]):
        self.out = out
        self.lines = lines
        self.next = 0

    def flush(self) -> None:
        wrote = False
        while self.next < len(self.lines) and self.lines[self.next].output is not None:
            self.out.write(json.dumps(self.lines[self.next].output, ensure_ascii=False) + "\n")
            self.next += 1
            wrote = True
        if wrote:
            self.out.flush()


# ---- Prometheus --------------------------------------------------------------------------------------

_GAUGES = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
_COUNTERS = {
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemptions from the engine.",
}
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.",
                                         [0.005 * 2 ** i for i in range(16)]),
    "vllm:e2e_request_latency_seconds": ("Histogram of end-to-end request latency in seconds.",
                                         [0.05 * 2 ** i for i in range(16)]),
    "vllm:request_queue_time_seconds": ("Histogram of time spent waiting in the queue in seconds.",
                                        [0.005 * 2 ** i for i in range(16)]),
    "vllm:request_prompt_tokens": ("Number of prefill tokens per request.", [float(2 ** i) for i in range(21)]),
    "vllm:request_generation_tokens": ("Number of generation tokens per request.",
                                       [float(2 ** i) for i in range(21)]),
}


def metrics_registry(llm: LLM):
    """A `prometheus_client.CollectorRegistry` exposing `llm.get_metrics()` at every scrape
    (vLLM's names and labels; see `deepinfer.serve.api.prometheus`)."""
    from deepinfer.serve.api.prometheus import MetricValues, bucket_counts, engine_counter_values
    from deepinfer.serve.api.prometheus import metrics_registry as registry

    def scrape() -> MetricValues:
        m = llm.get_metrics()
        spec, per_pos = engine_counter_values(m)
        return MetricValues(
            gauges={name: (doc, m[name]) for name, doc in _GAUGES.items()},
            counters={**{name: (doc, m[name]) for name, doc in _COUNTERS.items()}, **spec},
            success=m["vllm:request_success"],
            histograms={name: (doc, tuple(bounds), bucket_counts(bounds, m.get(name, [])), sum(m.get(name, [])))
                        for name, (doc, bounds) in _HISTOGRAMS.items()},
            labelled=per_pos)

    return registry(scrape, llm.model_name)


def _start_metrics_server(llm: LLM, port: int):
    from prometheus_client import start_http_server

    return start_http_server(port, registry=metrics_registry(llm))


# ---- runner ------------------------------------------------------------------------------------------


def _read_input(path: str) -> bytes:
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        return stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    with open(path, "rb") as f:
        return f.read()


def _parse(llm: LLM, data: bytes, done_ids: frozenset[str]) -> tuple[list[Line], int]:
    """Every non-blank input line, validated (bad ones already hold their error line), and the
    number of lines skipped because `done_ids` has their custom_id."""
    lines: list[Line] = []
    first_line_of: dict[str, int] = {}
    skipped = 0
    for number, text in split_lines(data):
        line = Line(number)
        try:
            if isinstance(text, LineError):
                raise text
            parse_line(llm, line, text, first_line_of, done_ids)
        except LineError as e:
            line.output = _error_line(line, str(e), e.param, e.status)
        except RecursionError:
            line.output = _error_line(line, "the request is nested too deeply", None)
        except Exception as e:  # noqa: BLE001 - a case the checks did not foresee is still one line's error
            line.output = _error_line(line, f"could not read the request: {type(e).__name__}: {e}", None, 500)
        if line.done:
            skipped += 1
        else:
            lines.append(line)
    return lines, skipped


class _KeepOpen:
    """The batch's progress bar, passed to each `LLM._run` call (which closes what it is given)."""

    def __init__(self, progress):
        self.progress = progress

    def update(self, output: RequestOutput) -> None:
        self.progress.update(output)

    def close(self) -> None:
        pass


def _queue(llm: LLM, group: list[Line], by_request: dict[str, Line]) -> list[str]:
    """Add the lines to the engine (their request ids); a line it refuses gets its error line."""
    ids: list[str] = []
    try:
        for line in group:
            try:
                line.request_id = llm._add_request(line.prompt_text, line.prompt_ids, line.sampling)
            except ValueError as e:
                error = queue_error(line, e)
                line.output = _error_line(line, str(error), error.param, error.status)
                continue
            except Exception as e:  # noqa: BLE001 - one request the engine cannot take is one line's error
                line.output = _error_line(line, f"could not queue the request: {type(e).__name__}: {e}", None, 500)
                continue
            by_request[line.request_id] = line
            ids.append(line.request_id)
    except BaseException:
        for request_id in ids:
            llm.engine.abort(request_id)
        raise
    return ids


def _run_lines(llm: LLM, lines: list[Line], progress, writer: _OrderedWriter) -> None:
    """Queue `lines` in the engine and step it until each has its output line.

    When an engine step raises, `LLM._run` aborts every unfinished request. Those lines are run
    again in two halves, one after the other, and so on: a failure that is down to one line gives
    that line an error (status 500, the exception's message) and the others run to the end.
    Finished lines keep their results; only the lines that shared a failing step are recomputed.
    """
    by_request: dict[str, Line] = {}

    def finished(output: RequestOutput) -> None:
        line = by_request.pop(output.request_id)
        try:
            body = _chat_body(llm, line, output) if line.kind == "chat" else _completion_body(llm, line, output)
            line.output = _ok_line(line, body)
        except Exception as e:  # noqa: BLE001 - one bad answer must not stop the batch
            line.output = _error_line(line, f"could not build the response: {e}", None, 500)
        writer.flush()

    groups = [lines]  # a stack: the next group to run is last
    while groups:
        group = groups.pop()
        ids = _queue(llm, group, by_request)
        writer.flush()
        try:
            llm._run(ids, progress=_KeepOpen(progress), on_output=finished)
        except OSError:  # writing the output failed: the run cannot go on
            raise
        except Exception as e:  # noqa: BLE001 - narrowed down to the line that causes it, below
            left = [line for line in group if line.output is None]
            for line in left:
                by_request.pop(line.request_id, None)
            if len(left) == 1:
                left[0].output = _error_line(left[0], f"the engine failed running this request: "
                                                      f"{type(e).__name__}: {e}", None, 500)
                writer.flush()
            elif left:
                _log.warning("run-batch: an engine step failed (%s: %s); running its %d unfinished requests "
                             "again in two halves to find the line that causes it", type(e).__name__, e, len(left))
                half = len(left) // 2
                groups += [left[half:], left[:half]]


def run_batch(llm: LLM, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              prometheus_port: int | None = None, use_tqdm: bool = True,
              previous: PreviousOutput | None = None) -> BatchSummary:
    """Run an OpenAI batch JSONL file through `llm`; see the module docstring.

    `input_path` / `output_path` may be "-" for stdin / stdout. Returns the counts of
    succeeded and failed lines. With `prometheus_port` (0 picks a free port), metrics are
    served while the batch runs. With `previous` (`read_previous(output_path)`: resume an
    interrupted run), input lines whose custom_id has a successful result there are skipped, the
    output file is rewritten to hold only those results, and the new results are appended.
    """
    start = time.monotonic()
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    lines, skipped = _parse(llm, _read_input(input_path), previous.done_ids if previous else frozenset())
    if output_path == "-":
        out = sys.stdout
    elif previous is not None and os.path.isfile(output_path):
        rewrite_kept(output_path, previous)
        out = open(output_path, "a", encoding="utf-8")
    else:
        out = open(output_path, "w", encoding="utf-8")
    server = None
    try:
        if prometheus_port is not None:
            server, _ = _start_metrics_server(llm, prometheus_port)
        writer = _OrderedWriter(out, lines)
        writer.flush()
        runnable = [line for line in lines if line.output is None]
        progress = llm._progress_bar(
            use_tqdm, total=len(runnable), desc="Running batch", unit="req", mininterval=5,
            bar_format="{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} "
                       "[{elapsed}<{remaining}, {rate_fmt}]\n")
        try:
            _run_lines(llm, runnable, progress, writer)
        finally:
            progress.close()
        writer.flush()
        if writer.next != len(lines):  # pragma: no cover - every line has an output by now
            raise RuntimeError(f"{len(lines) - writer.next} batch line(s) got no result")
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if out is not sys.stdout:
            out.close()
    summary = BatchSummary(total=len(lines), skipped=skipped, elapsed_s=time.monotonic() - start)
    for line in lines:
        if line.output["error"] is None:
            summary.succeeded += 1
        else:
            summary.failed += 1
            summary.failures.append(line.output["error"]["message"])
    return summary
