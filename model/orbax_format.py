"""The engine's fast-restart format: the params exactly as the model uses them (stacked experts,
quantized leaves kept quantized), saved with orbax-checkpoint and restored sharded onto any mesh,
including one of a different shape than the mesh it was saved from."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp

from deepinfer.model.config import ModelConfig, config_from_dict, to_hf_config
from deepinfer.model.params import (
    FP4, FP8, FP8_ROWS, QuantWeight, abstract_params, build_tree, dense_dtype, param_specs, tree_get,
)
from deepinfer.model.safetensors_io import CheckpointError

MARKER = "deepinfer_orbax.json"
FORMAT_VERSION = 1


def _quantized_storage(params: dict, config: ModelConfig) -> list[str]:
    return sorted({s.storage for s in param_specs(config, include_mtp="mtp" in params)
                   if isinstance(tree_get(params, s.path), QuantWeight)})


def save_orbax(params: dict, config: ModelConfig, directory: str | os.PathLike) -> None:
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "params"), params, force=True)
    checkpointer.wait_until_finished()
    marker = {"format_version": FORMAT_VERSION, "quantized": _quantized_storage(params, config),
              "include_mtp": "mtp" in params,
              "config": to_hf_config(config)}
    with open(os.path.join(directory, MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)


def read_marker(directory: str, **config_overrides) -> tuple[ModelConfig, set[str], bool]:
    """(config, quantized storages, include_mtp) from the marker; every problem is a
    `CheckpointError` naming the marker file and the key."""
    from deepinfer.model.checkpoint import read_json_object

    path = os.path.join(directory, MARKER)

    def fail(message: str):
        return CheckpointError(f"{path}: {message}")

    marker = read_json_object(path, "deepinfer orbax marker")
    if marker.get("format_version") != FORMAT_VERSION:
        raise fail(f"`format_version` is {marker.get('format_version')!r}, not {FORMAT_VERSION}")
    quantized = marker.get("quantized")
    if not isinstance(quantized, list) or not all(q in (FP8, FP8_ROWS, FP4) for q in quantized):
        raise fail(f"`quantized` must be a list of {[FP8, FP8_ROWS, FP4]}, got {quantized!r}")
    include_mtp = marker.get("include_mtp", False)
    if not isinstance(include_mtp, bool):
        raise fail(f"`include_mtp` must be true or false, got {include_mtp!r}")
    if not isinstance(marker.get("config"), dict):
        raise fail(f"`config` must be a config object, got {marker.get('config')!r}")
    try:
        config = config_from_dict(marker["config"], source=path, name=os.path.basename(directory))
        if config_overrides:
            config = dataclasses.replace(config, **config_overrides)
    except ValueError as e:  # ConfigError
        raise (e if path in str(e) else fail(f"`config`: {e}")) from None
    return config, set(quantized), include_mtp


def restore_orbax(directory: str | os.PathLike, *, placement=None, dequantize: bool = False,
                  **config_overrides) -> tuple[ModelConfig, dict]:
    """Restore onto `placement` (`model.checkpoint.Placement`; default: the first device)."""
    from deepinfer.model.checkpoint import single_device

    directory = os.path.abspath(os.fspath(directory))
    config, quantized, include_mtp = read_marker(directory, **config_overrides)
    placement = placement or single_device()
    abstract = abstract_params(config, quantized=bool(quantized), include_mtp=include_mtp)

    def target(spec):
        is_q = spec.storage in quantized and spec.storage in (FP8, FP8_ROWS, FP4)
        sharding = placement(spec, config, is_q)
        leaf = tree_get(abstract, spec.path)
        if is_q:
            return QuantWeight(jax.ShapeDtypeStruct(leaf.q.shape, leaf.q.dtype, sharding=sharding.q),
                               jax.ShapeDtypeStruct(leaf.scale.shape, leaf.scale.dtype, sharding=sharding.scale),
                               kind=leaf.kind, block=leaf.block)
        return jax.ShapeDtypeStruct(spec.shape, dense_dtype(spec, config), sharding=sharding)

    params_dir = os.path.join(directory, "params")
    try:
        params = ocp.StandardCheckpointer().restore(params_dir, build_tree(config, target, include_mtp))
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types; name the directory
        raise CheckpointError(f"{params_dir}: orbax cannot restore the params ({type(e).__name__}: {e})") from None
    if dequantize and quantized:
        from deepinfer.model.layers import dequantize as dense_of

        dense_shardings = build_tree(config, lambda s: placement(s, config, False), include_mtp)
        params = jax.jit(lambda p: build_tree(config, lambda s: dense_of(tree_get(p, s.path), dense_dtype(s, config)),
                                              include_mtp),
                         out_shardings=dense_shardings)(params)
    return config, params


def convert_to_orbax(src: str | os.PathLike, dst: str | os.PathLike, placement=None) -> ModelConfig:
    """Official checkpoint -> orbax fast-restart checkpoint (quantized form kept), loaded through
    `placement` (`model.checkpoint.Placement`; default: the first device)."""
    from deepinfer.model.checkpoint import load_checkpoint

    config, params = load_checkpoint(src, placement=placement)
    save_orbax(params, config, dst)
    return config
