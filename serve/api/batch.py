"""OpenAI batch JSONL runner, the file format `vllm run-batch` reads and writes (`interfaces.md` §1.3).

Input, one request per line::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`url` is `/v1/chat/completions` (body: `messages`, optional `tools`, `tool_choice`,
`response_format`, `thinking` / `reasoning_effort` / vLLM's `chat_template_kwargs`, and the
sampling fields) or `/v1/completions` (body: `prompt` as text or token ids, and the sampling
fields). Sampling fields: OpenAI's `max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `stop`, `seed`, `logprobs` / `top_logprobs`, `presence_penalty`, `frequency_penalty`,
`logit_bias`, `n` (only 1), plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `spaces_between_special_tokens`).

Output, one line per input line and in input order::

    {"id": "batch-...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "batch-req-...", "body": {<chat.completion |
                  text_completion>}},
     "error": null}

A line that cannot run (bad JSON, no `custom_id`, an unknown `url`, `stream: true`, an invalid
or unknown field, a prompt too long for the context) gets `status_code` 400, `body` null and
`error = {"message": "line N: <field>: <problem>", "type": "invalid_request_error", "param": ...,
"line": N}`; the rest of the batch runs. Blank lines are skipped. Every valid line is queued in
the engine at once (continuous batching); results are written as soon as every earlier line is
written, so the file grows in input order.

Chat requests go through deepseek-recipe's request conversion (`prepare_chat`): its validation,
template and effort rules. Thinking is off unless the body asks for it (`thinking`,
`reasoning_effort` or `chat_template_kwargs.thinking`), as in vLLM's DeepSeek templates. The
request's own sampling values are used as given (the library's forced thinking-mode temperature
and top_p are not applied); `max_tokens` defaults to the library's value clamped to the context
(`resolve_max_tokens`). `response_format` changes the prompt text but is not enforced by
constrained decoding yet.

With `prometheus_port`, the `LLM.get_metrics()` values are served at
`http://0.0.0.0:PORT/metrics` under vLLM's names while the batch runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, TextIO

from deepinfer.serve.api.llm import LLM, parse_chat_completion
from deepinfer.serve.api.types import RequestOutput, SamplingParams
from deepinfer.serve.text.chat import ChatPrompt

__all__ = ["CHAT_URL", "COMPLETIONS_URL", "BatchSummary", "metrics_registry", "run_batch"]

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

_OPENAI_SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
                    "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "n")
_VLLM_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                  "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options")
_CHAT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "thinking", "reasoning_effort",
                "chat_template_kwargs", "stream")
_COMPLETION_FIELDS = ("prompt", "stream", "echo", "suffix", "best_of")


class _LineError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class _Line:
    number: int  # 1-based line number in the input file
    custom_id: Any = None
    kind: str | None = None  # "chat" | "completion"
    request_id: str | None = None
    chat_prompt: ChatPrompt | None = None
    sampling: SamplingParams | None = None
    output: dict | None = None  # the finished output line


@dataclass
class BatchSummary:
    total: int = 0
    succeeded: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    failures: list[str] = field(default_factory=list)


# ---- line parsing ---------------------------------------------------------------------------------


def _field_of(message: str) -> str | None:
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    values = {k: body[k] for k in (*_OPENAI_SAMPLING, *_VLLM_SAMPLING) if k in body}
    try:
        return SamplingParams.from_dict(values)
    except ValueError as e:
        raise _LineError(str(e), _field_of(str(e))) from None


def _check_fields(body: Mapping[str, Any], own: tuple[str, ...]) -> None:
    allowed = set(own) | set(_OPENAI_SAMPLING) | set(_VLLM_SAMPLING) | set(_IGNORED)
    for key in body:
        if key not in allowed:
            raise _LineError(f"{key}: unknown or unsupported request field", key)
    if body.get("stream"):
        raise _LineError("stream: streaming responses are not supported in batch mode", "stream")


def _prepare_chat(llm: LLM, line: _Line, body: Mapping[str, Any]) -> tuple[list[int], SamplingParams]:
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _LineError("messages: required, a non-empty list of message objects", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise _LineError("chat_template_kwargs: must be an object", "chat_template_kwargs")
    for key in kwargs:
        if key not in ("thinking", "reasoning_effort"):
            raise _LineError(f"chat_template_kwargs: unsupported key {key!r} (thinking, reasoning_effort)",
                             "chat_template_kwargs")
    thinking = kwargs.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise _LineError(f"chat_template_kwargs: thinking must be a bool, got {thinking!r}", "chat_template_kwargs")
    body_thinking = body.get("thinking")
    if body_thinking is not None:
        if not isinstance(body_thinking, Mapping) or body_thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _LineError("thinking: must be {\"type\": \"enabled\" | \"disabled\" | \"adaptive\"}", "thinking")
        thinking = body_thinking["type"] != "disabled"
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if thinking is None and effort is None:
        thinking = False
    sampling = _sampling(body)
    try:
        prompt = llm.prepare_chat(messages, tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                                  response_format=body.get("response_format"), thinking=thinking,
                                  reasoning_effort=effort, where="messages")
    except ValueError as e:
        raise _LineError(str(e), "messages") from None
    n = len(prompt.token_ids)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        try:
            max_tokens = prompt.resolve_max_tokens(llm.max_model_len)
        except ValueError as e:
            raise _LineError(str(e), "messages") from None
        sampling = _replace(sampling, max_tokens=max_tokens)
    elif n + sampling.max_tokens > llm.max_model_len:
        raise _LineError(f"max_tokens: this model's maximum context length is {llm.max_model_len} tokens, "
                         f"but the request has {n} prompt tokens plus max_tokens={sampling.max_tokens}",
                         "max_tokens")
    line.chat_prompt = prompt
    return prompt.token_ids, sampling


def _prepare_completion(llm: LLM, body: Mapping[str, Any]) -> tuple[str | None, list[int], SamplingParams]:
    _check_fields(body, _COMPLETION_FIELDS)
    if body.get("echo"):
        raise _LineError("echo: echoing the prompt is not supported", "echo")
    if body.get("suffix") is not None:
        raise _LineError("suffix: not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise _LineError("best_of: only 1 is supported", "best_of")
    if "prompt" not in body:
        raise _LineError("prompt: required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    sampling = _sampling(body)  # max_tokens defaults to 16, as in OpenAI's and vLLM's completions
    try:
        if isinstance(prompt, str):
            if not prompt:
                raise _LineError("prompt: the prompt is empty", "prompt")
            return prompt, llm.encode_prompt(prompt), sampling
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt), sampling
    except ValueError as e:
        raise _LineError(f"prompt: {e}", "prompt") from None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _LineError("prompt: one prompt per batch line (got a list of prompts)", "prompt")
    raise _LineError("prompt: must be a non-empty string or a list of token ids", "prompt")


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    values = params.to_dict()
    values.update(changes)
    return SamplingParams(**values)


# ---- response bodies -------------------------------------------------------------------------------


def _chat_logprobs(llm: LLM, output: RequestOutput, k: int | None) -> dict | None:
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[token_id]
        text = chosen.decoded_token if chosen.decoded_token is not None else llm.tokenizer.decode([token_id])
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if (lp.rank or 0) >= 1),
                        key=lambda x: x[0])
        top = []
        for _, tid, lp in ranked[: (k or 0)]:
            tok = lp.decoded_token if lp.decoded_token is not None else llm.tokenizer.decode([tid])
            top.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8"))})
        content.append({"token": text, "logprob": chosen.logprob, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(llm: LLM, output: RequestOutput, k: int | None) -> dict | None:
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[token_id]
        text = chosen.decoded_token if chosen.decoded_token is not None else llm.tokenizer.decode([token_id])
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        offsets.append(offset)
        offset += len(text)
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if (lp.rank or 0) >= 1),
                        key=lambda x: x[0])
        top = {}
        for _, tid, lp in ranked[: (k or 0)]:
            top[lp.decoded_token if lp.decoded_token is not None else llm.tokenizer.decode([tid])] = lp.logprob
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _usage(output: RequestOutput, reasoning_tokens: int | None = None) -> dict:
    prompt = len(output.prompt_token_ids or ())
    completion = len(output.outputs[0].token_ids)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _chat_body(llm: LLM, line: _Line, output: RequestOutput) -> dict:
    parsed = parse_chat_completion(llm.tokenizer, line.chat_prompt, output)
    completion = output.outputs[0]
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if (parsed.content or not parsed.tool_calls) else None}
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    finish = "tool_calls" if parsed.finish_reason == "tool_calls" else completion.finish_reason
    reasoning = None
    if line.chat_prompt.thinking:
        details = (parsed.usage or {}).get("completion_tokens_details") or {}
        reasoning = int(details.get("reasoning_tokens") or 0)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": llm.model_name,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": _chat_logprobs(llm, output, line.sampling.logprobs),
            "finish_reason": finish,
            "stop_reason": completion.stop_reason,
        }],
        "usage": _usage(output, reasoning),
    }


def _completion_body(llm: LLM, line: _Line, output: RequestOutput) -> dict:
    completion = output.outputs[0]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": llm.model_name,
        "choices": [{
            "index": 0,
            "text": completion.text,
            "logprobs": _completion_logprobs(llm, output, line.sampling.logprobs),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }],
        "usage": _usage(output),
    }


def _ok_line(line: _Line, body: dict) -> dict:
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": body},
            "error": None}


def _error_line(line: _Line, message: str, param: str | None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": None},
            "error": {"message": f"line {line.number}: {message}", "type": kind, "param": param,
                      "code": status, "line": line.number}}


# ---- ordered writer --------------------------------------------------------------------------------


class _OrderedWriter:
    """Writes results in input order: a result waits until every earlier line is written."""

    def __init__(self, out: TextIO, lines: list[_Line]):
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
    from deepinfer.serve.api.prometheus import MetricValues, bucket_counts
    from deepinfer.serve.api.prometheus import metrics_registry as registry

    def scrape() -> MetricValues:
        m = llm.get_metrics()
        return MetricValues(
            gauges={name: (doc, m[name]) for name, doc in _GAUGES.items()},
            counters={name: (doc, m[name]) for name, doc in _COUNTERS.items()},
            success=m["vllm:request_success"],
            histograms={name: (doc, tuple(bounds), bucket_counts(bounds, m.get(name, [])), sum(m.get(name, [])))
                        for name, (doc, bounds) in _HISTOGRAMS.items()})

    return registry(scrape, llm.model_name)


def _start_metrics_server(llm: LLM, port: int):
    from prometheus_client import start_http_server

    return start_http_server(port, registry=metrics_registry(llm))


# ---- runner ------------------------------------------------------------------------------------------


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def run_batch(llm: LLM, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              prometheus_port: int | None = None, use_tqdm: bool = True) -> BatchSummary:
    """Run an OpenAI batch JSONL file through `llm`; see the module docstring.

    `input_path` / `output_path` may be "-" for stdin / stdout. Returns the counts of
    succeeded and failed lines. With `prometheus_port` (0 picks a free port), metrics are
    served while the batch runs.
    """
    start = time.monotonic()
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    raw_lines = _read_lines(input_path)
    out = sys.stdout if output_path == "-" else open(output_path, "w", encoding="utf-8")
    server = None
    lines: list[_Line] = []
    queued: dict[str, _Line] = {}
    try:
        if prometheus_port is not None:
            server, _ = _start_metrics_server(llm, prometheus_port)
        writer = _OrderedWriter(out, lines)
        try:
            for number, raw in enumerate(raw_lines, start=1):
                if not raw.strip():
                    continue
                line = _Line(number)
                lines.append(line)
                try:
                    _prepare_line(llm, line, raw)
                except _LineError as e:
                    line.output = _error_line(line, str(e), e.param, e.status)
                    continue
                queued[line.request_id] = line
        except BaseException:
            for request_id in queued:
                llm.engine.abort(request_id)
            raise
        writer.flush()

        def finished(output: RequestOutput) -> None:
            line = queued[output.request_id]
            try:
                body = _chat_body(llm, line, output) if line.kind == "chat" else _completion_body(llm, line, output)
                line.output = _ok_line(line, body)
            except Exception as e:  # noqa: BLE001 - one bad answer must not stop the batch
                line.output = _error_line(line, f"could not build the response: {e}", None, 500)
            writer.flush()

        progress = llm._progress_bar(
            use_tqdm, total=len(queued), desc="Running batch", unit="req", mininterval=5,
            bar_format="{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} "
                       "[{elapsed}<{remaining}, {rate_fmt}]\n")
        llm._run(list(queued), progress=progress, on_output=finished)
        writer.flush()
        if writer.next != len(lines):  # pragma: no cover - every line has an output by now
            raise RuntimeError(f"{len(lines) - writer.next} batch line(s) got no result")
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if out is not sys.stdout:
            out.close()
    summary = BatchSummary(total=len(lines), elapsed_s=time.monotonic() - start)
    for line in lines:
        if line.output["error"] is None:
            summary.succeeded += 1
        else:
            summary.failed += 1
            summary.failures.append(line.output["error"]["message"])
    return summary


def _prepare_line(llm: LLM, line: _Line, raw: str) -> None:
    """Parse, validate and queue one input line (raises `_LineError`)."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _LineError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(data, dict):
        raise _LineError(f"a batch line must be a JSON object, got {type(data).__name__}")
    if isinstance(data.get("custom_id"), str):
        line.custom_id = data["custom_id"]
    if "custom_id" not in data:
        raise _LineError("custom_id: required", "custom_id")
    if not isinstance(data["custom_id"], str):
        raise _LineError("custom_id: must be a string", "custom_id")
    extra = set(data) - {"custom_id", "method", "url", "body"}
    if extra:
        key = sorted(extra)[0]
        raise _LineError(f"{key}: unknown batch line field (custom_id, method, url, body)", key)
    method = data.get("method")
    if method != "POST":
        raise _LineError(f"method: must be \"POST\", got {method!r}", "method")
    url = data.get("url")
    if url not in URLS:
        raise _LineError(f"url: unsupported {url!r} (supported: {', '.join(URLS)})", "url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise _LineError("body: required, a JSON object", "body")
    if url == CHAT_URL:
        line.kind = "chat"
        ids, sampling = _prepare_chat(llm, line, body)
        text = None
    else:
        line.kind = "completion"
        text, ids, sampling = _prepare_completion(llm, body)
    line.sampling = sampling
    try:
        line.request_id = llm._add_request(text, ids, sampling)
    except ValueError as e:
        raise _LineError(f"prompt: {e}", "messages" if line.kind == "chat" else "prompt") from None
