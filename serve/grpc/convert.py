"""Between the wire and the engine: request validation and message building for the gRPC server.

Nothing here touches the network or the engine's state; the server calls these on its event loop
(or a worker thread for tokenization) and hands the engine plain values.

* `sampling_params_from_proto` turns `SamplingParams` (plus the logprob switches of
  `GenerateRequest`) into the engine's `SamplingParams`, applying the defaults of unset `optional`
  fields and naming the offending field, by its proto path, in every error.
* `prompt_from_request` / `prompt_from_input` resolve the `input` oneof (token ids, text, chat) into
  prompt token ids and check them against the vocabulary and the context.
* `chunk_message` / `complete_message` build the stream messages from engine results.

Errors are `InvalidArgument(field, message)`: the server answers them with INVALID_ARGUMENT and
the text `"<field>: <message>"`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from deepinfer.serve.api.types import MAX_LOGPROBS, Logprob, RequestOutput, SamplingParams, StructuredOutputsParams
from deepinfer.serve.grpc import deepinfer_engine_pb2 as pb

__all__ = [
    "InvalidArgument",
    "MAX_JSON_DEPTH",
    "MAX_LOGPROBS",
    "MAX_REQUEST_ID_BYTES",
    "PreparedPrompt",
    "check_request_id",
    "chunk_message",
    "complete_message",
    "input_logprobs_message",
    "logprobs_message",
    "max_token_bytes",
    "prompt_from_input",
    "reasoning_token_count",
    "sampling_params_from_proto",
]

MAX_REQUEST_ID_BYTES = 256  # a request id is echoed in every stream message: keep it short
MAX_JSON_DEPTH = 64  # nesting of chat messages / tools JSON (a tool schema needs a few levels)

# engine (vLLM) name -> proto field name, where they differ
_PROTO_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "include_stop_str_in_output": "no_stop_trim",
}


class InvalidArgument(ValueError):
    """A request field with a bad value; `str()` is "<field path>: <message>"."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_request_id(request_id: str, field: str = "request_id") -> None:
    """A client's request id: at most `MAX_REQUEST_ID_BYTES` bytes of printable text (it is echoed
    in every stream message and in logs)."""
    size = len(request_id.encode("utf-8"))
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(field, f"must be at most {MAX_REQUEST_ID_BYTES} bytes, got {size}")
    if not request_id.isprintable():
        raise InvalidArgument(field, "must be printable text (no control characters or line breaks)")


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of input text one token of `tokenizer`'s vocabulary can stand for (added
    and special tokens included; a byte-level fragment decodes to U+FFFD, which over-counts: safe).

    A text longer than `max_len * max_token_bytes(tokenizer)` bytes cannot fit `max_len` tokens,
    so it is refused before tokenizing. Computed once per server (a fraction of a second)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    return max(1, max(len(t.encode("utf-8")) for t in texts))


def _f32(value: float) -> float:
    """A float32 wire value as the decimal the client most likely wrote (0.8f -> 0.8, not 0.800000011920929).

    numpy prints the shortest decimal that reads back as the same float32.
    """
    value = float(value)
    if not math.isfinite(value):
        return value
    return float(str(np.float32(value)))


def _rename_error(e: ValueError, prefix: str = "sampling_params") -> InvalidArgument:
    text = str(e)
    name, sep, rest = text.partition(": ")
    if not sep or " " in name:
        return InvalidArgument(prefix, text)
    return InvalidArgument(f"{prefix}.{_PROTO_NAMES.get(name, name)}", rest)


def _logprobs_setting(sp: pb.SamplingParams, request: pb.GenerateRequest | None) -> int | None:
    """vLLM `logprobs` from `sampling_params.logprobs` and/or `return_logprob` + `top_logprobs_num`."""
    own = sp.logprobs if sp.HasField("logprobs") else None
    wanted = None
    if request is not None:
        if request.top_logprobs_num < 0:
            raise InvalidArgument("top_logprobs_num", f"must be non-negative, got {request.top_logprobs_num}")
        if request.return_logprob:
            wanted = request.top_logprobs_num
    if own is not None and wanted is not None and own != wanted:
        raise InvalidArgument("sampling_params.logprobs",
                              f"{own} conflicts with return_logprob and top_logprobs_num={wanted}")
    value = own if own is not None else wanted
    if value is not None:
        field = "sampling_params.logprobs" if own is not None else "top_logprobs_num"
        if value < 0:
            raise InvalidArgument(field, f"must be non-negative, got {value}")
        if value > MAX_LOGPROBS:
            raise InvalidArgument(field, f"at most {MAX_LOGPROBS} alternatives are supported, got {value}")
    return value


