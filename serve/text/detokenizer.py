"""Incremental detokenization: one token id in, the newly completed text out.

A byte-level BPE token carries bytes, not characters: a Chinese character or an emoji is
often split over two tokens (`"😀"` is `[28927, 225]` in the DeepSeek-V4 vocabulary), and a
token decoded on its own then shows U+FFFD. Streaming each token's text would flash a
replacement character that later turns into the real one. `IncrementalDetokenizer` decodes
a short window of recent tokens instead and holds back any text that ends in U+FFFD until
the next tokens complete the character; `flush()` releases what is still held at the end
(a genuinely invalid byte sequence then shows as U+FFFD, as a full decode would).

Algorithm (the usual two-offset scheme): `prefix` and `read` index the token list;
`decode(ids[prefix:read])` is text already emitted. On each push,
`decode(ids[prefix:])` is computed; if it is longer and does not end in U+FFFD, the extra
characters are emitted and the window slides (`prefix <- read`, `read <- len(ids)`).
Decoding a window rather than single tokens also keeps tokenizers whose decoders
depend on neighbours (e.g. leading-space handling) correct.

`skip_special_tokens=True` drops the tokens that tokenizer.json flags `special` (HF
`decode` semantics). In the DeepSeek-V4 vocabulary those are BOS/EOS/pad (0-2), the
placeholders and most image tokens; the chat tokens (`<｜User｜>`, `<think>`, `｜DSML｜`, ...)
are not special and are always kept.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

__all__ = ["IncrementalDetokenizer", "REPLACEMENT_CHAR"]

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded together with the first output tokens, as context.
_PROMPT_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Detokenize one request's output token by token.

    `tokenizer` is anything with HF's `decode(ids, skip_special_tokens=...)` (normally the
    `tokenizers.Tokenizer` from `deepinfer.model.tokenizer.load_tokenizer`). `prompt_ids`,
    if given, supplies a few context tokens; prompt text is never emitted.

    `push(token_id)` returns the new text delta ("" while a character is incomplete);
    `flush()` returns whatever is still held; `.text` is everything emitted so far;
    `.token_ids` are the output ids pushed so far.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = bool(skip_special_tokens)
        context = [int(t) for t in (prompt_ids or [])][-_PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its trailing bytes would merge with the
            # first output bytes and misalign the deltas, so decode without context.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text
        self._parts: list[str] = []
        self._flushed = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until released)."""
        return "".join(self._parts)

    @property
    def token_ids(self) -> list[int]:
        """Output token ids pushed so far."""
        return self._ids[self._num_context:]

    @property
    def has_pending(self) -> bool:
        """True when some pushed tokens have not produced text yet."""
        return self._read < len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (maybe "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush()")
        self._ids.append(int(token_id))
        window = self._decode(self._ids[self._prefix:])
        if window.endswith(REPLACEMENT_CHAR) or len(window) < len(self._prefix_text):
            return ""
        delta = window[len(self._prefix_text):]
        # Slide the window: the text of ids[read:] is now emitted.
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        if delta:
            self._parts.append(delta)
        return delta

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Push several tokens; return their combined delta."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Release held-back text at the end of generation (U+FFFD for invalid bytes).

        After `flush()`, further pushes raise; repeated flushes return "".
        """
        if self._flushed:
            return ""
        self._flushed = True
        if not self.has_pending:
            return ""
        window = self._decode(self._ids[self._prefix:])
        delta = window[len(self._prefix_text):] if len(window) > len(self._prefix_text) else ""
        self._read = len(self._ids)
        if delta:
            self._parts.append(delta)
        return delta
