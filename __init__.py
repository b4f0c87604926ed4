"""DeepInfer-JAX: DeepSeek-V4.1-Flash / V4-Flash inference in JAX.

The repository root is this package; subpackages are `deepinfer.model` (pure model functions),
`deepinfer.sharding` (meshes and partitioning rules), `deepinfer.pallas_kernels` (kernel
registry) and `deepinfer.serve` (engine, API and command line).

`from deepinfer import LLM, SamplingParams` gives the offline API (vLLM-style). Both names are
loaded on first access, so `import deepinfer` stays light (no JAX).
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

_LAZY = {"LLM": "deepinfer.serve.api.llm", "SamplingParams": "deepinfer.serve.api.types"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
