"""What `LLM` accepts, checked before any work: its constructor's arguments (mesh, tokenizer,
integers), prompts in vLLM's forms, sampling params and chat conversations. Every error is a
`ValueError` naming the argument, key or prompt index (`llm.py` adds the call's context)."""

from __future__ import annotations

import difflib
import os
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from deepinfer.pallas_kernels.accelerator import Accelerator
from deepinfer.serve.api.types import SamplingParams

__all__ = ["CHAT_TEMPLATE_KEYS", "chat_kwargs", "is_token_list", "load_tokenizer_argument",
           "normalize_conversations", "normalize_params", "normalize_prompts", "positive_int", "resolve_mesh",
           "token_ids", "unknown_argument"]

CHAT_TEMPLATE_KEYS = ("thinking", "reasoning_effort", "tool_choice", "response_format")


def resolve_mesh(mesh: Any, accelerator: Accelerator):
    """None | "auto" | "dp=2,cp=2,tp=1" | {"dp": 2, ...} | Mesh -> Mesh or None; a spec is laid
    over the accelerator's devices, a Mesh must be made of them."""
    if mesh is None:
        return None
    from jax.sharding import Mesh

    from deepinfer.sharding import AXES, make_mesh

    if isinstance(mesh, Mesh):
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"mesh: axes must be {AXES}, got {tuple(mesh.axis_names)}")
        platforms = {d.platform for d in mesh.devices.flat}
        if accelerator.backend is not None and platforms != {accelerator.platform}:
            raise ValueError(f"mesh: its devices are {', '.join(sorted(platforms))} but accelerator="
                             f"{accelerator.name!r} runs on {accelerator.platform}")
        return mesh
    if not isinstance(mesh, (str, dict)):
        raise ValueError(f"mesh: must be a Mesh, a spec like 'dp=2,cp=2,tp=1', a dict or 'auto', "
                         f"got {type(mesh).__name__}")
    try:
        return make_mesh(None if mesh == "auto" else mesh, devices=accelerator.devices)
    except ValueError as e:
        raise ValueError(f"mesh: {e}") from None


def unknown_argument(name: str, known: Iterable[str], what: str) -> ValueError:
    hint = difflib.get_close_matches(name, sorted(known), n=1)
    suffix = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ValueError(f"{name}: unknown {what}{suffix}")


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def is_token_list(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value))


def token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"{where}: prompt_token_ids must be a list of int, got {type(value).__name__}")
    ids = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{where}: token ids must be integers, got {t!r}")
        ids.append(int(t))
    return ids


def load_tokenizer_argument(tokenizer: Any):
    """`LLM(tokenizer=)`: None (the DeepSeek tokenizer), a tokenizer.json path, or a tokenizers.Tokenizer."""
    from deepinfer.model.tokenizer import load_tokenizer

    if tokenizer is None:
        return load_tokenizer()
    if isinstance(tokenizer, (str, os.PathLike)):
        try:
            return load_tokenizer(tokenizer, expected_sha256=None)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
            raise ValueError(f"tokenizer: cannot load {os.fspath(tokenizer)!r}: {e}") from None
    for method in ("encode", "decode", "token_to_id"):
        if not callable(getattr(tokenizer, method, None)):
            raise ValueError(f"tokenizer: expected a path or a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    return tokenizer


def normalize_prompts(prompts: Any, encode: Callable[[str], list[int]]) -> list[tuple[str | None, list[int]]]:
    """`LLM.generate`'s prompts as (text or None, token ids), text encoded by `encode`; errors name the
    prompt's index."""
    if isinstance(prompts, (str, Mapping)) or is_token_list(prompts):
        prompts = [prompts]
    elif not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a str, a list of token ids, a prompt dict or a list of "
                         f"those, got {type(prompts).__name__}")
    return [one_prompt(p, f"prompt {i}", encode) for i, p in enumerate(prompts)]


def one_prompt(prompt: Any, where: str, encode: Callable[[str], list[int]]) -> tuple[str | None, list[int]]:
    """One prompt: a str, a list of token ids, or a dict with "prompt" / "prompt_token_ids"."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: the prompt is empty")
        return prompt, encode(prompt)
    if isinstance(prompt, Mapping):
        extra = set(prompt) - {"prompt", "prompt_token_ids"}
        if extra:
            raise ValueError(f"{where}: unsupported prompt key {sorted(extra)[0]!r} "
                             "(use 'prompt' or 'prompt_token_ids')")
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            ids = token_ids(prompt["prompt_token_ids"], where)
            if not ids:
                raise ValueError(f"{where}: the prompt is empty")
            return (text if isinstance(text, str) else None), ids
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"{where}: 'prompt' must be a str, got {type(prompt['prompt']).__name__}")
            return one_prompt(prompt["prompt"], where, encode)
        raise ValueError(f"{where}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple, np.ndarray)):
        ids = token_ids(prompt, where)
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        return None, ids
    raise ValueError(f"{where}: expected a str, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def normalize_params(sampling_params, n: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt from one (or None, or a dict) or a list of `n`."""
    def one(p, where):
        if p is None:
            return SamplingParams()
        if isinstance(p, SamplingParams):
            return p
        if isinstance(p, Mapping):
            try:
                return SamplingParams.from_dict(p)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        raise ValueError(f"{where}: expected SamplingParams, got {type(p).__name__}")

    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {n} prompts "
                             "(pass one, or one per prompt)")
        return [one(p, f"sampling_params[{i}]") for i, p in enumerate(sampling_params)]
    shared = one(sampling_params, "sampling_params")
    return [shared] * n


def normalize_conversations(messages) -> list[list[Mapping[str, Any]]]:
    """`LLM.chat`'s messages as a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a conversation (a non-empty list of message dicts) "
                         "or a list of conversations")
    if all(isinstance(m, Mapping) for m in messages):
        return [list(messages)]
    if all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    raise ValueError("messages: mix of message dicts and conversations; pass one conversation "
                     "(a list of dicts) or a list of conversations")


def chat_kwargs(chat_template_kwargs) -> dict[str, Any]:
    """`LLM.chat`'s chat_template_kwargs checked, thinking off unless it or a reasoning effort is set."""
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if key not in CHAT_TEMPLATE_KEYS:
            raise unknown_argument(key, CHAT_TEMPLATE_KEYS, "chat_template_kwargs key")
    if "thinking" in kwargs and kwargs["thinking"] is not None and not isinstance(kwargs["thinking"], bool):
        raise ValueError(f"thinking: must be a bool, got {kwargs['thinking']!r}")
    if kwargs.get("thinking") is None and kwargs.get("reasoning_effort") is None:
        kwargs["thinking"] = False
    return kwargs
