"""The request and result types of the public API (`SamplingParams`, `RequestOutput`,
`CompletionOutput`, `Logprob`, `RequestMetrics`).

They are the engine's own types (`deepinfer.serve.engine.types`): the engine defines what it
accepts and returns, and the API layer builds on it, never the reverse. This module keeps the
documented import path `deepinfer.serve.api.types`.
"""

from deepinfer.serve.engine.types import (  # noqa: F401  (re-exported)
    CompletionOutput,
    MAX_LOGPROBS,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["MAX_LOGPROBS", "CompletionOutput", "FinishReason", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
