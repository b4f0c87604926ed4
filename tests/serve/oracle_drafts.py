"""Oracle drafts for speculative-decoding tests: before each engine step, every running request
is offered (`Request.host_drafts`) the next `k` tokens of a reference continuation with one wrong
token at a random place, or none, so that verify steps accept drafts at every position (the random
drafters of the test weights accept almost nothing). `OracleDrafts.right` then says how many of
the offered drafts an exact acceptance accepts."""

from __future__ import annotations

import numpy as np


class OracleDrafts:
    def __init__(self, reference: dict[str, list[int]], k: int, seed: int = 0):
        """`reference`: each request's continuation (request id -> token ids)."""
        self.reference, self.k = reference, k
        self.rng = np.random.default_rng(seed)
        self.offered: list[tuple[str, int, list[int]]] = []  # (request, output length, drafts)

    def __call__(self, engine) -> None:
        for rid, request in engine.requests.items():
            ref = self.reference.get(rid)
            n = len(request.output_ids)
            if ref is None or not request.output_ids or n >= len(ref):
                continue
            drafts = list(ref[n:n + self.k])
            wrong = self.rng.integers(0, self.k + 2)  # k, k + 1: all right
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % 1000
            request.host_drafts = drafts
            self.offered.append((rid, n, drafts[:len(ref) - n - 1]))  # (the last token is never a draft)

    def right(self, outputs: dict[str, list[int]]) -> int:
        """Offered drafts that equal the tokens `outputs` gained there, up to each block's first
        wrong one: what an exact acceptance accepts."""
        total = 0
        for rid, n, drafts in self.offered:
            got = outputs[rid][n:n + len(drafts)]
            total += next((j for j, (d, t) in enumerate(zip(drafts, got)) if d != t), len(drafts))
        return total
