"""The training corpus of the tiny trained model: the running interpreter's standard-library
sources, split into train and held-out BY MODULE, tokenized with the project tokenizer, cached
as .npy files in the run directory.

Why this corpus: every machine that runs DeepInfer has it offline, it is code (DeepInfer's
fastest scenario), and it is the same text on every machine with the same Python version.

- Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, except `site-packages` (not the
  standard library) and test directories (`test`, `tests`, `idle_test`): they are two thirds of
  the bytes, mostly repetitive assertions and deliberately odd code (bad encodings, syntax-error
  fixtures), and a 2-hour budget sees only a few million tokens anyway, so spending them on
  library code gives completions that look like the library a user would prompt with.
- Split: a file is held out when the first 8 hex digits of sha256(relative path) mod 1000 fall
  below `HELD_OUT_PERMILLE` (5 %): deterministic, independent of file order and of other files.
- Tokens: each file is `BOS + text`, files concatenated in sorted path order (int32 arrays).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sysconfig

import numpy as np

HELD_OUT_PERMILLE = 50
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
CORPUS_VERSION = 1  # bump when the selection or the tokenization changes


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: pathlib.Path) -> list[str]:
    """Relative paths (posix, sorted) of the corpus files under `root`."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 1000 < HELD_OUT_PERMILLE


def read_source(path: pathlib.Path) -> str | None:
    """The file's text, or None when it is not UTF-8 (a handful of legacy-encoded files)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def tokenize_files(root: pathlib.Path, files: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [N], file start offsets int64 [n_files]) with BOS before each file."""
    bos = tokenizer.token_to_id(BOS_TOKEN)
    texts = [read_source(root / f) for f in files]
    kept = [t for t in texts if t is not None]
    encodings = tokenizer.encode_batch(kept, add_special_tokens=False)
    pieces, starts, n = [], [], 0
    for enc in encodings:
        ids = np.asarray([bos, *enc.ids], np.int32)
        starts.append(n)
        pieces.append(ids)
        n += ids.size
    tokens = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
    return tokens, np.asarray(starts, np.int64)


def build_corpus(run_dir: str | pathlib.Path, root: str | pathlib.Path | None = None) -> dict:
    """Tokenize the corpus into `run_dir/data` once (cached: reused when `meta.json` matches the
    interpreter, the root and `CORPUS_VERSION`). Returns the metadata dict."""
    from deepinfer.model.tokenizer import load_tokenizer

    root = pathlib.Path(root) if root is not None else stdlib_root()
    data = pathlib.Path(run_dir) / "data"
    meta_path = data / "meta.json"
    files = source_files(root)
    key = {"version": CORPUS_VERSION, "root": str(root), "n_files": len(files),
           "files_sha256": hashlib.sha256("\n".join(files).encode()).hexdigest()}
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            return meta
    data.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    split = {"train": [f for f in files if not is_held_out(f)], "heldout": [f for f in files if is_held_out(f)]}
    meta: dict = {"key": key, "splits": {}}
    used = set()
    for name, names in split.items():
        tokens, starts = tokenize_files(root, names, tokenizer)
        np.save(data / f"{name}.npy", tokens)
        np.save(data / f"{name}_starts.npy", starts)
        used.update(np.unique(tokens).tolist())
        meta["splits"][name] = {"files": len(names), "documents": int(starts.size), "tokens": int(tokens.size)}
    train_ids = np.unique(np.load(data / "train.npy"))
    np.save(data / "used_ids.npy", train_ids.astype(np.int32))
    meta["distinct_ids_train"] = int(train_ids.size)
    meta["distinct_ids_all"] = len(used)
    meta["heldout_files"] = split["heldout"]
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def load_split(run_dir: str | pathlib.Path, name: str) -> np.ndarray:
    return np.load(pathlib.Path(run_dir) / "data" / f"{name}.npy", mmap_mode="r")


def load_used_ids(run_dir: str | pathlib.Path) -> np.ndarray:
    """Token ids the train split uses (sorted int32): the vocabulary rows training touches."""
    return np.load(pathlib.Path(run_dir) / "data" / "used_ids.npy")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="run directory (the data lands in OUT/data)")
    args = ap.parse_args()
    m = build_corpus(args.out)
    print(json.dumps({k: v for k, v in m.items() if k != "heldout_files"}, indent=1))
