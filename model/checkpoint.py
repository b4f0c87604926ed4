"""Checkpoints: the official safetensors layout (read and written), and the engine's own
fast-restart format (orbax-checkpoint, the params exactly as the model uses them).

Official layout: `model.safetensors.index.json` maps every tensor name to its shard; dense
weights are FP8 e4m3 with UE8M0 block scales (`.scale`), routed experts MXFP4 (int8 bytes of two
e2m1 nibbles, even k in the low nibble, one UE8M0 scale per 32), the rest BF16/F32. Reading uses
the project's own safetensors parser and memory maps; each tensor is placed straight onto its
devices with `jax.make_array_from_callback`, so the host holds one slice at a time. Every problem
is a `CheckpointError` naming the tensor and the file; nothing is silently skipped (the only names
ignored are the families a text-only model does not use: vision and aligner tensors; the draft
blocks `mtp.*` are read when the checkpoint has them).

Safety: index entries must stay inside the checkpoint directory; every slice read is checked for
NaN/Inf and out-of-range scales (`tensor_checks`); our writer leaves `deepinfer-manifest.json`
(SHA-256 of every file, `manifest`), which the loader compares when present. `verify=False`
skips the value and checksum checks; `deepinfer verify-checkpoint` (`verify`) lists every problem.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from deepinfer.ops import quant
from deepinfer.model.config import ModelConfig, load_config, to_hf_config
from deepinfer.model.params import (
    F32, FP4, FP8, FP8_ROWS, I64, ParamSpec, QuantWeight, abstract_params, build_tree, dense_dtype, param_specs,
    quant_block, quant_shapes, tree_get,
)
from deepinfer.model.manifest import manifest_problems, write_manifest
from deepinfer.model.safetensors_io import CheckpointError, CheckpointFormatError, SafetensorsFile, write_safetensors
from deepinfer.model.tensor_checks import value_problem

INDEX_FILE = "model.safetensors.index.json"
ORBAX_MARKER = "deepinfer_orbax.json"
# The vision tower is not read (text only).
IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
QUANTIZED = (FP8, FP8_ROWS, FP4)


# ---- name map --------------------------------------------------------------------------


def expert_tensor_name(spec: ParamSpec, expert: int) -> str:
    """`layers.3.ffn.experts.w1` + 5 -> `layers.3.ffn.experts.5.w1`."""
    head, _, proj = spec.name.rpartition(".")
    return f"{head}.{expert}.{proj}"


def tensor_names(spec: ParamSpec) -> list[tuple[str, str, int | None]]:
    """(official name, role, expert) for every tensor of a spec; role is "weight" or "scale"."""
    bases = [(expert_tensor_name(spec, e), e) for e in range(spec.experts)] if spec.experts else [(spec.name, None)]
    out = []
    for base, e in bases:
        weight_name = base + ".weight" if spec.has_weight_suffix else base
        out.append((weight_name, "weight", e))
        if spec.storage in QUANTIZED:
            out.append((base + ".scale", "scale", e))
    return out


def expected_format(spec: ParamSpec, config: ModelConfig, role: str) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype, shape) of one official tensor (per expert for stacked experts)."""
    if spec.storage in QUANTIZED:
        q_shape, s_shape = quant_shapes(spec, config)
        if spec.experts:
            q_shape, s_shape = q_shape[1:], s_shape[1:]
        if role == "scale":
            return "F8_E8M0", s_shape
        return ("I8" if spec.storage == FP4 else "F8_E4M3"), q_shape
    shape = spec.shape[1:] if spec.experts else spec.shape
    return {F32: "F32", I64: "I64"}.get(spec.storage, "BF16"), shape


# ---- writing ---------------------------------------------------------------------------


def official_arrays(spec: ParamSpec, leaf: Any, config: ModelConfig) -> dict[str, np.ndarray]:
    """The official tensors of one leaf, quantizing a dense leaf as the release does."""
    out: dict[str, np.ndarray] = {}
    names = tensor_names(spec)
    if spec.storage in QUANTIZED:
        if isinstance(leaf, QuantWeight):
            q_all, s_all = np.asarray(leaf.q), np.asarray(leaf.scale)
        else:
            dense = np.asarray(jax.device_get(leaf), dtype=np.float32)
            blocks = [dense[e] for e in range(spec.experts)] if spec.experts else [dense]
            pairs = [
                quant.quantize_mxfp4(b, block=32) if spec.storage == FP4
                else quant.quantize_fp8_blocks(b, block=quant_block(spec, config))
                for b in blocks
            ]
            q_all = np.stack([p[0] for p in pairs]) if spec.experts else pairs[0][0]
            s_all = np.stack([p[1] for p in pairs]) if spec.experts else pairs[0][1]
        for name, role, e in names:
            src = q_all if role == "weight" else s_all
            out[name] = np.ascontiguousarray(src[e] if e is not None else src)
        return out
    dense = np.asarray(jax.device_get(leaf))
    target = {F32: np.float32, I64: np.int64}.get(spec.storage, ml_dtypes.bfloat16)
    for name, _, e in names:
        out[name] = np.ascontiguousarray((dense[e] if e is not None else dense).astype(target))
    return out


