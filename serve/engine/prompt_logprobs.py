"""vLLM's prompt logprobs (`SamplingParams.prompt_logprobs`): for every prompt token after the
first, its raw log-probability and rank given the tokens before it, and the k most likely tokens
there.

A request that asks computes its whole prompt with full fidelity and without the prefix cache:
its replay floor is 0 (compact prefill would skip the decoder layers below it) and it reads no
cached page (vLLM's default `skip_reading_prefix_cache` for them; its own pages are still published). Each
of its prompt chunks runs as a one-row step that keeps the logits at every position on the device
(`ModelRunner.run_scored`); only the scores come back. The warm-up of a known batch compiles
those step shapes (`shape_plan.planned_shapes`); the full warm-up (`serve`) does not, as it cannot
know which k a request will ask for: there they compile when first used.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from deepinfer.serve.engine.request import Request
from deepinfer.serve.engine.types import Logprob, logprob_entry

__all__ = ["chunk_targets", "prompt_logprobs_of", "scores_chunk"]


def scores_chunk(request: Request) -> bool:
    """Whether `request`'s next chunk is scored: it asked for prompt logprobs and is still in
    its prompt."""
    return request.params.prompt_logprobs is not None and request.computed < len(request.prompt_token_ids)


def chunk_targets(request: Request, start: int, n: int) -> np.ndarray:
    """The token each position of the chunk `[start, start + n)` is scored against: the next
    prompt token (0 past the prompt's end, where nothing is kept)."""
    prompt = request.prompt_token_ids
    targets = np.zeros((n,), np.int32)
    known = prompt[start + 1:start + n + 1]
    targets[:len(known)] = known
    return targets


def prompt_logprobs_of(request: Request, decode_one: Callable[[int], str | None]) -> list | None:
    """The output's `prompt_logprobs`: None for the first token, then per prompt token
    {token: Logprob} with the top alternatives (rank 1 first); None unless the request asked
    and every chunk of its prompt was scored (an abort mid-prompt)."""
    k = request.params.prompt_logprobs
    prompt = request.prompt_token_ids
    if k is None:
        return None
    entries: list[dict[int, Logprob] | None] = [None] * len(prompt)
    covered = 1
    for start in sorted(request.prompt_scores):
        n, pending = request.prompt_scores[start]
        if start > covered - 1:
            return None
        scores = pending.fetch()
        for i in range(n):
            position = start + i + 1  # the token this row predicts
            if position >= len(prompt):
                break
            top = (None, None) if k == 0 else (scores.top_ids[0, i], scores.top_logprobs[0, i])
            entries[position] = logprob_entry(prompt[position], scores.logprobs[0, i], scores.ranks[0, i], *top, k,
                                              decode_one)
        covered = max(covered, start + n + 1)
    return entries if covered >= len(prompt) else None
