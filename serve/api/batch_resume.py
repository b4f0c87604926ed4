"""`run-batch --resume`: what an interrupted run already wrote to its output file.

A result counts as done when it succeeded (`error` null, status 200); error lines are dropped and
their input lines run again, since most errors come from the line itself and a fixed input file
is the usual reason to resume. An interrupted write leaves a truncated last line: it is dropped
too. Any other line that is not a batch result means the file is not an earlier run's output,
and resuming refuses rather than overwrite it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class PreviousOutput:
    kept: tuple[bytes, ...] = ()  # the successful result lines, in file order, without line ends
    done_ids: frozenset[str] = frozenset()  # their custom_ids
    dropped: int = 0  # error lines and a truncated last line, to run again


def read_previous(path: str | os.PathLike) -> PreviousOutput:
    """The successful results in an earlier run's output (nothing if the file does not exist).

    Raises `ValueError` naming the file and line when a line other than the last is not a
    batch result line.
    """
    try:
        with open(path, "rb") as f:
            rows = f.read().splitlines()
    except FileNotFoundError:
        return PreviousOutput()
    kept, done, dropped = [], set(), 0
    last = max((i for i, raw in enumerate(rows) if raw.strip()), default=-1)
    for i, raw in enumerate(rows):
        if not raw.strip():
            continue
        result = _result(raw)
        if result is None:
            if i == last:  # cut short by an interrupted write
                dropped += 1
                continue
            raise ValueError(f"{os.fspath(path)}: line {i + 1} is not a run-batch result line; "
                             "--resume needs the output file of an earlier run")
        if result.get("error") is None and (result.get("response") or {}).get("status_code") == 200 \
                and isinstance(result.get("custom_id"), str):
            kept.append(raw)
            done.add(result["custom_id"])
        else:
            dropped += 1
    return PreviousOutput(tuple(kept), frozenset(done), dropped)


def _result(raw: bytes) -> dict | None:
    try:
        result = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(result, dict) or not {"custom_id", "response", "error"} <= set(result):
        return None
    if not isinstance(result["response"], (dict, type(None))):
        return None
    return result


def rewrite_kept(path: str | os.PathLike, previous: PreviousOutput) -> None:
    """Replace `path` by only its kept lines (atomically: a crash leaves the old file or the new)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".run-batch-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for raw in previous.kept:
                f.write(raw + b"\n")
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