def _shard_key(name: str) -> str:
    """Official grouping: embedding, one shard per layer, head and norm, one per draft block."""
    if name.startswith("layers."):
        return "layer%05d" % int(name.split(".")[1])
    if name.startswith("mtp."):
        return "zzz_mtp%03d" % int(name.split(".")[1])
    return "aaa_embed" if name.startswith("embed") else "zzz_head"


def write_checkpoint(params: dict, config: ModelConfig, directory: str | os.PathLike) -> None:
    """Write `params` (dense or quantized leaves) in the official format: shards, index, an
    HF-style `config.json`, and the checksum manifest `deepinfer-manifest.json`."""
    arrays = {}
    for spec in param_specs(config, include_mtp="mtp" in params):
        arrays.update(official_arrays(spec, tree_get(params, spec.path), config))
    write_official_arrays(arrays, config, directory)


def write_official_arrays(arrays: dict[str, np.ndarray], config: ModelConfig, directory: str | os.PathLike) -> None:
    """Write the official tensors `arrays` (name -> array as stored) as `write_checkpoint` does."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    groups: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    for name, array in arrays.items():
        groups[_shard_key(name)][name] = array
    keys = sorted(groups)
    weight_map, total = {}, 0
    for i, key in enumerate(keys):
        filename = f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors"
        write_safetensors(os.path.join(directory, filename), groups[key], metadata={"format": "pt"})
        for name, array in groups[key].items():
            weight_map[name] = filename
            total += array.nbytes
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_hf_config(config), f, indent=1)
    write_manifest(directory, [*(f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors" for i in range(len(keys))),
                               INDEX_FILE, "config.json"])


# ---- reading ---------------------------------------------------------------------------


def _outside(filename: str, directory: str) -> bool:
    """Whether an index entry leaves the checkpoint directory: absolute, or with a `..` part.

    Only the entry is judged, not where a symlinked shard points: the Hugging Face cache stores
    every shard of a snapshot as a symlink into `../../blobs/`, and whoever can place a symlink in
    the directory already controls the checkpoint, while the index is data that travels with it."""
    parts = filename.replace("\\", "/").split("/")
    if os.path.isabs(filename) or filename.startswith(("/", "\\")) or ".." in parts:
        return True
    base = os.path.normpath(directory)
    return os.path.commonpath([base, os.path.normpath(os.path.join(base, filename))]) != base


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """A JSON object from `path`; anything else is a `CheckpointError` naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid {what}: invalid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a valid {what}: a JSON {type(value).__name__}, expected a JSON object")
    return value


def read_index(directory: str) -> dict[str, str]:
    """The `weight_map` of `directory`'s index, with every entry a shard file inside `directory`."""
    index_path = os.path.join(directory, INDEX_FILE)
    index = read_json_object(index_path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: not a valid safetensors index: `weight_map` must map tensor names "
                              f"to shard files, got {'nothing' if weight_map is None else type(weight_map).__name__}")
    for name, filename in weight_map.items():
        if not isinstance(filename, str) or not filename or "\x00" in filename:
            raise CheckpointError(f"{index_path}: tensor `{name}` maps to {filename!r}, not a shard file name")
        if _outside(filename, directory):
            raise CheckpointError(f"{index_path}: tensor `{name}` maps to {filename!r}, outside the checkpoint "
                                  f"directory {directory} (absolute paths and `..` are refused)")
    return dict(weight_map)