def _constraint(sp: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The structured-output constraint of the proto's `constraint` oneof (compiled by the engine)."""
    which = sp.WhichOneof("constraint")
    if which is None:
        return None
    field = f"sampling_params.{which}"
    if which == "structural_tag":
        raise InvalidArgument(field, "structural tags are not supported (use json_schema, regex, ebnf_grammar "
                                     "or choice)")
    try:
        if which == "json_schema":
            try:
                schema = json.loads(sp.json_schema)
            except json.JSONDecodeError as e:
                raise InvalidArgument(field, f"not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
            return StructuredOutputsParams(json=schema)
        if which == "choice":
            return StructuredOutputsParams(choice=list(sp.choice.choices))
        return StructuredOutputsParams(**{"regex" if which == "regex" else "grammar": getattr(sp, which)})
    except InvalidArgument:
        raise
    except ValueError as e:
        raise InvalidArgument(field, str(e).partition(": ")[2]) from None


def sampling_params_from_proto(sp: pb.SamplingParams, request: pb.GenerateRequest | None = None, *,
                               vocab_size: int, default_max_tokens: int | None = None) -> SamplingParams:
    """The engine's `SamplingParams` for a proto `SamplingParams` (unset optional fields take the
    engine defaults; `max_new_tokens` unset takes `default_max_tokens`, None = up to the context)."""
    constraint = _constraint(sp)
    if sp.custom_params.fields:
        raise InvalidArgument("sampling_params.custom_params",
                              f"no custom parameters are supported, got {sorted(sp.custom_params.fields)}")
    if sp.HasField("stream_interval") and sp.stream_interval < 1:
        raise InvalidArgument("sampling_params.stream_interval", f"must be at least 1, got {sp.stream_interval}")
    if sp.n < 0:
        raise InvalidArgument("sampling_params.n", f"must be at least 1, got {sp.n}")
    for tid in sp.stop_token_ids:
        if tid >= vocab_size:
            raise InvalidArgument("sampling_params.stop_token_ids",
                                  f"id {tid} is outside the vocabulary [0, {vocab_size})")
    bias: dict[int, float] = {}
    for key, value in sp.logit_bias.items():
        try:
            tid = int(key.strip())
        except ValueError:
            raise InvalidArgument("sampling_params.logit_bias", f"token id {key!r} is not an integer") from None
        if not 0 <= tid < vocab_size:
            raise InvalidArgument("sampling_params.logit_bias",
                                  f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        bias[tid] = _f32(value)
    logprobs = _logprobs_setting(sp, request)
    prompt_logprobs = None
    if request is not None:
        if request.logprob_start_len < -1:
            raise InvalidArgument("logprob_start_len", f"must be -1 (no prompt logprobs) or a prompt position, "
                                                       f"got {request.logprob_start_len}")
        if request.return_logprob and request.logprob_start_len >= 0:  # SGLang: the prompt's too
            prompt_logprobs = request.top_logprobs_num
    kwargs: dict[str, Any] = dict(
        n=sp.n or 1,
        temperature=_f32(sp.temperature) if sp.HasField("temperature") else 1.0,
        top_p=_f32(sp.top_p) if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k if sp.HasField("top_k") else 0,
        min_p=_f32(sp.min_p),
        frequency_penalty=_f32(sp.frequency_penalty),
        presence_penalty=_f32(sp.presence_penalty),
        repetition_penalty=_f32(sp.repetition_penalty) if sp.repetition_penalty != 0 else 1.0,
        max_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else default_max_tokens,
        stop=list(sp.stop),
        stop_token_ids=[int(t) for t in sp.stop_token_ids],
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(sp.spaces_between_special_tokens
                                       if sp.HasField("spaces_between_special_tokens") else True),
        min_tokens=sp.min_new_tokens,
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.no_stop_trim,
        seed=sp.seed if sp.HasField("seed") else None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        detokenize=sp.detokenize if sp.HasField("detokenize") else True,
        logit_bias=bias or None,
        structured_outputs=constraint,
        cache_ttl_class=sp.cache_ttl_class if sp.HasField("cache_ttl_class") else None,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise _rename_error(e) from None


# ---- prompts ----------------------------------------------------------------------------------


@dataclass
class PreparedPrompt:
    """What the engine runs for one request's input."""

    token_ids: list[int]
    text: str | None  # prompt text (the input text, the rendered chat, or original_text)
    field: str  # the proto field the prompt came from (for error messages)
    chat: Any = None  # the `ChatPrompt` of a chat input


_THINKING = {
    pb.THINKING_MODE_UNSPECIFIED: None,
    pb.THINKING_MODE_DISABLED: False,
    pb.THINKING_MODE_ENABLED: True,
}


def _json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (iterative: no recursion on hostile input)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, depth)
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _json_list(text: str, field: str, *, required: bool) -> list | None:
    if not text.strip():
        if required:
            raise InvalidArgument(field, "is empty")
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(field, f"is not valid JSON: {e}") from None
    except RecursionError:  # the C parser gives up on ~1000 levels before any other check
        raise InvalidArgument(field, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep") from None
    depth = _json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgument(field, f"JSON is nested {depth} levels deep, at most {MAX_JSON_DEPTH} are allowed")
    if not isinstance(value, list):
        raise InvalidArgument(field, f"must be a JSON array, got {type(value).__name__}")
    if required and not value:
        raise InvalidArgument(field, "must hold at least one message")
    if not all(isinstance(v, dict) for v in value):
        raise InvalidArgument(field, "every entry must be a JSON object")
    return value


def chat_prompt(chat: pb.ChatInput, *, field: str, model_type: str, tokenizer) -> Any:
    """Encode a `ChatInput` with the DeepSeek chat encoding; bad input -> InvalidArgument."""
    from deepinfer.serve.text.chat import ChatEncodingError, prepare_chat

    messages = _json_list(chat.messages_json, f"{field}.messages_json", required=True)
    tools = _json_list(chat.tools_json, f"{field}.tools_json", required=False)
    if chat.thinking_mode not in _THINKING:
        raise InvalidArgument(f"{field}.thinking_mode", f"unknown value {chat.thinking_mode}")
    thinking = _THINKING[chat.thinking_mode]
    effort = chat.reasoning_effort.strip() or None
    if thinking is None and effort is None:
        thinking = False  # as LLM.chat: thinking off unless asked for
    try:
        return prepare_chat(messages, model_type=model_type, tokenizer=tokenizer, thinking=thinking,
                            reasoning_effort=effort, tools=tools)
    except RecursionError:
        raise InvalidArgument(field, "the messages are nested too deeply to render") from None
    except (ChatEncodingError, ValueError, TypeError, KeyError) as e:
        raise InvalidArgument(field, str(e) or type(e).__name__) from None


def _no_room(field: str, n: int, max_len: int) -> InvalidArgument:
    return InvalidArgument(field, f"prompt of {n} tokens does not fit the context of {max_len} tokens "
                                  f"(at most {max_len - 1} prompt tokens)")


def _too_long(field: str, size: int, max_bytes: int, max_len: int, what: str) -> InvalidArgument:
    return InvalidArgument(field, f"{what} of {size} bytes cannot fit the context of {max_len} tokens "
                                  f"(at most {max_bytes} bytes: no token of the vocabulary covers more than "
                                  f"{max_bytes // max_len} bytes)")


def _check_chat_size(chat: pb.ChatInput, field: str, max_bytes: int, max_len: int) -> None:
    """Refuse, before rendering, a chat whose system/user text alone cannot fit (the encoding may
    trim the ends of a message, never drops its middle)."""
    if 4 * len(chat.messages_json) <= max_bytes:  # a character is at most 4 UTF-8 bytes: it fits
        return
    messages = _json_list(chat.messages_json, field, required=True)
    size = 0
    for message in messages:
        if message.get("role") not in ("system", "user"):
            continue
        content = message.get("content")
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        for part in parts:
            text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str):
                size += len(text.strip().encode("utf-8"))
    if size > max_bytes:
        raise _too_long(field, size, max_bytes, max_len, "the system and user messages")


def prompt_from_input(kind: str | None, value: Any, *, field_prefix: str = "", tokenizer, config,
                      max_len: int, max_token_bytes: int | None = None) -> PreparedPrompt:
    """Prompt ids for one `input` oneof member (`kind` = tokenized | text | chat | None).

    Checks: not empty, ids inside the vocabulary, shorter than the context (`max_len` tokens, and
    at least one token must be left to generate). With `max_token_bytes` (see `max_token_bytes()`)
    a text that cannot fit is refused by its byte length, before it is tokenized.
    """
    if kind is None:
        raise InvalidArgument(f"{field_prefix}input", "one of tokenized, text or chat is required")
    field = f"{field_prefix}{kind}"
    vocab = config.vocab_size
    max_bytes = None if max_token_bytes is None else max_len * max_token_bytes
    if kind == "tokenized":
        field = f"{field}.input_ids"
        if len(value.input_ids) >= max_len:  # before copying millions of ids
            raise _no_room(field, len(value.input_ids), max_len)
        ids = [int(t) for t in value.input_ids]
        if not ids:
            raise InvalidArgument(field, "is empty")
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(field, f"id {bad} is outside the vocabulary [0, {vocab})")
        prepared = PreparedPrompt(ids, value.original_text or None, field)
    elif kind == "text":
        if not value:
            raise InvalidArgument(field, "is empty")
        if max_bytes is not None and len(value) > max_bytes // 4:  # 4 = the most UTF-8 bytes of a character
            size = len(value.encode("utf-8", "surrogatepass"))
            if size > max_bytes:
                raise _too_long(field, size, max_bytes, max_len, "text")
        ids = [config.bos_token_id, *tokenizer.encode(value, add_special_tokens=False).ids]
        prepared = PreparedPrompt(ids, value, field)
    elif kind == "chat":
        if max_bytes is not None:
            _check_chat_size(value, f"{field}.messages_json", max_bytes, max_len)
        prompt = chat_prompt(value, field=field, model_type=config.model_type, tokenizer=tokenizer)
        prepared = PreparedPrompt(list(prompt.token_ids), prompt.prompt, field, prompt)
    else:  # a newer client's input kind
        raise InvalidArgument(f"{field_prefix}input", f"unsupported input kind {kind!r}")
    n = len(prepared.token_ids)
    if n >= max_len:
        raise _no_room(field, n, max_len)
    return prepared


# ---- responses --------------------------------------------------------------------------------


def _top_message(entry: dict[int, Logprob] | None, n_top: int) -> pb.TopLogProbs:
    """The `n_top` most likely tokens of a position's entry, best first (none for None)."""
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in (entry or {}).items()
                 if lp.rank is not None and lp.rank <= n_top)
    return pb.TopLogProbs(values=[float(v) for _, _, v in top], token_ids=[int(t) for _, t, _ in top])


def logprobs_message(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], n_top: int) -> pb.OutputLogProbs:
    """`OutputLogProbs` for generated tokens: each entry maps the sampled token and the top
    alternatives to their `Logprob` (ranks from 1)."""
    msg = pb.OutputLogProbs()
    for token, entry in zip(token_ids, entries):
        sampled = entry.get(int(token))
        msg.token_ids.append(int(token))
        msg.token_logprobs.append(float(sampled.logprob) if sampled is not None else float("nan"))
        msg.top_logprobs.append(_top_message(entry, n_top))
    return msg


def input_logprobs_message(entries: Sequence[dict[int, Logprob] | None], token_ids: Sequence[int],
                           n_top: int) -> pb.InputLogProbs:
    """`InputLogProbs` for prompt tokens: each entry maps the prompt token and the top
    alternatives to their `Logprob`; None (the first prompt token) leaves the value unset."""
    msg = pb.InputLogProbs()
    for token, entry in zip(token_ids, entries):
        value = pb.InputTokenLogProb()
        if entry is not None:
            value.value = float(entry[int(token)].logprob)
        msg.token_logprobs.append(value)
        msg.token_ids.append(int(token))
        msg.top_logprobs.append(_top_message(entry, n_top))
    return msg


def chunk_message(request_id: str, token_ids: Sequence[int], text: str, *, prompt_tokens: int,
                  completion_tokens: int, logprobs: Sequence[dict[int, Logprob]] | None,
                  n_top: int | None, index: int = 0) -> pb.GenerateResponse:
    """A `GenerateStreamChunk` of sample `index` (n > 1: SGLang's per-sample chunks)."""
    chunk = pb.GenerateStreamChunk(token_ids=[int(t) for t in token_ids], prompt_tokens=prompt_tokens,
                                   completion_tokens=completion_tokens, cached_tokens=0, index=index, text=text)
    if logprobs is not None and n_top is not None:
        chunk.output_logprobs.CopyFrom(logprobs_message(logprobs, token_ids, n_top))
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def reasoning_token_count(token_ids: Sequence[int], chat: Any) -> int:
    """Thinking-mode chat: the tokens up to and including `</think>` (all of them without one)."""
    if chat is None or not getattr(chat, "thinking", False):
        return 0
    from deepinfer.serve.text.chat import THINK_END_TOKEN_ID

    ids = list(token_ids)
    return ids.index(THINK_END_TOKEN_ID) + 1 if THINK_END_TOKEN_ID in ids else len(ids)


def chat_output(tokenizer, chat: Any, output: RequestOutput, index: int = 0) -> pb.ChatOutput:
    """Parse sample `index` of a finished chat answer into content / reasoning / tool calls
    (DeepSeek encoding: `serve.text.chat.parse_completion`)."""
    from deepinfer.serve.text.chat import parse_completion

    parsed = parse_completion(tokenizer, chat, output.outputs[index])
    msg = pb.ChatOutput(content=parsed.content or "",
                        tool_calls_json=json.dumps(parsed.tool_calls) if parsed.tool_calls else "")
    if parsed.reasoning_content is not None:
        msg.reasoning_content = parsed.reasoning_content
    return msg


def complete_message(output: RequestOutput, *, eos_token_id: int, n_top: int | None, tokenizer=None,
                     chat: Any = None, index: int = 0, input_start: int | None = None,
                     input_top: int = 0) -> pb.GenerateResponse:
    """The final `GenerateComplete` of sample `index` of a finished request (one per sample);
    with `input_start`, the prompt's logprobs from that position on, `input_top` alternatives
    each (`input_logprobs`)."""
    completion = output.outputs[index]
    ids = [int(t) for t in completion.token_ids]
    msg = pb.GenerateComplete(
        output_ids=ids,
        finish_reason=completion.finish_reason or "abort",
        prompt_tokens=len(output.prompt_token_ids or ()),
        completion_tokens=len(ids),
        cached_tokens=int(output.num_cached_tokens or 0),
        index=index,
        text=completion.text,
        reasoning_tokens=reasoning_token_count(ids, chat),
    )
    if isinstance(completion.stop_reason, str):
        msg.matched_stop_str = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        msg.matched_token_id = completion.stop_reason
    elif completion.finish_reason == "stop" and ids and ids[-1] == eos_token_id:
        msg.matched_token_id = eos_token_id
    if completion.logprobs is not None and n_top is not None:
        msg.output_logprobs.CopyFrom(logprobs_message(completion.logprobs, ids, n_top))
    if input_start is not None and output.prompt_logprobs is not None:
        prompt = [int(t) for t in output.prompt_token_ids]
        msg.input_logprobs.CopyFrom(input_logprobs_message(output.prompt_logprobs[input_start:],
                                                           prompt[input_start:], input_top))
    if chat is not None and tokenizer is not None:
        msg.chat.CopyFrom(chat_output(tokenizer, chat, output, index))
    return pb.GenerateResponse(request_id=output.request_id, complete=msg)
