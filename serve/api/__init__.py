"""Public request and result types of the engine's Python API.

`deepinfer.serve.api.types` holds `SamplingParams`, `RequestOutput`, `CompletionOutput`,
`Logprob` and `RequestMetrics`, named and shaped like vLLM's so code written against vLLM's
offline API reads the same here (see `interfaces.md` §1). This package imports no JAX.
"""

from deepinfer.serve.api.types import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams"]
