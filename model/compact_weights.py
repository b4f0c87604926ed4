"""Compact weights: a trained tiny checkpoint small enough to keep in the repository.

A model trained on a corpus that uses a subset U of the vocabulary changes only U's rows of the
vocabulary-sized tensors (embedding, head, the drafter's Markov embedding and head); the rest
stay as the seeded init made them (embeddings) or zero (heads: `scripts/train_tiny.py`
`export_params`). A pack stores every official tensor exactly as the checkpoint stores it (FP8
codes and UE8M0 scales, MXFP4 bytes, BF16 bits) but only U's rows of those four, plus U itself;
`write_checkpoint_from_pack` rebuilds the official checkpoint bit for bit from it and the seed.
The file is a compressed `.npz` of raw integer views (so no dtype needs pickling) with a JSON
entry naming each tensor's dtype; its SHA-256 is checked before anything is read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import ml_dtypes
import numpy as np

from deepinfer.model.checkpoint import QUANTIZED, official_arrays, tensor_names, write_official_arrays
from deepinfer.model.config import ModelConfig
from deepinfer.model.params import init_params, param_specs, tree_get

__all__ = ["PackError", "load_pack", "pack_arrays", "save_pack", "vocab_row_specs", "write_checkpoint_from_pack"]

_DTYPES = {"bfloat16": (ml_dtypes.bfloat16, np.uint16), "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8),
           "float8_e8m0fnu": (ml_dtypes.float8_e8m0fnu, np.uint8), "int8": (np.int8, np.int8),
           "float32": (np.float32, np.float32), "int64": (np.int64, np.int64), "int32": (np.int32, np.int32)}
_META = "__dtypes__"
USED_IDS = "__used_ids__"


class PackError(ValueError):
    """A pack file that is missing, altered or does not fit the config."""


def vocab_row_specs(config: ModelConfig, include_mtp: bool = True):
    """The dense vocabulary-sized tensors, whose rows outside U a pack leaves out."""
    return [s for s in param_specs(config, include_mtp=include_mtp)
            if s.storage not in QUANTIZED and s.shape and s.shape[0] == config.vocab_size]


def pack_arrays(params: dict, config: ModelConfig, used_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The official tensors of `params` (dense, full vocabulary), vocabulary-sized ones cut to
    the rows `used_ids`."""
    used = np.asarray(used_ids, np.int64)
    rows = {spec.path for spec in vocab_row_specs(config)}
    out = {USED_IDS: used.astype(np.int32)}
    for spec in param_specs(config, include_mtp="mtp" in params):
        for name, array in official_arrays(spec, tree_get(params, spec.path), config).items():
            out[name] = array[used] if spec.path in rows else array
    return out


def save_pack(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> str:
    """Write the pack (compressed npz); returns its SHA-256."""
    dtypes = {name: str(a.dtype) for name, a in arrays.items()}
    raw = {name: np.ascontiguousarray(a).view(_DTYPES[str(a.dtype)][1]) for name, a in arrays.items()}
    raw[_META] = np.frombuffer(json.dumps(dtypes, sort_keys=True).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **raw)
    data = buffer.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def load_pack(path: str | os.PathLike, expected_sha256: str | None) -> dict[str, np.ndarray]:
    """The pack's tensors; `PackError` when the file is missing or its SHA-256 differs."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PackError(f"weights pack {path}: cannot read it ({e.strerror})") from None
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and actual != expected_sha256:
        raise PackError(f"weights pack {path}: sha256 {actual}, expected {expected_sha256} (the file is altered or "
                        "from another version)")
    with np.load(io.BytesIO(data)) as npz:
        dtypes = json.loads(npz[_META].tobytes())
        return {name: npz[name].view(_DTYPES[dtype][0]) for name, dtype in dtypes.items()}


def write_checkpoint_from_pack(path: str | os.PathLike, config: ModelConfig, seed: int, directory: str | os.PathLike,
                               expected_sha256: str | None) -> None:
    """Write the official checkpoint the pack was made from: its tensors, and for the
    vocabulary-sized ones the rows outside U from the seeded init (embeddings) or zero (heads)."""
    arrays = load_pack(path, expected_sha256)
    used = arrays.pop(USED_IDS).astype(np.int64)
    include_mtp = any(name.startswith("mtp.") for name in arrays)
    init = init_params(config, seed)
    for spec in vocab_row_specs(config, include_mtp):
        base = official_arrays(spec, tree_get(init, spec.path), config)
        for name, full in base.items():
            if name not in arrays or arrays[name].shape != (len(used), *full.shape[1:]):
                raise PackError(f"weights pack {path}: {name} is missing or not {len(used)} rows of {full.shape}")
            if spec.path[-1] == "head":
                full = np.zeros_like(full)
            full = full.copy()
            full[used] = arrays[name]
            arrays[name] = full
    expected = {name for spec in param_specs(config, include_mtp=include_mtp) for name, _, _ in tensor_names(spec)}
    if set(arrays) != expected:
        raise PackError(f"weights pack {path}: tensors do not match {config.name} "
                        f"(missing {sorted(expected - set(arrays))[:3]}, extra {sorted(set(arrays) - expected)[:3]})")
    write_official_arrays(arrays, config, directory)
