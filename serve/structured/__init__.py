"""Structured output: a request's output follows a JSON Schema, a regex, a grammar or a list of
choices (`SamplingParams.structured_outputs`).

`backend.py` compiles specs (llguidance by default) and fills the per-step token bitmasks;
`constraint.py` is one request's grammar state on the host. The engine builds each step's masks
before it dispatches the step and the sampler applies them on the device
(`serve.engine.sampler.apply_bitmask`).
"""

from deepinfer.serve.structured.backend import GrammarBackend, LLGuidanceBackend, bitmask_words
from deepinfer.serve.structured.constraint import RequestConstraint, ThinkTokens

__all__ = ["GrammarBackend", "LLGuidanceBackend", "RequestConstraint", "ThinkTokens", "bitmask_words"]
