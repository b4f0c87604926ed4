"""Stop-string matching on streamed text, with vLLM's `stop_reason` semantics.

A stop string can span token boundaries ("\\n\\nUser:" may arrive as "\\n", "\\nUs",
"er:"), so matching runs on the detokenized text, fed as deltas. `StopChecker` keeps the
not-yet-emitted tail of the text and, after each delta, returns the text that is safe to
show:

* If a stop string is complete, generation should stop. The reported match is the one that
  *completes first* in the text (the earliest end position; among several ending at the
  same character, the one that starts earliest). This is what a token-by-token engine sees
  and does not depend on how the text was split into deltas. The text is cut before the
  stop string, or after it with `include_stop_str_in_output=True`; `stop_reason` is the
  matched string and `finish_reason` is "stop".
* Otherwise the longest tail that is a prefix of some stop string is held back, so a
  client never sees part of a stop string that is then retracted. Held text is released as
  soon as it can no longer start a stop string, or by `flush()` when generation ends.
  With `include_stop_str_in_output=True` nothing is held: the stop string is shown anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["StopChecker", "StopUpdate"]


@dataclass(frozen=True)
class StopUpdate:
    """Result of feeding one delta.

    text: text to emit now (may be "").
    stop_reason: the matched stop string, or None while no stop string matched.
    """

    text: str
    stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None


class StopChecker:
    """Match `stop` strings in a stream of text deltas.

    `feed(delta) -> StopUpdate`; `flush() -> str` at the end of generation (no match);
    `.stopped`, `.stop_reason`, `.finish_reason` ("stop" after a match, else None) and
    `.text` (everything emitted so far). Feeding after a match returns an empty update:
    text generated past the stop string is discarded.
    """

    def __init__(self, stop: Iterable[str] | str | None, include_stop_str_in_output: bool = False) -> None:
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        else:
            stops = list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: stop strings must be non-empty str, got {s!r}")
        self._stops = list(dict.fromkeys(stops))  # dedupe, keep order
        self._include = bool(include_stop_str_in_output)
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._pending = ""  # text received but not emitted yet (a possible stop prefix)
        self._recent = ""  # tail of the received text, for matching across deltas
        self._emitted: list[str] = []
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def stop_strings(self) -> list[str]:
        return list(self._stops)

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The matched stop string (vLLM `CompletionOutput.stop_reason`), or None."""
        return self._stop_reason

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self._stop_reason is not None else None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    @property
    def held(self) -> str:
        """Text received but held back (a possible stop-string prefix)."""
        return self._pending

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text

    def feed(self, delta: str) -> StopUpdate:
        """Add a text delta; return what to emit and whether a stop string matched."""
        if self._stop_reason is not None or self._flushed:
            return StopUpdate("")
        if not self._stops:
            return StopUpdate(self._emit(delta))
        # `self._recent` is the tail of all text received so far (emitted or held), long
        # enough to hold all but the last character of any stop string; `self._pending` is
        # its unemitted suffix. The text before it has no complete match, so a new match
        # ends inside `delta`: only that part of the search text is searched.
        recent = self._recent
        text = recent + delta
        emit_from = len(recent) - len(self._pending)
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stops:
            start = text.find(s, max(0, len(recent) - len(s) + 1))
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, s = best
            self._stop_reason = s
            self._pending = self._recent = ""
            # Without include, a match never starts in already-emitted text (that text
            # would have been held), so start >= emit_from.
            return StopUpdate(self._emit(text[emit_from:end if self._include else start]), s)
        keep = self._max_len - 1
        self._recent = text[max(0, len(text) - keep):] if keep else ""
        if self._include:
            self._pending = ""
            return StopUpdate(self._emit(text[emit_from:]))
        hold = min(self._partial_suffix_len(text), len(text) - emit_from)
        self._pending = text[len(text) - hold:] if hold else ""
        return StopUpdate(self._emit(text[emit_from:len(text) - hold]))

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def flush(self) -> str:
        """End of generation without a match: release the held-back text."""
        if self._stop_reason is not None or self._flushed:
            return ""
        self._flushed = True
        held, self._pending, self._recent = self._pending, "", ""
        return self._emit(held)
