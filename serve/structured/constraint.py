"""One request's structured-output state on the host: its grammar matcher, advanced by every
token the request gains, and whether the grammar has started.

With DeepSeek's chat encoding in thinking mode the prompt ends inside an open `<think>` block:
the model reasons freely and the grammar applies to what follows `</think>` (as vLLM does with a
reasoning parser). `RequestConstraint.for_prompt` sees that from the prompt's token ids: a
`<think>` after the last `</think>` means the grammar waits for the model's `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.serve.structured.backend import Matcher

__all__ = ["RequestConstraint", "ThinkTokens"]


@dataclass(frozen=True)
class ThinkTokens:
    """The ids of `<think>` and `</think>` in the model's vocabulary."""

    open: int
    close: int

    @classmethod
    def of(cls, tokenizer) -> "ThinkTokens | None":
        ids = [tokenizer.token_to_id(t) for t in ("<think>", "</think>")]
        return None if None in ids else cls(*ids)


class RequestConstraint:
    """The matcher of one request and the reasoning gate in front of it."""

    def __init__(self, matcher: Matcher, *, waiting_for: int | None = None):
        self.matcher = matcher
        self.waiting_for = waiting_for  # the token that starts the grammar (`</think>`), None: started

    @classmethod
    def for_prompt(cls, matcher: Matcher, prompt_ids: list[int], think: ThinkTokens | None) -> "RequestConstraint":
        waiting = None
        if think is not None:
            opened = _last(prompt_ids, think.open)
            if opened >= 0 and opened > _last(prompt_ids, think.close):
                waiting = think.close
        return cls(matcher, waiting_for=waiting)

    @property
    def active(self) -> bool:
        """The next token is constrained (the grammar has started and not stopped)."""
        return self.waiting_for is None and not self.matcher.is_stopped()

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar did not allow it (the matcher is then in
        its error state, `error`)."""
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return True
        if self.matcher.is_stopped():
            return False
        return bool(self.matcher.consume_token(int(token)))

    def draft_masks(self, drafts: list[int]) -> tuple[int, list[int]] | None:
        """Which of a verify row's positions this grammar masks, for a row that checks `drafts`
        after its anchor (position j decides the token after drafts 1..j): `(first, read)`: the
        positions from `first` on, whose masks are the grammar's after reading `read` one by one
        (`GrammarBackend.fill_drafts`; the matcher is not advanced); the positions before are
        free. `(0, drafts)` when the grammar has started; while it waits for `</think>`, the
        positions after a draft that closes the reasoning; None when no position is constrained."""
        if self.waiting_for is None:
            return None if self.matcher.is_stopped() else (0, list(drafts))
        if self.waiting_for in drafts:
            opened = list(drafts).index(self.waiting_for) + 1
            return opened, list(drafts[opened:])
        return None

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts nothing more."""
        return self.waiting_for is None and self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def _last(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