class _ShardSet:
    """Lazily opened shards of one checkpoint directory; `get` checks each tensor's values once
    (NaN/Inf, scale range) unless `check_values` is off."""

    def __init__(self, directory: str, check_values: bool = True):
        self.directory = directory
        self.check_values = check_values
        self._checked: set[tuple[str, str]] = set()
        if os.path.isfile(os.path.join(directory, INDEX_FILE)):
            self.weight_map = read_index(directory)
        else:
            single = os.path.join(directory, "model.safetensors")
            if not os.path.isfile(single):
                raise CheckpointError(f"{directory}: no {INDEX_FILE} and no model.safetensors")
            self.weight_map = {name: "model.safetensors" for name in SafetensorsFile(single).names}
        self._files: dict[str, SafetensorsFile] = {}
        for name, filename in self.weight_map.items():
            if not os.path.isfile(os.path.join(directory, filename)):
                raise CheckpointError(f"{INDEX_FILE} maps tensor `{name}` to missing shard {filename!r} in {directory}")

    def file(self, name: str) -> SafetensorsFile:
        filename = self.weight_map[name]
        if filename not in self._files:
            path = os.path.join(self.directory, filename)
            try:
                f = SafetensorsFile(path)
            except OSError as e:
                raise CheckpointError(f"tensor `{name}`: cannot read shard {path} ({e.strerror or e})") from None
            unlisted = [n for n in f.names if self.weight_map.get(n) != filename]
            if unlisted:
                raise CheckpointError(f"tensor `{unlisted[0]}` in {f.path} is not listed for that file in {INDEX_FILE}")
            self._files[filename] = f
        f = self._files[filename]
        if name not in f:
            raise CheckpointError(f"tensor `{name}` is listed in {INDEX_FILE} but missing from {f.path}")
        return f

    def get(self, name: str, index: tuple = ()) -> np.ndarray:
        """The slice `index` of tensor `name` (a view of the memory map), its values checked once."""
        f = self.file(name)
        array = f.get(name)[index]
        if self.check_values and (name, repr(index)) not in self._checked:
            origin = tuple(0 if s.start is None else s.start for s in index) if all(
                isinstance(s, slice) for s in index) else ()
            problem = value_problem(array, f.dtype_name(name), origin)
            if problem:
                raise CheckpointError(f"tensor `{name}` in {f.path}: {problem}")
            self._checked.add((name, repr(index)))
        return array

    def is_open(self, filename: str) -> bool:
        return filename in self._files

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def expected_tensors(config: ModelConfig, include_mtp: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Official name -> (safetensors dtype, shape) of every tensor `config` needs."""
    return {name: expected_format(spec, config, role)
            for spec in param_specs(config, include_mtp) for name, role, _ in tensor_names(spec)}


def structure_problems(shards: _ShardSet, config: ModelConfig, include_mtp: bool):
    """Yield every structural problem: missing and unknown tensors, unreadable shards, dtypes and
    shapes that differ from `config` (one message per problem, naming the tensor and the file)."""
    expected = expected_tensors(config, include_mtp)
    missing = [n for n in expected if n not in shards.weight_map]
    if missing:
        yield f"{shards.directory}: missing tensor `{missing[0]}`" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    for name in shards.weight_map:
        if name not in expected and not name.startswith(IGNORED_PREFIXES):
            yield (f"unexpected tensor `{name}` in {os.path.join(shards.directory, shards.weight_map[name])}: "
                   "not part of this configuration")
    broken: set[str] = set()
    for name, (dtype, shape) in expected.items():
        if name not in shards.weight_map or shards.weight_map[name] in broken:
            continue
        try:
            f = shards.file(name)
        except CheckpointError as e:
            if not shards.is_open(shards.weight_map[name]):
                broken.add(shards.weight_map[name])  # the shard itself is unusable: reported once
            yield str(e)
            continue
        if f.dtype_name(name) != dtype or tuple(f.shape(name)) != tuple(shape):
            yield f"tensor `{name}` in {f.path}: expected {dtype}{list(shape)}, found {f.dtype_name(name)}{list(f.shape(name))}"


def _place(shape, dtype, sharding, read) -> jax.Array:
    """`read(index) -> np.ndarray` for the slice `index` of the global array."""
    return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: np.ascontiguousarray(read(idx)).astype(dtype))


def _stacked_reader(shards: _ShardSet, names: list[str]):
    def read(index):
        experts = range(len(names))[index[0]]
        return np.stack([shards.get(names[e], index[1:]) for e in experts])

    return read


def _load_leaf(spec: ParamSpec, shards: _ShardSet, config: ModelConfig, sharding, dequantize: bool):
    names = tensor_names(spec)
    weights = [n for n, role, _ in names if role == "weight"]
    scales = [n for n, role, _ in names if role == "scale"]
    quantized = spec.storage in QUANTIZED
    dense_dt = dense_dtype(spec, config)

    if quantized and not dequantize:
        q_shape, s_shape = quant_shapes(spec, config)
        q_dtype = np.int8 if spec.storage == FP4 else ml_dtypes.float8_e4m3fn
        if spec.experts:
            q = _place(q_shape, q_dtype, sharding.q, _stacked_reader(shards, weights))
            s = _place(s_shape, ml_dtypes.float8_e8m0fnu, sharding.scale, _stacked_reader(shards, scales))
        else:
            q = _place(q_shape, q_dtype, sharding.q, lambda idx: shards.get(weights[0], idx))
            s = _place(s_shape, ml_dtypes.float8_e8m0fnu, sharding.scale, lambda idx: shards.get(scales[0], idx))
        return QuantWeight(q, s, kind=spec.storage, block=quant_block(spec, config))

    if quantized:
        def dense_of(i):
            if spec.storage == FP4:
                return quant.dequantize_mxfp4(shards.get(weights[i]), shards.get(scales[i]), block=32)
            return quant.dequantize_fp8_blocks(shards.get(weights[i]), shards.get(scales[i]),
                                               block=quant_block(spec, config))
        if spec.experts:
            return _place(spec.shape, dense_dt, sharding,
                          lambda idx: np.stack([dense_of(e)[idx[1:]] for e in range(spec.experts)[idx[0]]]))
        return _place(spec.shape, dense_dt, sharding, lambda idx: dense_of(0)[idx])
    if spec.experts:
        return _place(spec.shape, dense_dt, sharding, _stacked_reader(shards, weights))
    return _place(spec.shape, dense_dt, sharding, lambda idx: shards.get(weights[0], idx))


# Where each leaf goes: `placement(spec, config, quantized)` -> a `jax.sharding.Sharding`, or for a
# leaf kept quantized a `QuantWeight` of shardings (`.q`, `.scale`). The caller owns the layout
# (`deepinfer.sharding.rules.mesh_placement(mesh)` for a mesh); the model only reads.
Placement = Callable[[ParamSpec, ModelConfig, bool], Any]


def single_device(device=None) -> Placement:
    """Every leaf on one device (default: the first local device)."""
    sharding = jax.sharding.SingleDeviceSharding(device if device is not None else jax.local_devices()[0])

    def place(spec: ParamSpec, config: ModelConfig, quantized: bool):
        if not quantized:
            return sharding
        return QuantWeight(sharding, sharding, kind=spec.storage, block=quant_block(spec, config))

    return place


def load_checkpoint(directory: str | os.PathLike, *, placement: Placement | None = None, dequantize: bool = False,
                    verify: bool = True, **config_overrides) -> tuple[ModelConfig, dict]:
    """Read an official-format or orbax checkpoint, each leaf placed by `placement` (default:
    `single_device()`; a mesh's layout: `deepinfer.sharding.rules.mesh_placement(mesh)`).

    FP8/FP4 weights stay in their checkpoint form (`QuantWeight`) unless `dequantize=True`;
    `config_overrides` replace config fields (e.g. `fake_quant=False`, `dtype="float32"`).
    `verify` (official format) checks the shards against `deepinfer-manifest.json` when there is
    one and every stored value for NaN/Inf and out-of-range scales; `verify=False` skips both
    (for a large checkpoint already checked with `deepinfer verify-checkpoint`). Every problem
    raises `CheckpointError` (a ValueError) naming the file and, where there is one, the tensor."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, ORBAX_MARKER)):
        from deepinfer.model.orbax_format import restore_orbax

        return restore_orbax(directory, placement=placement, dequantize=dequantize, **config_overrides)

    config = load_config(directory, **config_overrides)
    shards = _ShardSet(directory, check_values=verify)
    # The draft blocks are optional in a checkpoint (HF conversions drop them): read when present.
    include_mtp = any(name.startswith("mtp.") for name in shards.weight_map)
    problems = list(structure_problems(shards, config, include_mtp))
    if not problems and verify:
        problems = manifest_problems(directory)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s); `deepinfer verify-checkpoint` lists them)"
        raise CheckpointError(problems[0] + (more if len(problems) > 1 else ""))
    placement = placement or single_device()
    leaves = {}
    for spec in param_specs(config, include_mtp):
        quantized = spec.storage in QUANTIZED and not dequantize
        sharding = placement(spec, config, quantized)
        try:
            leaves[spec.name] = _load_leaf(spec, shards, config, sharding, dequantize)
        except CheckpointError:
            raise
        except (ValueError, OSError) as e:
            raise CheckpointError(f"tensor `{spec.name}` in {directory}: {e}") from e
    return config, build_tree(config, lambda s: leaves[s.name], include_mtp)


__all__ = [
    "CheckpointError", "CheckpointFormatError", "load_checkpoint", "write_checkpoint", "tensor_names",
    "abstract_params",
]


def official_dense_tensors(params: dict, config: ModelConfig, dtype=np.float64) -> dict[str, np.ndarray]:
    """Every weight under its official name, dequantized to `dtype` (no `.scale` tensors;
    experts unstacked). For tests against independent references and for inspection."""
    from deepinfer.model.layers import dequantize

    out: dict[str, np.ndarray] = {}
    for spec in param_specs(config, include_mtp="mtp" in params):
        leaf = tree_get(params, spec.path)
        dense = np.asarray(jax.device_get(dequantize(leaf, jax.numpy.float32) if isinstance(leaf, QuantWeight) else leaf))
        for name, role, e in tensor_names(spec):
            if role == "weight":
                out[name] = (dense[e] if e is not None else dense).astype(dtype)
    return out
