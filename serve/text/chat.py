"""DeepSeek V4 / V4.1 chat: messages -> prompt token ids, generated ids -> content/reasoning/tools.

Everything template-specific comes from the official `deepseek-recipe` 0.2.0 library
(`chat-encoding.md`); this module adapts it to the engine:

* `prepare_chat` / `encode_chat`: OpenAI-style messages (dicts) plus the chat switches
  (`thinking`, `reasoning_effort`, `tools`, `tool_choice`, `response_format`) are sent
  through the library's Chat Completions conversion, so message formats, effort aliases,
  tool normalization and request validation are exactly the library's. The conversation is
  rendered with the encoding of the model type (`deepseek_v4` -> `DeepseekV4Encoding`, i.e.
  `ModelVersion.DeepseekV4Pro`, which V4-Flash shares; `deepseek_v41` ->
  `DeepseekV41Encoding`) and encoded by the library through `special_ranges`: only the
  template's own special tokens become special ids, and text between them is encoded
  without the added vocabulary, so user text such as `<think>` or `<｜User｜>` stays plain
  text. The prompt starts with exactly one BOS (id 0) from the template; nothing else may
  add one (§2.5).
* `ChatOutputParser`: wraps the library's `StreamProcessor` (Chat Completions flavour) and
  turns generated token ids into `content`, `reasoning_content` and `tool_calls`. The
  library does not end on EOS, so the parser stops pushing at id 1 itself (§4.3).
* `chat_stop_token_ids(model_type)`: `[1]`, the only end-of-turn token of both templates.

Written here because the library lacks it: `encode_rendered` (the `special_ranges`
encoding done with an HF tokenizer, used to cross-check the library and usable without
it), the EOS cut in the parser, the translation of the library's chunk stream into
accumulated fields, and the error types.

V4.1's system token (spec `chat-encoding.md` §1, §5): the V4.1 template emits `<｜System｜>`
(system messages, the thinking-mode effort line, response formats, tools), which the bundled V4
tokenizer.json lacks; a V4.1 checkpoint's own tokenizer has it. A V4.1 model that runs with a
tokenizer without it (the tiny presets, which use the bundled one) spells it
`STAND_IN_SYSTEM_TOKEN`, a reserved placeholder of the V4 vocabulary (id 128798), through the
library's `SpecialTokens`: the vocabulary is untouched, and the token is logged once. A tokenizer
with neither raises `ChatEncodingError`.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import deepseek_recipe as dr

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "MODEL_NAMES",
    "THINK_END_TOKEN_ID",
    "THINK_START_TOKEN_ID",
    "ChatDelta",
    "ChatEncodingError",
    "ChatOutputParser",
    "ChatPrompt",
    "ChatRequestError",
    "ParsedChat",
    "chat_stop_token_ids",
    "encode_chat",
    "encode_rendered",
    "model_version",
    "parse_chat_output",
    "parse_completion",
    "prepare_chat",
    "recipe_tokenizer",
]

BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
THINK_START_TOKEN_ID = 128821
THINK_END_TOKEN_ID = 128822

# Request model names the library's conversion knows, per our model_type.
MODEL_NAMES = {"deepseek_v4": "DeepSeek-V4-Pro", "deepseek_v41": "DeepSeek-V4.1-Flash"}
_MODEL_VERSIONS = {
    "deepseek_v4": dr.ModelVersion.DeepseekV4Pro,
    "deepseek_v41": dr.ModelVersion.DeepseekV41Flash,
}

# V4.1's <｜System｜> where the tokenizer lacks it: a reserved placeholder of the V4 vocabulary
SYSTEM_TOKEN = "<｜System｜>"
STAND_IN_SYSTEM_TOKEN = "<｜place▁holder▁no▁798｜>"
_log = logging.getLogger("deepinfer.chat")
_warned_stand_in: set[int] = set()

FinishReason = Literal["stop", "length", "content_filter", "abort"]
_BACKEND_FINISH = {
    "stop": dr.InferenceFinishReason.Stop,
    "length": dr.InferenceFinishReason.Length,
    "content_filter": dr.InferenceFinishReason.ContentFilter,
}


class ChatRequestError(ValueError):
    """The chat request is invalid (HTTP 400). `status_code` and `body` (OpenAI-style JSON)."""

    def __init__(self, message: str, status_code: int = 400, body: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body or json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None,
                       "code": "invalid_request_error"}}
        )


class ChatEncodingError(RuntimeError):
    """The conversation could not be encoded with this tokenizer (e.g. a missing special token)."""


def _canonical_model_type(model_type: str) -> str:
    mt = str(model_type).removesuffix("_text")
    if mt not in _MODEL_VERSIONS:
        raise ValueError(f"model_type: unsupported {model_type!r} (supported: {', '.join(_MODEL_VERSIONS)})")
    return mt


def model_version(model_type: str) -> dr.ModelVersion:
    """deepseek_v4 -> ModelVersion.DeepseekV4Pro (V4 encoding); deepseek_v41 -> DeepseekV41Flash."""
    return _MODEL_VERSIONS[_canonical_model_type(model_type)]


def chat_stop_token_ids(model_type: str) -> list[int]:
    """Token ids that end an assistant turn: EOS (1) for both V4 and V4.1."""
    _canonical_model_type(model_type)
    return [EOS_TOKEN_ID]


def _encoding(model_type: str, tokenizer: Any = None):
    """The library's encoding of `model_type`; for V4.1 with a `tokenizer` that lacks
    `<｜System｜>` but has the stand-in, one that spells the system token as the stand-in."""
    mv = model_version(model_type)
    if mv == dr.ModelVersion.DeepseekV4Pro:
        return dr.DeepseekV4Encoding()
    encoding = dr.DeepseekV41Encoding()
    if tokenizer is None or not hasattr(tokenizer, "token_to_id") or tokenizer.token_to_id(SYSTEM_TOKEN) is not None \
            or tokenizer.token_to_id(STAND_IN_SYSTEM_TOKEN) is None:
        return encoding
    if id(tokenizer) not in _warned_stand_in:
        _warned_stand_in.add(id(tokenizer))
        _log.info("the tokenizer has no %s (a V4.1 checkpoint's own tokenizer.json has it): the V4.1 template's "
                  "system token is spelled %s (id %d), as the tiny presets are", SYSTEM_TOKEN, STAND_IN_SYSTEM_TOKEN,
                  tokenizer.token_to_id(STAND_IN_SYSTEM_TOKEN))
    return encoding.with_special_tokens(dr.SpecialTokens(system=STAND_IN_SYSTEM_TOKEN))


# ---------------------------------------------------------------------------------- tokenizer

_RECIPE_TOKENIZERS: dict[int, tuple[Any, dr.Tokenizer]] = {}
_PLAIN_TOKENIZERS: dict[int, tuple[Any, Any]] = {}
_CACHE_LOCK = threading.Lock()


def recipe_tokenizer(tokenizer: Any) -> dr.Tokenizer:
    """The `deepseek_recipe.Tokenizer` with the same vocabulary as an HF `tokenizers.Tokenizer`.

    Built once per tokenizer object from its JSON (`to_str()`) and cached; a
    `deepseek_recipe.Tokenizer` is returned unchanged.
    """
    if isinstance(tokenizer, dr.Tokenizer):
        return tokenizer
    key = id(tokenizer)
    with _CACHE_LOCK:
        hit = _RECIPE_TOKENIZERS.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        built = dr.Tokenizer.from_str(tokenizer.to_str())
        # Keep a strong reference to the HF tokenizer so its id() is not reused.
        _RECIPE_TOKENIZERS[key] = (tokenizer, built)
        return built


def _plain_tokenizer(tokenizer: Any) -> Any:
    """A copy of an HF tokenizer without its added vocabulary (for plain-text gaps)."""
    import tokenizers

    key = id(tokenizer)
    with _CACHE_LOCK:
        hit = _PLAIN_TOKENIZERS.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        spec = json.loads(tokenizer.to_str())
        spec["added_tokens"] = []
        plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
        _PLAIN_TOKENIZERS[key] = (tokenizer, plain)
        return plain


def encode_rendered(prompt: str, special_ranges: Sequence[tuple[int, int]], tokenizer: Any) -> list[int]:
    """Encode a rendered prompt through its `special_ranges` with an HF tokenizer.

    Each range (code-point offsets) becomes the id of its token spelling; the text between
    ranges is encoded with a copy of the tokenizer that has no added vocabulary, so a
    special-token spelling typed by a user stays plain text. Matches
    `DeepseekV4Encoding.encode` / `DeepseekV41Encoding.encode` (spec §2.4). Raises
    `ChatEncodingError` when a range's spelling is not in the vocabulary.
    """
    plain = _plain_tokenizer(tokenizer)
    ids: list[int] = []
    pos = 0
    for start, end in special_ranges:
        if start < pos or end <= start or end > len(prompt):
            raise ValueError(f"special_ranges: bad range ({start}, {end}) at offset {pos}")
        if start > pos:
            ids.extend(plain.encode(prompt[pos:start], add_special_tokens=False).ids)
        spelling = prompt[start:end]
        tid = tokenizer.token_to_id(spelling)
        if tid is None:
            raise ChatEncodingError(f"special token {spelling!r} is not in the tokenizer's vocabulary")
        ids.append(tid)
        pos = end
    if pos < len(prompt):
        ids.extend(plain.encode(prompt[pos:], add_special_tokens=False).ids)
    return ids


# ---------------------------------------------------------------------------------- encoding


@dataclass
class ChatPrompt:
    """An encoded chat prompt and what the engine needs to sample and parse its answer.

    token_ids: the prompt ids, BOS first (feed them as-is; add no BOS).
    prompt: the rendered text; special_ranges: the template's special-token spans in it.
    thinking / reasoning_effort: the mode the library resolved (effort None off thinking).
    temperature / top_p: the values the library forces for this model and mode (spec §3);
        they override a request's own values when the caller follows the library.
    output_constraint: `(kind, schema)` to enforce by constrained decoding, or None.
    request: the library's `ConversationRequest` (parsing options, `resolve_max_tokens`).
    """

    token_ids: list[int]
    prompt: str
    special_ranges: list[tuple[int, int]]
    model_type: str
    thinking: bool
    reasoning_effort: str | None
    temperature: float | None
    top_p: float | None
    output_constraint: tuple[str, str] | None
    request: dr.ConversationRequest = field(repr=False)

    def parsing_options(self, stop: Sequence[str] | None = None) -> dr.ParsingOptions:
        """The library's parsing options for this prompt, with `stop` sequences if given."""
        po = self.request.parsing_options  # a copy
        if stop is not None:
            po.stop_sequences = list(stop)
        return po

    def resolve_max_tokens(self, context_limit: int) -> int:
        """The library's default/clamped max_tokens for this prompt (spec §3)."""
        try:
            return self.request.resolve_max_tokens(len(self.token_ids), context_limit)
        except dr.ConversionError as e:
            raise ChatRequestError(str(e), e.status_code, e.body) from None


