"""Reader and writer for safetensors files, with FP8 support and strict validation.

The ``safetensors`` package cannot hand out ``F8_E4M3`` / ``F8_E8M0`` tensors through numpy, and
the V4.1-Flash checkpoint stores every dense weight and every scale in those dtypes. The format
itself is simple, so this module implements it directly:

    [8 bytes: little-endian uint64 N][N bytes: UTF-8 JSON header][data buffer]

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the start of the data buffer) and may hold a ``"__metadata__"`` map of strings.

`SafetensorsFile` memory-maps the file read-only and returns zero-copy numpy views (the page cache
serves the bytes; a loader copies only the slices it places on devices). Every header entry is
validated when the file is opened, and every problem raises `CheckpointFormatError` naming the file
and, where there is one, the tensor: a truncated or corrupt shard must fail loudly at load time,
not produce garbage weights. Tensors must tile the data buffer exactly (no overlap, no gap, no
trailing bytes), as the reference implementation of the format requires.

`write_safetensors` writes the standard layout (header padded with spaces to a multiple of 8
bytes, tensors contiguous in sorted name order), readable by any safetensors implementation.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "CheckpointFormatError", "SafetensorsFile", "write_safetensors", "DTYPES"]

# safetensors dtype string -> numpy dtype (all little-endian).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES_BY_DTYPE: dict[np.dtype, str] = {dt.newbyteorder("<"): name for name, dt in DTYPES.items()}

_HEADER_LEN_BYTES = 8
# The reference implementation refuses headers above 100 MB; a larger length means corruption.
_MAX_HEADER_BYTES = 100_000_000
_METADATA_KEY = "__metadata__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the tensor and the file."""


