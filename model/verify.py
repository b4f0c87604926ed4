"""`deepinfer verify-checkpoint`: every problem of a checkpoint directory, not only the first.

Official format, in order: the config; the index (JSON, types, shard paths inside the directory);
every shard header; every expected tensor present, no unknown tensor, dtypes and shapes as the
config's param specs say; the checksum manifest when there is one; then every stored value, shard
by shard and tensor by tensor from the memory map (NaN/Inf weights, NaN or out-of-range UE8M0
scales; see `tensor_checks`), so a 100+ GB checkpoint needs no more memory than its largest chunk.

Orbax format: the marker, then a restore onto the first device and the same value checks on
every leaf (this one needs the memory of the whole model).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from deepinfer.model.checkpoint import INDEX_FILE, ORBAX_MARKER, CheckpointError, _ShardSet, structure_problems
from deepinfer.model.config import load_config
from deepinfer.model.manifest import MANIFEST_FILE, manifest_problems
from deepinfer.model.safetensors_io import DTYPES
from deepinfer.model.tensor_checks import value_problem

__all__ = ["VerifyReport", "verify_checkpoint"]


@dataclass
class VerifyReport:
    directory: str
    problems: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    bytes_checked: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(directory: str | os.PathLike) -> VerifyReport:
    directory = os.path.abspath(os.fspath(directory))
    report = VerifyReport(directory)
    if not os.path.isdir(directory):
        report.problems.append(f"{directory}: not a directory")
    elif os.path.isfile(os.path.join(directory, ORBAX_MARKER)):
        _verify_orbax(report)
    else:
        _verify_official(report)
    return report


def _verify_official(report: VerifyReport) -> None:
    directory, problems = report.directory, report.problems
    try:
        config = load_config(directory)
    except (ValueError, OSError) as e:
        config = None
        problems.append(f"{directory}: cannot read the config ({e})")
    try:
        shards = _ShardSet(directory, check_values=False)
    except CheckpointError as e:
        problems.append(str(e))
        return
    if config is not None:
        include_mtp = any(name.startswith("mtp.") for name in shards.weight_map)
        problems.extend(structure_problems(shards, config, include_mtp))
    if os.path.isfile(os.path.join(directory, MANIFEST_FILE)):
        problems.extend(manifest_problems(directory))
        report.notes.append(f"checksums compared with {MANIFEST_FILE}")
    else:
        report.notes.append(f"no {MANIFEST_FILE}: checksums not compared (not written by deepinfer)")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, filename in shards.weight_map.items():
        by_file[filename].append(name)
    for filename, names in sorted(by_file.items()):
        for name in sorted(names):
            try:
                f = shards.file(name)
            except CheckpointError as e:
                if str(e) not in problems:
                    problems.append(str(e))
                if not shards.is_open(filename):
                    break  # the shard itself is unusable: reported once
                continue
            problem = value_problem(f.get(name), f.dtype_name(name))
            if problem:
                problems.append(f"tensor `{name}` in {f.path}: {problem}")
            report.tensors_checked += 1
            report.bytes_checked += f.nbytes(name)
        shards.close()  # drop this shard's mapping before the next
    report.notes.append(f"{len(by_file)} shard file(s) listed in {INDEX_FILE if os.path.isfile(os.path.join(directory, INDEX_FILE)) else 'model.safetensors'}")


def _verify_orbax(report: VerifyReport) -> None:
    import jax

    from deepinfer.model.checkpoint import load_checkpoint

    try:
        _, params = load_checkpoint(report.directory)
    except (ValueError, OSError) as e:
        report.problems.append(str(e))
        return
    names = {np.dtype(dt): name for name, dt in DTYPES.items()}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        array = np.asarray(jax.device_get(leaf))
        where = os.path.join(report.directory, "params") + ", leaf " + jax.tree_util.keystr(path)
        problem = value_problem(array, names.get(array.dtype, ""))
        if problem:
            report.problems.append(f"{where}: {problem}")
        report.tensors_checked += 1
        report.bytes_checked += array.nbytes
    report.notes.append("orbax checkpoint: restored onto one device and every leaf checked")
