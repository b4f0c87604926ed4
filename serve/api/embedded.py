"""The embedded models `LLM` and the commands load by name: written once as real official-format
checkpoints into a cache directory (atomically, so concurrent processes are safe) and loaded from
there like any other checkpoint.

* `"tiny-v4.1-trained"` (the default): the tiny-v4.1 architecture trained on the Python standard
  library, rebuilt from the compact pack in `model/weights/` (its SHA-256 checked) into
  `~/.cache/deepinfer/tiny-v4.1-trained-<sha12>`, with its drafter's confidence calibration
  (`serve/engine/verify_schedule.py` `CALIBRATION_FILE`);
* `RANDOM_MODELS` with random weights (`init_params` seed 0, float32), into
  `~/.cache/deepinfer/<preset>-seed0`: `"tiny-v4.1"`, what tests compare against `init_params`, and
  `"tiny-v4.1-short"`, one layer of each of its roles (5 layers, compiles in about half the time).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

from deepinfer.model import PRESETS, init_params, load_config, write_checkpoint
from deepinfer.model.checkpoint import INDEX_FILE

__all__ = ["DEFAULT_MODEL", "RANDOM_MODEL", "RANDOM_MODELS", "RANDOM_WEIGHT_SEED", "TRAINED_MODEL",
           "ensure_random_checkpoint", "ensure_trained_checkpoint", "resolve_model", "trained_weights"]

log = logging.getLogger("deepinfer.llm")

# tiny-v4.1 trained on the Python standard library (`scripts/train_tiny.py`), shipped compactly
# in `model/weights/` (`model/compact_weights.py`): what `LLM()` and the commands load by default
TRAINED_MODEL = "tiny-v4.1-trained"
DEFAULT_MODEL = TRAINED_MODEL
# the same architecture with random weights (seed 0): the tests' reference model; and the presets
# that can be asked for by name with random weights
RANDOM_MODEL = "tiny-v4.1"
RANDOM_MODELS = (RANDOM_MODEL, "tiny-v4.1-short")
RANDOM_WEIGHT_SEED = 0


def resolve_model(model, cache_dir) -> tuple[str, str]:
    """`LLM`'s `model` argument -> (checkpoint directory, model name); embedded models are
    written on first use (under `cache_dir` if given); bad input -> ValueError naming `model`."""
    if model is None or str(model) == TRAINED_MODEL:
        directory, _ = ensure_trained_checkpoint(cache_dir)
        return directory, TRAINED_MODEL
    if str(model) in RANDOM_MODELS:
        directory, _ = ensure_random_checkpoint(cache_dir, str(model))
        return directory, str(model)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model: must be a checkpoint directory or a preset name, got {type(model).__name__}")
    path = os.fspath(model)
    if os.path.isdir(path):
        return os.path.abspath(path), path
    embedded = f"{TRAINED_MODEL!r} (trained), {', '.join(map(repr, RANDOM_MODELS))} (random weights)"
    if path in PRESETS:
        raise ValueError(f"model: preset {path!r} has no weights here; the embedded models are {embedded}. "
                         "Pass a checkpoint directory")
    raise ValueError(f"model: {path!r} is neither a checkpoint directory nor an embedded model ({embedded})")


def _embedded_dir(name: str) -> str:
    """Where an embedded checkpoint lives unless `cache_dir` is given."""
    return os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", name)


def _is_complete(directory: str) -> bool:
    return (os.path.isfile(os.path.join(directory, INDEX_FILE))
            and os.path.isfile(os.path.join(directory, "config.json")))


def trained_weights() -> dict:
    """What `model/weights/tiny-v4.1-trained.json` says of the shipped trained pack (with `path`)."""
    from deepinfer.model import compact_weights

    info_path = os.path.join(os.path.dirname(os.path.abspath(compact_weights.__file__)), "weights",
                             f"{TRAINED_MODEL}.json")
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: the embedded {TRAINED_MODEL!r} weights are not here ({info_path}: {e})") from None
    return {**info, "path": os.path.join(os.path.dirname(info_path), info["file"])}


def ensure_trained_checkpoint(cache_dir: str | os.PathLike | None = None) -> tuple[str, bool]:
    """The official checkpoint of the shipped trained tiny model (`model/compact_weights.py`),
    written once (the pack's checksum checked) under `~/.cache/deepinfer/tiny-v4.1-trained-<sha>`;
    returns `(directory, written_now)`."""
    from deepinfer.model.compact_weights import write_checkpoint_from_pack
    from deepinfer.model.config import config_from_dict

    info = trained_weights()
    if cache_dir is None:
        cache_dir = _embedded_dir(f"{TRAINED_MODEL}-{info['sha256'][:12]}")
    config = config_from_dict(info["config"], name=TRAINED_MODEL)
    directory, written = _materialize(
        cache_dir, lambda tmp: write_checkpoint_from_pack(info["path"], config, info["seed"], tmp, info["sha256"]),
        f"trained {TRAINED_MODEL}")
    _write_calibration(directory, info["sts"])
    return directory, written


def _write_calibration(directory: str, sts: dict) -> None:
    """The pack's STS temperatures as the checkpoint's DSpark calibration (`verify_schedule`),
    written atomically beside it unless there (a checkpoint written before the file existed
    gains it here)."""
    from deepinfer.serve.engine.verify_schedule import CALIBRATION_FILE

    path = os.path.join(directory, CALIBRATION_FILE)
    if os.path.isfile(path):
        return
    record = {"confidence_temperatures": sts["temperatures"],
              "source": f"Sequential Temperature Scaling on {sts['blocks']} held-out blocks "
                        "(scripts/train_drafter.py --phase sts)",
              "ece_before": sts["ece_before"], "ece_after": sts["ece_after"]}
    fd, tmp = tempfile.mkstemp(prefix=f".{CALIBRATION_FILE}.", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def ensure_random_checkpoint(cache_dir: str | os.PathLike | None = None,
                             preset: str = RANDOM_MODEL) -> tuple[str, bool]:
    """Make sure an embedded random-weight checkpoint exists; returns `(directory, written_now)`.

    The `preset` (one of `RANDOM_MODELS`) with random weights (seed 0, float32) is written in the
    official format to a temporary sibling directory and renamed onto `cache_dir` (default
    `~/.cache/deepinfer/<preset>-seed0`); when another process wins the race, its copy is kept
    and ours is discarded. A non-empty `cache_dir` that is not a complete checkpoint is an error
    (delete it to have it rewritten).
    """
    if preset not in RANDOM_MODELS:
        raise ValueError(f"preset: {preset!r} has no embedded random weights (one of {RANDOM_MODELS})")

    def write(tmp: str) -> None:
        config = load_config(preset, dtype="float32")
        write_checkpoint(init_params(config, RANDOM_WEIGHT_SEED), config, tmp)

    if cache_dir is None:
        cache_dir = _embedded_dir(f"{preset}-seed{RANDOM_WEIGHT_SEED}")
    return _materialize(cache_dir, write, f"{preset} (random weights, seed {RANDOM_WEIGHT_SEED})")


def _materialize(cache_dir: str | os.PathLike, write, what: str) -> tuple[str, bool]:
    """`write(tmp)` into a temporary sibling of `cache_dir`, renamed onto it unless another
    process won the race; a non-empty `cache_dir` that is no complete checkpoint is an error."""
    target = os.path.abspath(os.fspath(cache_dir))
    if _is_complete(target):
        return target, False
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ValueError(f"cache_dir: {target} exists but is not a complete checkpoint "
                         f"(no {INDEX_FILE} or config.json); delete it to have it rewritten")
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        write(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process already put a copy there
        except OSError:
            if not _is_complete(target):
                raise
            return target, False
        log.info("wrote the embedded %s checkpoint to %s", what, target)
        return target, True
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