def _request_body(
    messages: Sequence[Mapping[str, Any]],
    *,
    model_type: str,
    thinking: bool | None,
    reasoning_effort: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    response_format: Mapping[str, Any] | None,
) -> dict[str, Any]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatRequestError("messages: must be a list of message objects")
    body: dict[str, Any] = {"model": MODEL_NAMES[model_type], "messages": list(messages)}
    if thinking is not None:
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    if reasoning_effort is not None:
        body["reasoning_effort"] = reasoning_effort
    if tools:
        body["tools"] = [t if "type" in t else {"type": "function", "function": dict(t)} for t in tools]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if response_format is not None:
        body["response_format"] = response_format
    return body


def prepare_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    model_type: str,
    tokenizer: Any,
    thinking: bool | None = None,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> ChatPrompt:
    """Convert, render and encode a chat request; see the module docstring.

    messages: OpenAI Chat Completions messages (`system`, `user`, `assistant` with
        `reasoning_content` / `tool_calls` / `prefix`, `tool` with `tool_call_id`,
        `latest_reminder`); content is a string or a list of text parts.
    thinking: True/False, or None for the library default (on, unless
        `reasoning_effort="none"`).
    reasoning_effort: Chat Completions values: none, minimal, low, medium, high, xhigh,
        ultra, max (the library maps them to low/high/xhigh/max; unset in thinking mode
        means high). Ignored when thinking is off.
    tools: OpenAI function tools (`{"type": "function", "function": {...}}`, or the bare
        function object). tool_choice: "auto" | "none" | "required" | a named choice.
    response_format: `{"type": "json_object" | "json_schema" | "regex" | "text", ...}`.
    tokenizer: an HF `tokenizers.Tokenizer` (or a `deepseek_recipe.Tokenizer`).

    Raises `ChatRequestError` (a ValueError, status 400) for invalid requests and
    `ChatEncodingError` when the tokenizer cannot encode the rendered prompt.
    """
    mt = _canonical_model_type(model_type)
    body = _request_body(messages, model_type=mt, thinking=thinking, reasoning_effort=reasoning_effort,
                         tools=tools, tool_choice=tool_choice, response_format=response_format)
    try:
        cr = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    except dr.ConversionError as e:
        raise ChatRequestError(str(e), e.status_code, e.body) from None
    except ValueError as e:
        raise ChatRequestError(str(e)) from None
    conv = cr.conversation
    enc = _encoding(mt, tokenizer).with_tokenizer(recipe_tokenizer(tokenizer))
    rendered = enc.render_conversation(conv)
    try:
        ids = list(enc.encode(conv))
    except RuntimeError as e:
        hint = ""
        if "<｜System｜>" in str(e):
            hint = (" (the V4.1 template needs <｜System｜>, which the V4 tokenizer.json lacks; "
                    "use the V4.1 checkpoint's tokenizer)")
        raise ChatEncodingError(f"{e}{hint}") from None
    if not ids or ids[0] != BOS_TOKEN_ID or ids.count(BOS_TOKEN_ID) != 1:
        raise ChatEncodingError("encoded prompt must start with exactly one BOS (id 0)")
    io = cr.inference_options
    oc = io.output_constraint
    return ChatPrompt(
        token_ids=ids,
        prompt=rendered.prompt,
        special_ranges=[tuple(r) for r in rendered.special_ranges],
        model_type=mt,
        thinking=conv.thinking_mode,
        reasoning_effort=conv.reasoning_effort,
        temperature=io.temperature,
        top_p=io.top_p,
        output_constraint=(oc.kind, oc.schema) if oc is not None else None,
        request=cr,
    )


