"""Request parameters and results, with vLLM's names and defaults (the engine's own types; the API
layer `deepinfer.serve.api` re-exports them).

* `SamplingParams`: per-request sampling and stopping settings. Field names, defaults and the
  meaning of each value follow vLLM's `SamplingParams` (`interfaces.md` §1.1), including the
  surprising `max_tokens=16` default. Every value is checked in `__post_init__`; a bad one
  raises `ValueError` whose message starts with the field name.
* `RequestOutput` / `CompletionOutput` / `Logprob`: results, field for field as in vLLM's
  `vllm.outputs`. `CompletionOutput.reasoning_content` and `.tool_calls` are our extensions
  for chat requests (vLLM puts them only in its OpenAI server responses).
* `RequestMetrics`: per-request timestamps (seconds, `time.time()` clock).

`finish_reason` / `stop_reason` follow vLLM exactly:

* `finish_reason="stop"`: generation ended on EOS (`stop_reason=None`), on a stop token id
  (`stop_reason=` that id, an `int`) or on a stop string (`stop_reason=` that string);
* `finish_reason="length"`: `max_tokens` or the context limit was reached (`stop_reason=None`);
* `finish_reason="abort"`: the request was cancelled;
* `finish_reason=None` while the request is still running.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

__all__ = [
    "MAX_LOGPROBS",
    "StructuredOutputsParams",
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "RequestMetrics",
    "logprob_entry",
    "RequestOutput",
    "SamplingParams",
]

MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (`SamplingParams.logprobs`)

FinishReason = Literal["stop", "length", "abort"]

# vLLM treats temperatures below this as greedy decoding.
_GREEDY_EPS = 1e-5


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _check_number(name: str, value: Any) -> None:
    if not _is_number(value):
        _fail(name, f"must be a finite number, got {value!r}")


def _check_int(name: str, value: Any) -> None:
    if not _is_int(value):
        _fail(name, f"must be an integer, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, f"must be a bool, got {value!r}")


@dataclass
class StructuredOutputsParams:
    """A structured-output constraint, with vLLM's names: exactly one of

    * `json`: a JSON Schema (a dict or its JSON text) the output must validate against;
    * `json_object`: True for any JSON object;
    * `regex`: a regular expression the whole output must match;
    * `choice`: a list of strings, the output is exactly one of them;
    * `grammar`: a Lark grammar (llguidance's dialect) or a GBNF/EBNF grammar (`::=` rules).

    `disable_any_whitespace` makes JSON compact (no whitespace between tokens). `jump_forward`:
    where the grammar forces the next text (a JSON key, a closing bracket, the rest of a choice),
    append its tokens without sampling them, llguidance's canonical tokenization of the forced
    bytes, and compute them in the next step as one chunk (SGLang's jump-forward decoding). The
    forced tokens are not sampled, so a request that asks for logprobs cannot jump. The grammar is
    compiled when the request is added (`deepinfer.serve.structured`); a schema or grammar that
    does not compile is refused there with an error naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    jump_forward: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            _fail("structured_outputs", f"give exactly one of {', '.join(self.KINDS)}, got "
                  f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, Mapping)):
            _fail("structured_outputs.json", f"must be a JSON Schema (an object or its JSON text), got "
                  f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"structured_outputs.{name}", f"must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                _fail("structured_outputs.choice", f"must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        _check_bool("structured_outputs.jump_forward", self.jump_forward)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StructuredOutputsParams":
        if isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            _fail("structured_outputs", f"must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                _fail("structured_outputs", f"unknown key {key!r} (known: {', '.join(sorted(names))})")
        return cls(**{k: v for k, v in d.items() if v is not None})

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> "StructuredOutputsParams | None":
        """The constraint of an OpenAI `response_format` (`text` and None: none)."""
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
                _fail("response_format.json_schema", "must be an object with a `schema` object")
            return cls(json=dict(spec["schema"]))
        if kind == "regex":  # vLLM's extension
            return cls(regex=response_format.get("regex"))
        _fail("response_format.type", f"must be text, json_object, json_schema or regex, got {kind!r}")


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (vLLM names and defaults).

    Basic sampling
        n: number of samples of the prompt, returned as the output's n completions (child i
            samples with seed + i when a seed is given).
        temperature: 0 means greedy decoding; otherwise logits are divided by it.
        top_p: nucleus sampling mass, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it (-1 is stored as 0).
        min_p: drop tokens whose probability is below min_p times the top probability, in [0, 1].
        seed: per-request RNG seed; None lets the engine pick one.
    Penalties
        presence_penalty, frequency_penalty: in [-2, 2]; 0 disables them.
        repetition_penalty: > 0; 1 disables it.
    Stopping
        stop: stop strings (a str or a list of str; stored as a list). Matching runs on the
            detokenized output; the matched string is cut off unless
            include_stop_str_in_output, and becomes `CompletionOutput.stop_reason`.
        stop_token_ids: extra token ids that end generation (stored as a list).
        ignore_eos: keep generating after EOS.
        max_tokens: most generated tokens. The default is vLLM's 16, which is surprising
            for chat; None means "up to the context limit".
        min_tokens: EOS and stop token ids are suppressed until this many tokens exist.
        include_stop_str_in_output: keep the matched stop string in the text.
    Logprobs
        logprobs: number of top alternatives returned per generated token (plus the
            sampled token); None returns none.
        prompt_logprobs: the same for prompt tokens.
    Detokenization
        skip_special_tokens: drop tokens flagged `special` in tokenizer.json when
            detokenizing. In the DeepSeek-V4 vocabulary these are BOS/EOS/pad, the
            placeholders and most image tokens, *not* chat tokens such as `<think>`.
        spaces_between_special_tokens: accepted for vLLM compatibility; the byte-level
            decoder of this tokenizer never inserts spaces, so it has no effect.
        detokenize: produce `text`; False returns token ids only.
    Logit constraints
        logit_bias: {token id: bias} added to the logits before sampling.
        structured_outputs: a `StructuredOutputsParams` (or its dict): the output follows a
            JSON Schema, a regex, a grammar or one of a list of choices.
    Prefix cache
        cache_ttl_class: how long the request's prompt pages stay cached once no request holds
            them: "chat" (7 days), "agent" (3 days), "none" (not kept); None: the engine's
            default (`PrefixCacheConfig`; the engine checks the name).

    `from_dict` builds one from a mapping with vLLM names and the OpenAI request names
    (`max_completion_tokens`, `logprobs: bool` + `top_logprobs`, `logit_bias` with string
    keys) and rejects unknown keys.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_ttl_class: str | None = None

    def __post_init__(self) -> None:
        # n
        _check_int("n", self.n)
        if self.n < 1:
            _fail("n", f"must be at least 1, got {self.n}")
        # basic sampling
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", f"must be non-negative, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            _fail("top_k", f"must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        # penalties
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        # stopping
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            _fail("stop", f"must be a str or a list of str, got {type(self.stop).__name__}")
        for s in self.stop:
            if not isinstance(s, str):
                _fail("stop", f"every stop string must be a str, got {s!r}")
            if not s:
                _fail("stop", "stop strings must not be empty")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            _fail("stop_token_ids", f"must be a list of int, got {type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", f"every id must be a non-negative int, got {t!r}")
        _check_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                _fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            _fail("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        # logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    _fail(name, f"must be non-negative, got {value}")
        if self.cache_ttl_class is not None and not isinstance(self.cache_ttl_class, str):
            _fail("cache_ttl_class", f"must be a str, got {type(self.cache_ttl_class).__name__}")
        # detokenization
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            _check_bool(name, getattr(self, name))
        # logit bias
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                _fail("logit_bias", f"must be a dict {{token id: bias}}, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for tid, value in self.logit_bias.items():
                if not _is_int(tid) or tid < 0:
                    _fail("logit_bias", f"token ids must be non-negative ints, got {tid!r}")
                if not _is_number(value):
                    _fail("logit_bias", f"bias of token {tid} must be a finite number, got {value!r}")
                bias[tid] = float(value)
            self.logit_bias = bias
        # structured output
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            if self.structured_outputs.jump_forward and self.logprobs is not None:
                _fail("structured_outputs.jump_forward", "forced tokens are not sampled and have no logprobs: "
                      "ask for logprobs or for jump_forward, not both")

    # ------------------------------------------------------------------ helpers

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id these params name must exist in the model's vocabulary; the engine
        calls this when the request is made, so a bad id never reaches a batched step."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ())):
            for tid in ids:
                if tid >= vocab_size:
                    _fail(name, f"token id {tid} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature ~ 0, as vLLM decides it)."""
        return self.temperature < _GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (vLLM names); `from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Build from a mapping; unknown keys raise `ValueError` naming the key.

        Accepts vLLM names, plus the OpenAI request names where they differ:

        * `max_completion_tokens` -> `max_tokens` (both given and different is an error);
        * `logprobs: bool` with `top_logprobs: int` -> `logprobs = top_logprobs` (0 if
          absent) when true, None when false;
        * `logit_bias` with string keys (`{"1234": -100}`) -> int keys.

        A key whose value is None takes the field's default (OpenAI bodies often send
        `"temperature": null`).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be a mapping, got {type(d).__name__}")
        names = set(cls.field_names())
        extra = {"max_completion_tokens", "top_logprobs"}
        for key in d:
            if key not in names and key not in extra:
                hint = difflib.get_close_matches(str(key), sorted(names | extra), n=1)
                suffix = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ValueError(f"{key}: unknown sampling parameter{suffix}")
        kwargs: dict[str, Any] = {k: v for k, v in d.items() if k in names and v is not None}

        mct = d.get("max_completion_tokens")
        if mct is not None:
            if "max_tokens" in kwargs and kwargs["max_tokens"] != mct:
                raise ValueError(
                    f"max_completion_tokens: {mct} conflicts with max_tokens={kwargs['max_tokens']}"
                )
            kwargs["max_tokens"] = mct

        top = d.get("top_logprobs")
        lp = d.get("logprobs")
        if isinstance(lp, bool):
            if lp:
                kwargs["logprobs"] = 0 if top is None else top
            else:
                if top is not None:
                    raise ValueError("top_logprobs: requires logprobs=true")
                kwargs.pop("logprobs", None)
        elif top is not None:
            if lp is None:
                raise ValueError("top_logprobs: requires logprobs=true")
            raise ValueError("top_logprobs: give either vLLM's logprobs=<int> or OpenAI's "
                             "logprobs=true with top_logprobs, not both")
        if "logprobs" in kwargs and not _is_int(kwargs["logprobs"]):
            raise ValueError(f"top_logprobs: must be an integer, got {kwargs['logprobs']!r}")

        bias = kwargs.get("logit_bias")
        if isinstance(bias, Mapping):
            converted: dict[Any, Any] = {}
            for tid, value in bias.items():
                if isinstance(tid, str):
                    try:
                        tid = int(tid.strip())
                    except ValueError:
                        raise ValueError(f"logit_bias: token id {tid!r} is not an integer") from None
                converted[tid] = value
            kwargs["logit_bias"] = converted
        return cls(**kwargs)


@dataclass
class Logprob:
    """Log probability of one token (vLLM `Logprob`).

    rank: 1-based rank of the token in the distribution (1 = most likely), or None.
    decoded_token: its text, or None when detokenization is off.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entry(token: int, logprob: float, rank: int, top_ids, top_logprobs, k: int,
                  decode) -> dict[int, Logprob]:
    """One position's vLLM logprobs: `token` with its logprob and rank, then the `k` likeliest
    (`top_ids` / `top_logprobs`, best first, ranks 1..k; the token keeps its own entry);
    `decode(id)` gives each one's text."""
    entry = {token: Logprob(float(logprob), int(rank), decode(token))}
    for j in range(k):
        alt = int(top_ids[j])
        entry.setdefault(alt, Logprob(float(top_logprobs[j]), j + 1, decode(alt)))
    return entry


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM `CompletionOutput`).

    text: the generated text (stop string removed unless include_stop_str_in_output).
        For chat requests it is the answer `content`, without reasoning or tool-call markup.
    token_ids: generated token ids (EOS included when generation ended on it, as in vLLM).
    cumulative_logprob: sum of the sampled tokens' logprobs, or None when not requested.
    logprobs: per generated token, {token id: Logprob} for the sampled token and the top
        alternatives; None when not requested.
    finish_reason: "stop" | "length" | "abort", None while running.
    stop_reason: the matched stop string (str) or stop token id (int); None for EOS,
        length and abort.

    Extensions (not in vLLM's class, set only for chat requests):
    reasoning_content: the thinking text (before `</think>`), or None.
    tool_calls: parsed tool calls in OpenAI shape,
        `[{"id": str, "type": "function", "function": {"name": str, "arguments": str}}]`,
        or None when there were none.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def finished(self) -> bool:
        """True once a finish_reason is set (vLLM's method of the same name)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (seconds since the epoch) of one request's life, None until reached.

    arrival_time: when the request was submitted.
    first_scheduled_time: when it was first scheduled (prefill started).
    first_token_time: when its first output token was produced.
    last_token_time: when its latest output token was produced.
    finished_time: when it finished.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def _since_arrival(self, t: float | None) -> float | None:
        return None if t is None else t - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        return self._since_arrival(self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        return self._since_arrival(self.first_token_time)

    @property
    def e2e_latency(self) -> float | None:
        return self._since_arrival(self.finished_time)


@dataclass
class RequestOutput:
    """Result of one request (vLLM `RequestOutput`).

    prompt: the prompt text, or None when the request gave token ids only.
    prompt_token_ids: the token ids the model saw (BOS included).
    prompt_logprobs: per prompt token, {token id: Logprob} (None for the first token), or
        None when not requested.
    outputs: one CompletionOutput per sample (n of them).
    finished: whether the whole request is done.
    metrics: timing of the request, or None.
    num_cached_tokens: prompt tokens served from the prefix cache, or None if unknown.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
