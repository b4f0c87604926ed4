"""The logits that decided each token of a continuation, from one causal forward.

A forward over prompt + tokens[:-1], right-padded to a fixed length (causal: padding after a
position cannot change its logits), gives at row i the logits the model decided tokens[i] from.
One padded length means one compiled forward for every call (test_steps compiles the same one)."""

from __future__ import annotations

import numpy as np

from deepinfer.model import forward
from tests.serve.test_steps import PROMPT_LEN as FORWARD_LEN  # its forward is compiled once per run


def continuation_logits(config, params, prompt, tokens, length: int = FORWARD_LEN) -> np.ndarray:
    """`[len(tokens), V]`: row i holds the logits after prompt + tokens[:i]."""
    seq = list(prompt) + list(tokens[:-1])
    assert len(seq) <= length, f"{len(seq)} tokens: pass a longer length"
    padded = np.full(length, config.pad_token_id, np.int32)
    padded[:len(seq)] = seq
    return np.asarray(forward(params, config, padded))[len(prompt) - 1:len(seq)]
