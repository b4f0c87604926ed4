"""The grammar backend of structured output: specs compiled once, a matcher per request, and the
per-step token bitmasks, with llguidance (`../shared/spec/engine-features.md` §8).

`GrammarBackend` is the interface the engine uses, so another library (xgrammar) can stand in;
`LLGuidanceBackend` implements it. A spec (`StructuredOutputsParams`) becomes llguidance grammar
text once per distinct spec (`compile`, an LRU cache); a spec that does not compile (an invalid
schema, an unsupported feature, a bad regex or grammar) raises `ValueError` naming the field,
which refuses that one request and nothing else.

Bitmasks are int32 `[rows, ceil(V / 32)]`, token i allowed iff bit i % 32 of word i // 32 is
set (the layout vLLM, SGLang and `sampler.apply_bitmask` share); a row without a constraint is
all ones. `fill` computes the constrained rows in llguidance's thread pool (`LLExecutor`), which
releases the GIL; with speculative decoding, `fill_drafts` computes a verify row's mask per
position from its drafts the same way.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from typing import Protocol

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from deepinfer.serve.engine.types import StructuredOutputsParams

__all__ = ["GrammarBackend", "LLGuidanceBackend", "Matcher", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


class Matcher(Protocol):
    """One request's grammar state (llguidance's `LLMatcher` has these)."""

    def consume_token(self, token: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def is_accepting(self) -> bool: ...
    def is_error(self) -> bool: ...
    def get_error(self) -> str: ...


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, spec: StructuredOutputsParams) -> str: ...
    def matcher(self, compiled: str) -> Matcher: ...
    def fill(self, matchers: list[tuple[Matcher, int]], masks: np.ndarray) -> None: ...
    def fill_drafts(self, matchers: list[tuple[Matcher, int, list[int]]], masks: np.ndarray) -> None: ...
    def canonical(self, tokens: list[int]) -> bool: ...


def _choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class LLGuidanceBackend:
    """llguidance over the model's tokenizer (a `tokenizers.Tokenizer`), with `vocab_size` ids
    (the model's, which may exceed the tokenizer's) and `eos_token_id` as the grammar's end."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, *, cache_size: int = 256,
                 threads: int | None = None):
        self.vocab_size = vocab_size
        self.tokenizer = _ll_tokenizer(tokenizer.to_str(), vocab_size, eos_token_id)
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size
        self._executor = llguidance.LLExecutor(threads)

    def compile(self, spec: StructuredOutputsParams) -> str:
        """llguidance grammar text of `spec` (cached); `ValueError` naming the field if it does
        not compile."""
        key = json.dumps([spec.kind, getattr(spec, spec.kind), spec.disable_any_whitespace], sort_keys=True,
                         default=str)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = self._grammar(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{field}: {_one_line(e)}") from None
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if error:
            raise ValueError(f"{field}: {_one_line(messages[0])}")
        self._compiled[key] = grammar
        while len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return grammar

    def _grammar(self, spec: StructuredOutputsParams) -> str:
        options = {"whitespace_flexible": False} if spec.disable_any_whitespace else None
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON Schema must be an object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_regex(_choice_regex(spec.choice))
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))

    def matcher(self, compiled: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():  # (validated by `compile`: a safeguard)
            raise ValueError(f"structured_outputs: {_one_line(matcher.get_error())}")
        return matcher

    def fill(self, matchers: list[tuple[llguidance.LLMatcher, int]], masks: np.ndarray) -> None:
        """Write each matcher's next-token mask into row `index` of `masks` (int32, C order)."""
        if matchers:
            llg_numpy.fill_next_token_bitmask_par(self._executor, matchers, masks)

    def canonical(self, tokens: list[int]) -> bool:
        """Whether `tokens` are how the tokenizer itself would split their bytes (jump-forward
        appends forced tokens after a sampled one only where the boundary stays canonical)."""
        return self.tokenizer.tokenize_bytes(self.tokenizer.decode_bytes(tokens)) == list(tokens)

    def fill_drafts(self, matchers: list[tuple[llguidance.LLMatcher, int, list[int]]], masks: np.ndarray) -> None:
        """Speculative decoding: for each `(matcher, index, drafts)`, the masks of the positions
        after reading none, one, ... of the drafts, into rows index, index + 1, ... of `masks`,
        without advancing the matcher (each is rolled back). Reading stops at the first draft the
        grammar refuses (or after its end): the rows after it are left as they were, and that
        draft's own position is masked, so verification rejects it."""
        drafting = [m for m in matchers if m[2]]  # (llguidance refuses an empty draft list)
        if drafting:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, masks)
        self.fill([(m, index) for m, index, drafts in matchers if not drafts], masks)


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_id: int) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer (~1 s to build: once per tokenizer and process)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)


def _one_line(error) -> str:
    """llguidance's message on one line, without its source excerpt and caret lines."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    kept = [line for line in lines if line and not re.match(r"^(\^|\d+\s*\||\|)", line)]
    return " ".join(kept) if kept else type(error).__name__
