"""The checksum manifest our checkpoint writer leaves next to the shards.

`deepinfer-manifest.json` records the SHA-256 of every file the writer produced (shards, index,
config.json): `{"format_version": 1, "algorithm": "sha256", "files": {name: hexdigest}}`. A flipped
bit that still decodes to a plausible weight is invisible to every structural and value check;
the manifest catches it. Checkpoints from elsewhere have no manifest, and that is not an error.

Hashing reads every byte once; files are hashed on a thread pool (hashlib releases the GIL on
large buffers), so it runs at the disk's speed or a few GB/s per core from the page cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["MANIFEST_FILE", "manifest_problems", "sha256_file", "write_manifest"]

MANIFEST_FILE = "deepinfer-manifest.json"
FORMAT_VERSION = 1
_BLOCK = 8 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _hash_all(directory: str, names: list[str]) -> dict[str, str]:
    workers = max(1, min(len(names), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(os.path.join(directory, n)), names)))


def write_manifest(directory: str, names: list[str]) -> None:
    """Record the SHA-256 of the files `names` (relative to `directory`)."""
    manifest = {"format_version": FORMAT_VERSION, "algorithm": "sha256",
                "files": dict(sorted(_hash_all(directory, sorted(names)).items()))}
    with open(os.path.join(directory, MANIFEST_FILE), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


def _read(path: str) -> tuple[dict[str, str] | None, str | None]:
    """(files, None) or (None, what is wrong with the manifest itself)."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path}: unreadable checksum manifest ({e})"
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        return None, f"{path}: not a version-{FORMAT_VERSION} checksum manifest"
    if manifest.get("algorithm") != "sha256":
        return None, f"{path}: unsupported checksum algorithm {manifest.get('algorithm')!r} (expected 'sha256')"
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return None, f"{path}: `files` must map file names to hex digests"
    for name in files:
        if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            return None, f"{path}: file {name!r} lies outside the checkpoint directory"
    return files, None


def manifest_problems(directory: str) -> list[str]:
    """Every mismatch between the manifest and the files (empty without a manifest)."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return []
    files, problem = _read(path)
    if problem:
        return [problem]
    missing = [n for n in files if not os.path.isfile(os.path.join(directory, n))]
    present = [n for n in files if n not in missing]
    problems = [f"{os.path.join(directory, n)}: listed in {MANIFEST_FILE} but missing" for n in missing]
    for name, digest in _hash_all(directory, present).items():
        if digest != files[name].lower():
            problems.append(f"{os.path.join(directory, name)}: SHA-256 {digest} does not match {files[name]} "
                            f"recorded in {MANIFEST_FILE} (the file changed after it was written)")
    return problems