def encode_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    model_type: str,
    tokenizer: Any,
    thinking: bool | None = None,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids of a chat request (BOS first); `prepare_chat(...).token_ids`."""
    return prepare_chat(messages, model_type=model_type, tokenizer=tokenizer, thinking=thinking,
                        reasoning_effort=reasoning_effort, tools=tools, tool_choice=tool_choice,
                        response_format=response_format).token_ids


# ---------------------------------------------------------------------------------- parsing


@dataclass
class ChatDelta:
    """What one push produced.

    content / reasoning_content: new text of each kind.
    tool_calls: OpenAI streaming tool-call deltas (`index`, and `id`/`type`/`function.name`
        on the first delta of a call; `function.arguments` fragments after).
    finish_reason: the protocol finish reason once known ("stop", "length", "tool_calls",
        "content_filter", or "abort").
    chunks: the library's Chat Completions chunks of this push, as JSON strings (ready to
        stream as `data:` lines).
    """

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    chunks: list[str] = field(default_factory=list)


@dataclass
class ParsedChat:
    """A whole parsed answer. tool_calls use the OpenAI message shape; None when there are none."""

    content: str
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None
    usage: dict[str, Any] | None


class ChatOutputParser:
    """Turn a chat answer's generated ids into content, reasoning and tool calls.

    Build it from the `ChatPrompt` of the request (`ChatOutputParser(tokenizer, prompt)`),
    which carries the library's parsing options: where parsing starts (reasoning in
    thinking mode, content otherwise, the continuation stages for prefix turns), whether
    tool calls are parsed (only with active tools), and whether the prompt opened the
    tool-call block. `stop` adds stop sequences; the library matches them on `content`
    only and then finishes at once (`finished` becomes True: abort generation).

    Feed `push(ids)` as tokens are sampled; the parser drops EOS (id 1) and everything
    after it, counting EOS in usage. End with `finish(reason)`: "length" when max_tokens
    was hit, "stop" otherwise, "abort" to cancel. Accumulated results: `content`,
    `reasoning_content`, `tool_calls`, `finish_reason`, `usage`; `result()` bundles them.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt: ChatPrompt,
        *,
        stop: Sequence[str] | None = None,
        cached_tokens: int = 0,
        request_id: str = "chatcmpl-deepinfer",
    ) -> None:
        model = MODEL_NAMES[prompt.model_type]
        generator = dr.ChatCompletionRequest.chunk_generator(prompt.request, request_id, model)
        self._sp = dr.StreamProcessor(generator, prompt.parsing_options(stop), recipe_tokenizer(tokenizer))
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._eos_seen = False
        self._closed = False
        self._stop_matched = False
        self.thinking = prompt.thinking
        self._apply(self._sp.push(dr.InferenceChunk.ready(
            prompt_usage=dr.PromptUsage(prompt_tokens=len(prompt.token_ids),
                                        prompt_cache_hit_tokens=int(cached_tokens)))))

    # -- state

    @property
    def finished(self) -> bool:
        """True once the answer is complete (stop sequence matched, finish() or abort)."""
        return self._closed or self._sp.finished

    @property
    def eos_seen(self) -> bool:
        return self._eos_seen

    @property
    def stop_sequence_matched(self) -> bool:
        """True when the library matched a `stop` sequence in the content and finished."""
        return self._stop_matched

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning_content(self) -> str | None:
        """The reasoning text; None outside thinking mode."""
        text = "".join(self._reasoning)
        return text if (self.thinking or text) else None

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        if not self._calls:
            return None
        return [self._calls[i] for i in sorted(self._calls)]

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._usage

    def result(self) -> ParsedChat:
        return ParsedChat(self.content, self.reasoning_content, self.tool_calls, self._finish_reason, self._usage)

    # -- input

    def push(self, token_ids: Sequence[int], logprobs: Sequence[Any] | None = None) -> ChatDelta:
        """Feed generated ids (and optionally `(logprob, [(alt_id, alt_logprob), ...])` per id).

        Ids from EOS on are not parsed; pushes after EOS or after the parser finished
        return an empty delta.
        """
        if self.finished or self._eos_seen:
            return ChatDelta()
        ids = [int(t) for t in token_ids]
        eos_at = ids.index(EOS_TOKEN_ID) if EOS_TOKEN_ID in ids else None
        if eos_at is not None:
            ids = ids[:eos_at]
            if logprobs is not None:
                logprobs = list(logprobs)[:eos_at]
        chunks: list[Any] = []
        if ids:
            chunks += self._sp.push(dr.InferenceChunk.tokens(ids, logprobs))
            self._stop_matched = self._sp.finished
        if eos_at is not None:
            self._eos_seen = True
            if not self._sp.finished:
                chunks += self._sp.push(dr.InferenceChunk.text("", 1))  # count EOS in usage
        return self._apply(chunks)

    def push_text(self, text: str, token_count: int = 0) -> ChatDelta:
        """Feed generated text directly (`token_count` tokens, for usage)."""
        if self.finished or self._eos_seen:
            return ChatDelta()
        chunks = self._sp.push(dr.InferenceChunk.text(text, int(token_count)))
        self._stop_matched = self._sp.finished
        return self._apply(chunks)

    def finish(self, reason: FinishReason = "stop") -> ChatDelta:
        """End the answer: "stop" (EOS or stop token), "length", "content_filter" or "abort"."""
        if self._closed:
            return ChatDelta()
        if reason == "abort":
            self._sp.close()
            self._closed = True
            self._finish_reason = "abort"
            return ChatDelta(finish_reason="abort")
        if reason not in _BACKEND_FINISH:
            raise ValueError(f"reason: must be one of stop, length, content_filter, abort; got {reason!r}")
        chunks: list[Any] = []
        if not self._sp.finished:
            chunks += self._sp.push(dr.InferenceChunk.finish(_BACKEND_FINISH[reason]))
        chunks += self._sp.finish()
        self._closed = True
        return self._apply(chunks)

    def close(self) -> None:
        """Release the processor without finishing (idempotent)."""
        if not self._closed:
            self._sp.close()
            self._closed = True

    # -- chunk translation

    def _apply(self, chunks: Sequence[Any]) -> ChatDelta:
        delta = ChatDelta()
        for chunk in chunks:
            raw = chunk.to_json()
            delta.chunks.append(raw)
            data = json.loads(raw)
            if data.get("usage"):
                self._usage = data["usage"]
            for choice in data.get("choices") or []:
                d = choice.get("delta") or {}
                if d.get("content"):
                    delta.content += d["content"]
                    self._content.append(d["content"])
                if d.get("reasoning_content"):
                    delta.reasoning_content += d["reasoning_content"]
                    self._reasoning.append(d["reasoning_content"])
                for tc in d.get("tool_calls") or []:
                    delta.tool_calls.append(tc)
                    self._merge_tool_call(tc)
                if choice.get("finish_reason"):
                    self._finish_reason = choice["finish_reason"]
                    delta.finish_reason = choice["finish_reason"]
        return delta

    def _merge_tool_call(self, tc: Mapping[str, Any]) -> None:
        index = int(tc.get("index", len(self._calls)))
        call = self._calls.setdefault(index, {"id": None, "type": "function",
                                              "function": {"name": "", "arguments": ""}})
        if tc.get("id"):
            call["id"] = tc["id"]
        if tc.get("type"):
            call["type"] = tc["type"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]