class CheckpointFormatError(CheckpointError):
    """A safetensors file is malformed; the message names the file and, if any, the tensor."""

    def __init__(self, path: str | os.PathLike, message: str, tensor: str | None = None):
        self.path = os.fspath(path)
        self.tensor = tensor
        where = f"{self.path}" + (f", tensor {tensor!r}" if tensor is not None else "")
        super().__init__(f"{where}: {message}")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in the header")
        out[key] = value
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SafetensorsFile:
    """One safetensors file, memory-mapped read-only and fully validated on open.

    ``get(name)`` returns a read-only zero-copy numpy view with the stored dtype and shape (F8 as
    ml_dtypes ``float8_e4m3fn`` / ``float8_e8m0fnu``, BF16 as ``ml_dtypes.bfloat16``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        file_size = os.path.getsize(self.path)  # a missing file raises FileNotFoundError
        if file_size < _HEADER_LEN_BYTES:
            raise CheckpointFormatError(
                self.path, f"file is {file_size} bytes, shorter than the 8-byte header length"
            )
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(_HEADER_LEN_BYTES))
            if header_len > _MAX_HEADER_BYTES or _HEADER_LEN_BYTES + header_len > file_size:
                raise CheckpointFormatError(
                    self.path,
                    f"header length {header_len} runs past the end of the {file_size}-byte file "
                    "(corrupt or truncated file)",
                )
            raw = f.read(header_len)
        self._data_start = _HEADER_LEN_BYTES + header_len
        data_size = file_size - self._data_start
        header = self._parse_header(raw)

        metadata = header.pop(_METADATA_KEY, None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise CheckpointFormatError(
                self.path, f"{_METADATA_KEY} must map strings to strings, got {metadata!r}"
            )
        self._metadata: dict[str, str] = metadata

        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._validate_entry(name, entry, data_size)
        self._check_tiling(data_size)
        # np.memmap cannot map an empty file, but a valid file has at least 8 + 2 bytes ("{}").
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    # -- parsing and validation ---------------------------------------------------------------

    def _parse_header(self, raw: bytes) -> dict[str, Any]:
        try:
            text = raw.decode("utf-8")
            header = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointFormatError(self.path, f"header is not valid UTF-8 JSON: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointFormatError(
                self.path, f"header must be a JSON object, got {type(header).__name__}"
            )
        return header

    def _validate_entry(self, name: str, entry: Any, data_size: int):
        def fail(msg: str):
            return CheckpointFormatError(self.path, msg, tensor=name)

        if not isinstance(entry, dict):
            raise fail(f"header entry must be an object, got {entry!r}")
        missing = {"dtype", "shape", "data_offsets"} - entry.keys()
        if missing:
            raise fail(f"header entry lacks {sorted(missing)}")
        extra = entry.keys() - {"dtype", "shape", "data_offsets"}
        if extra:
            raise fail(f"header entry has unknown keys {sorted(extra)}")
        dtype_name = entry["dtype"]
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise fail(f"unknown dtype {dtype_name!r} (known: {', '.join(sorted(DTYPES))})")
        dtype = DTYPES[dtype_name]
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail(f"shape must be a list of non-negative integers, got {shape!r}")
        offsets = entry["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
        ):
            raise fail(f"data_offsets must be [begin, end] non-negative integers, got {offsets!r}")
        begin, end = offsets
        if end < begin:
            raise fail(f"data_offsets {offsets} end before they begin")
        if end > data_size:
            raise fail(
                f"data_offsets {offsets} point past the end of the data buffer ({data_size} bytes "
                f"after the header): the file is truncated or corrupt"
            )
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise fail(
                f"dtype {dtype_name} and shape {shape} need {expected} bytes but data_offsets "
                f"{offsets} span {end - begin}"
            )
        return dtype, tuple(shape), begin, end

    def _check_tiling(self, data_size: int) -> None:
        position, previous = 0, None
        for name, (_, _, begin, end) in sorted(self._entries.items(), key=lambda kv: kv[1][2:]):
            if begin < position:
                raise CheckpointFormatError(
                    self.path,
                    f"data_offsets [{begin}, {end}] overlap tensor {previous!r} (ends at {position})",
                    tensor=name,
                )
            if begin > position:
                raise CheckpointFormatError(
                    self.path,
                    f"data_offsets [{begin}, {end}] leave a gap of {begin - position} bytes after "
                    + (f"tensor {previous!r}" if previous else "the header"),
                    tensor=name,
                )
            position, previous = end, name
        if position != data_size:
            raise CheckpointFormatError(
                self.path,
                f"{data_size - position} bytes after the last tensor are not described by the header",
                tensor=previous,
            )

    # -- public API -----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._entries)

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` map (empty if absent)."""
        return dict(self._metadata)

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[0]

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (e.g. ``"F8_E4M3"``)."""
        return _NAMES_BY_DTYPE[self._entry(name)[0]]

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self._entry(name)
        return end - begin

    def get(self, name: str) -> np.ndarray:
        """Zero-copy, read-only view of tensor `name` (unaligned if the writer did not align)."""
        dtype, shape, begin, end = self._entry(name)
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(dtype).reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self.names)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self)} tensors)"

    def close(self) -> None:
        """Drop this object's reference to the mapping (views already handed out stay valid)."""
        self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dtype_name(name: str, dtype: np.dtype) -> str:
    key = dtype.newbyteorder("<") if dtype.byteorder in "<>=" else dtype
    if key not in _NAMES_BY_DTYPE:
        raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors equivalent")
    return _NAMES_BY_DTYPE[key]


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` (name -> numpy array) to `path` in the safetensors layout.

    Tensors are stored contiguous and little-endian in sorted name order; the JSON header is
    padded with spaces to a multiple of 8 bytes. `metadata` values must be strings. The file is
    written to a temporary name first and renamed, so a crash leaves no half-written file."""
    path = os.fspath(path)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("safetensors metadata must map str to str")
    header: dict[str, Any] = {}
    if metadata:
        header[_METADATA_KEY] = dict(metadata)
    arrays: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        if not isinstance(name, str) or name == _METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}")
        arr = np.asarray(tensors[name])
        dtype_name = _dtype_name(name, arr.dtype)
        # C order, little-endian (converts big-endian input); keeps 0-d arrays 0-d, unlike
        # np.ascontiguousarray.
        arr = arr.astype(DTYPES[dtype_name], order="C", copy=False)
        header[name] = {
            "dtype": dtype_name,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(_HEADER_LEN_BYTES + len(blob)) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for arr in arrays:
                if arr.size:
                    f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
