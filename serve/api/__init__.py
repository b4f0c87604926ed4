"""The engine's Python API.

`deepinfer.serve.api.types` holds `SamplingParams`, `RequestOutput`, `CompletionOutput`,
`Logprob` and `RequestMetrics`, named and shaped like vLLM's so code written against vLLM's
offline API reads the same here (see `interfaces.md` §1). `LLM` (`deepinfer.serve.api.llm`) is
the offline engine with vLLM's `generate` / `chat`; `run_batch` (`deepinfer.serve.api.batch`)
runs an OpenAI batch JSONL file. Importing this package imports no JAX: `LLM` and `run_batch`
are loaded on first access.
"""

from deepinfer.serve.api.types import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "run_batch"]

_LAZY = {"LLM": "deepinfer.serve.api.llm", "run_batch": "deepinfer.serve.api.batch"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
