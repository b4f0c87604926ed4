"""Reading and validating run-batch input lines (the format is in `deepinfer.serve.api.batch`).

Split out of the runner so that everything a user can get wrong in one line lives in one place:
each check raises `LineError` with a message that starts with the field it is about, and the
runner turns it into that line's error, never the whole run's. The file is read as bytes and
each line is decoded on its own, so one line that is not UTF-8 is one error line.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from typing import Any, Mapping

from deepinfer.serve.api.llm import LLM
from deepinfer.serve.api.types import SamplingParams, StructuredOutputsParams
from deepinfer.serve.text.chat import ChatPrompt

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

_OPENAI_SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
                    "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "n")
_VLLM_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                  "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                  "structured_outputs")
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options")
_CHAT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "thinking", "reasoning_effort",
                "chat_template_kwargs", "stream")
_COMPLETION_FIELDS = ("prompt", "stream", "echo", "suffix", "best_of", "response_format")
_SAMPLING_NAMES = frozenset(SamplingParams.field_names()) | set(_OPENAI_SAMPLING)


class LineError(Exception):
    """One input line cannot run; the message starts with the field (or the problem)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class Line:
    number: int  # 1-based line number in the input file
    custom_id: Any = None
    kind: str | None = None  # "chat" | "completion"
    request_id: str | None = None
    chat_prompt: ChatPrompt | None = None
    prompt_text: str | None = None  # a completion's text prompt (None for token ids and chat)
    # a completion's `echo`: the prompt comes back before the generated text (and with `logprobs`,
    # its tokens' logprobs before theirs); `echo_only` (max_tokens 0): nothing but the prompt
    echo: bool = False
    echo_only: bool = False
    prompt_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    # the request field its structured-output constraint came from, when not `structured_outputs`
    constraint_field: str | None = None
    done: bool = False  # --resume: the previous output already has this line's result
    output: dict | None = None  # the finished output line


# ---- reading --------------------------------------------------------------------------------------