def parse_completion(tokenizer: Any, prompt: ChatPrompt, completion: Any) -> ParsedChat:
    """Parse an engine's finished completion (`token_ids`, `text`, `finish_reason`,
    `stop_reason`) of a chat request into content / reasoning / tool calls.

    Generation stopped on EOS, a stop token, a stop string or the length limit. A matched stop
    string is already cut from the engine's text, so the parser gets that text; otherwise it gets
    the token ids (a final stop token id left out; EOS is dropped by the parser itself).
    """
    ids = list(completion.token_ids)
    parser = ChatOutputParser(tokenizer, prompt)
    try:
        if completion.finish_reason == "stop" and isinstance(completion.stop_reason, str):
            parser.push_text(completion.text, len(ids))
        else:
            if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int) and ids \
                    and ids[-1] == completion.stop_reason:
                ids = ids[:-1]
            parser.push(ids)
        parser.finish(completion.finish_reason if completion.finish_reason in ("length", "abort") else "stop")
        return parser.result()
    finally:
        parser.close()


def parse_chat_output(
    token_ids: Sequence[int],
    tokenizer: Any,
    prompt: ChatPrompt,
    *,
    finish_reason: FinishReason = "stop",
    stop: Sequence[str] | None = None,
) -> ParsedChat:
    """Parse a whole generated answer at once (non-streaming convenience)."""
    parser = ChatOutputParser(tokenizer, prompt, stop=stop)
    try:
        parser.push(token_ids)
        parser.finish(finish_reason)
        return parser.result()
    finally:
        parser.close()