def split_lines(data: bytes) -> list[tuple[int, str | LineError]]:
    """(line number, text) for every non-blank line; a line that is not UTF-8 gets a `LineError`.

    Lines end at \\n, \\r\\n or \\r only (not at the Unicode separators `str.splitlines` also
    knows, which may appear raw inside JSON strings). A UTF-8 byte-order mark is ignored.
    """
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines: list[tuple[int, str | LineError]] = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            lines.append((number, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            lines.append((number, LineError(f"not valid UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1} "
                                            f"({e.reason})")))
    return lines


# ---- one line -------------------------------------------------------------------------------------


def parse_line(llm: LLM, line: Line, text: str, first_line_of: dict[str, int], done_ids: frozenset[str]) -> None:
    """Parse and validate one input line into `line` (raises `LineError`).

    `first_line_of` maps each custom_id seen so far to its line (a later line with the same id
    is an error); a line whose custom_id is in `done_ids` is only marked `done`.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise LineError("invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise LineError(f"a batch line must be a JSON object, got {type(data).__name__}")
    if "custom_id" not in data:
        raise LineError("custom_id: required", "custom_id")
    custom_id = data["custom_id"]
    if not isinstance(custom_id, str):
        raise LineError("custom_id: must be a string", "custom_id")
    line.custom_id = custom_id
    if custom_id in first_line_of:
        raise LineError(f"custom_id: duplicate {custom_id!r} (first used on line {first_line_of[custom_id]}); "
                        "custom_ids must be unique in a batch", "custom_id")
    first_line_of[custom_id] = line.number
    if custom_id in done_ids:
        line.done = True
        return
    extra = set(data) - {"custom_id", "method", "url", "body"}
    if extra:
        key = sorted(extra)[0]
        raise LineError(f"{key}: unknown batch line field (custom_id, method, url, body)", key)
    method = data.get("method")
    if method != "POST":
        raise LineError(f"method: must be \"POST\", got {_short(method)}", "method")
    url = data.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise LineError(f"url: unsupported {_short(url)} (supported: {', '.join(URLS)})", "url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError("body: required, a JSON object", "body")
    if url == CHAT_URL:
        line.kind = "chat"
        line.prompt_ids, line.sampling = _prepare_chat(llm, line, body)
    else:
        line.kind = "completion"
        line.prompt_text, line.prompt_ids, line.sampling = _prepare_completion(llm, line, body)


def queue_error(line: Line, error: ValueError) -> LineError:
    """The line error for a request the engine refused to queue (`LLM._add_request`)."""
    message = str(error)
    field, sep, _ = message.partition(":")
    if sep and field.startswith("structured_outputs"):  # its grammar did not compile
        if line.constraint_field is not None:
            message = line.constraint_field + message[len(field):]
        return LineError(message, line.constraint_field or "structured_outputs")
    if sep and field in _SAMPLING_NAMES:  # a sampling value the engine checks against the model
        return LineError(message, field)
    return LineError(f"prompt: {message}", "messages" if line.kind == "chat" else "prompt")


def _short(value: Any, limit: int = 80) -> str:
    text = reprlib.repr(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_of(message: str) -> str | None:
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    values = {k: body[k] for k in (*_OPENAI_SAMPLING, *_VLLM_SAMPLING) if k in body}
    try:
        return SamplingParams.from_dict(values)
    except (TypeError, ValueError) as e:  # TypeError: a value of a type the checks do not expect
        message = str(e)
        if _field_of(message) == "max_tokens" and values.get("max_tokens") is None:  # the request's own name
            message = "max_completion_tokens" + message[len("max_tokens"):]
        raise LineError(message, _field_of(message)) from None


def _check_types(body: Mapping[str, Any], **expected: tuple[type | tuple[type, ...], str]) -> None:
    """Each named field, when present and not null, has one of the expected types."""
    for key, (types, what) in expected.items():
        if body.get(key) is not None and not isinstance(body[key], types):
            raise LineError(f"{key}: must be {what}, got {type(body[key]).__name__}", key)


def _check_fields(body: Mapping[str, Any], own: tuple[str, ...]) -> None:
    allowed = set(own) | set(_OPENAI_SAMPLING) | set(_VLLM_SAMPLING) | set(_IGNORED)
    for key in body:
        if key not in allowed:
            raise LineError(f"{key}: unknown or unsupported request field", key)
    if body.get("stream"):
        raise LineError("stream: streaming responses are not supported in batch mode", "stream")


def _prepare_chat(llm: LLM, line: Line, body: Mapping[str, Any]) -> tuple[list[int], SamplingParams]:
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LineError("messages: required, a non-empty list of message objects", "messages")
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, Mapping):
        raise LineError("chat_template_kwargs: must be an object", "chat_template_kwargs")
    for key in kwargs:
        if key not in ("thinking", "reasoning_effort"):
            raise LineError(f"chat_template_kwargs: unsupported key {key!r} (thinking, reasoning_effort)",
                            "chat_template_kwargs")
    thinking = kwargs.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise LineError(f"chat_template_kwargs: thinking must be a bool, got {thinking!r}", "chat_template_kwargs")
    body_thinking = body.get("thinking")
    if body_thinking is not None:
        if not isinstance(body_thinking, Mapping) or body_thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise LineError("thinking: must be {\"type\": \"enabled\" | \"disabled\" | \"adaptive\"}", "thinking")
        thinking = body_thinking["type"] != "disabled"
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if thinking is None and effort is None:
        thinking = False
    _check_types(body, tools=(list, "a list of tool objects"), response_format=(Mapping, "an object"),
                 tool_choice=((str, Mapping), "a string or an object"), reasoning_effort=(str, "a string"))
    if any(not isinstance(tool, Mapping) for tool in body.get("tools") or ()):
        raise LineError("tools: must be a list of tool objects", "tools")
    if effort is not None and not isinstance(effort, str):
        raise LineError("chat_template_kwargs: reasoning_effort must be a string", "chat_template_kwargs")
    sampling = _sampling(body)
    try:
        prompt = llm.prepare_chat(messages, tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                                  response_format=body.get("response_format"), thinking=thinking,
                                  reasoning_effort=effort, where="messages")
    except ValueError as e:
        raise LineError(str(e), "messages") from None
    except (TypeError, AttributeError, KeyError) as e:  # a value of a type the template does not expect
        raise LineError(f"messages: the conversation cannot be rendered ({type(e).__name__}: {e}); check the "
                        "types in messages, tools, tool_choice and response_format", "messages") from None
    n = len(prompt.token_ids)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        try:
            max_tokens = prompt.resolve_max_tokens(llm.max_model_len)
        except ValueError as e:
            raise LineError(str(e), "messages") from None
        sampling = _replace(sampling, max_tokens=max_tokens)
    else:
        _check_room(llm, n, sampling, "messages")
    if sampling.structured_outputs is None and prompt.output_constraint is not None:
        # the answer follows the response_format or the tools (deepseek-recipe's constraint)
        field = "tools" if prompt.output_constraint[0].startswith("tool_call") else "response_format"
        try:
            sampling = llm.chat_constraint(prompt, sampling, where=field)
        except ValueError as e:
            raise LineError(str(e), field) from None
        line.constraint_field = field
    line.chat_prompt = prompt
    return prompt.token_ids, sampling


def _check_room(llm: LLM, n: int, sampling: SamplingParams, where: str) -> None:
    """The prompt (`where`: its field) and max_tokens fit the context."""
    if n >= llm.max_model_len:
        raise LineError(f"{where}: this model's maximum context length is {llm.max_model_len} tokens, but the "
                        f"prompt has {n} tokens", where)
    if n + sampling.max_tokens > llm.max_model_len:
        raise LineError(f"max_tokens: this model's maximum context length is {llm.max_model_len} tokens, "
                        f"but the request has {n} prompt tokens plus max_tokens={sampling.max_tokens}",
                        "max_tokens")


def _response_format(line: Line, body: Mapping[str, Any], sampling: SamplingParams) -> SamplingParams:
    """`sampling` with the constraint of the body's OpenAI `response_format` (json_object,
    json_schema; vLLM's regex), unless `structured_outputs` gave one."""
    if body.get("response_format") is None or sampling.structured_outputs is not None:
        return sampling
    try:
        constraint = StructuredOutputsParams.from_response_format(body["response_format"])
    except ValueError as e:
        raise LineError(str(e), "response_format") from None
    if constraint is None:
        return sampling
    line.constraint_field = f"response_format.{body['response_format']['type']}"
    return _replace(sampling, structured_outputs=constraint)


def _prepare_completion(llm: LLM, line: Line, body: Mapping[str, Any]) -> tuple[str | None, list[int], SamplingParams]:
    _check_fields(body, _COMPLETION_FIELDS)
    _check_types(body, echo=(bool, "a boolean"))
    line.echo = bool(body.get("echo"))
    asked = body.get("max_tokens") if body.get("max_tokens") is not None else body.get("max_completion_tokens")
    if line.echo and type(asked) is int and asked == 0:
        # vLLM's scoring request: the prompt and, with logprobs, its logprobs; nothing generated.
        # The engine still samples one token (a request ends at a sampled token), never shown
        line.echo_only = True
        body = {**body, "max_tokens": 1, "max_completion_tokens": None}
    if body.get("suffix") is not None:
        raise LineError("suffix: not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise LineError("best_of: only 1 is supported", "best_of")
    if "prompt" not in body:
        raise LineError("prompt: required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    _check_types(body, response_format=(Mapping, "an object"))
    # max_tokens defaults to 16, as in OpenAI's and vLLM's completions
    sampling = _response_format(line, body, _sampling(body))
    if line.echo and sampling.logprobs is not None:  # vLLM: echo with logprobs scores the prompt too
        sampling = _replace(sampling, prompt_logprobs=sampling.logprobs)
    if isinstance(prompt, str):
        if not prompt:
            raise LineError("prompt: the prompt is empty", "prompt")
        try:
            ids = llm.encode_prompt(prompt)
        except ValueError as e:
            raise LineError(f"prompt: {e}", "prompt") from None
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids, text = list(prompt), None
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise LineError("prompt: one prompt per batch line (got a list of prompts)", "prompt")
    else:
        raise LineError("prompt: must be a non-empty string or a list of token ids", "prompt")
    _check_room(llm, len(ids), sampling, "prompt")
    return text, ids, sampling


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    values = params.to_dict()
    values.update(changes)
    return SamplingParams(**values)
