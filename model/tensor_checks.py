"""Value checks of stored checkpoint tensors: NaN/Inf weights and out-of-range UE8M0 scales.

The checks read the raw bits (exponent masks), so they run at memory speed on memory-mapped
shards, in chunks of at most `CHUNK` values (no full-size temporaries for a 1 GB embedding).
A quantized weight dequantizes to `value * 2^(scale - 127)`; it is finite exactly when the stored
value is not a NaN code and the scale byte is at most `SCALE_MAX_BYTE`, so checking the stored
form checks every dequantized value without building it.

Scale range: UE8M0 byte 255 is NaN. Bytes above 127 + `SCALE_MAX_EXPONENT` (2^16) are refused as
corruption: they would make an FP8 weight larger than 448 * 65536 (about 3e7) and an FP4 one larger
than 6 * 65536, far beyond any trained weight (the release's scales lie around 2^-20 .. 2^-5; a
flipped top bit of a real scale lands at 2^100 or more). Small scales are always valid: the
quantizers give all-zero MXFP4 blocks the scale 2^-126.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SCALE_MAX_EXPONENT", "SCALE_MAX_BYTE", "value_problem"]

SCALE_MAX_EXPONENT = 16
SCALE_MAX_BYTE = 127 + SCALE_MAX_EXPONENT
CHUNK = 1 << 24

# safetensors dtype -> (unsigned view, exponent mask): all exponent bits set is Inf or NaN.
_FLOAT_MASKS = {
    "F64": (np.uint64, 0x7FF0000000000000),
    "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),  # e4m3fn has no Inf: S.1111.111 is its only NaN
}


def _bad_mask(bits: np.ndarray, dtype_name: str) -> np.ndarray | None:
    if dtype_name in _FLOAT_MASKS:
        _, mask = _FLOAT_MASKS[dtype_name]
        return (bits & bits.dtype.type(mask)) == mask
    if dtype_name == "F8_E8M0":
        return bits > SCALE_MAX_BYTE
    return None


def value_problem(array: np.ndarray, dtype_name: str, origin: tuple[int, ...] = ()) -> str | None:
    """What is wrong with the stored values of one tensor (or slice), or None when they are fine.

    `array` holds the stored values (any float dtype of the format, or the raw bytes of F8 types);
    `dtype_name` is its safetensors dtype; `origin` is where a slice starts in its tensor (indices
    in the message are the tensor's). Integer tensors (the MXFP4 `I8` nibbles among them) have no
    invalid values."""
    if dtype_name not in _FLOAT_MASKS and dtype_name != "F8_E8M0":
        return None
    unsigned = _FLOAT_MASKS.get(dtype_name, (np.uint8, 0))[0]
    flat = np.ascontiguousarray(array).reshape(-1).view(unsigned)
    count, first, nan_scales = 0, None, 0
    for start in range(0, flat.size, CHUNK):
        bits = flat[start:start + CHUNK]
        bad = _bad_mask(bits, dtype_name)
        n = int(np.count_nonzero(bad))
        if n:
            if first is None:
                first = start + int(np.argmax(bad))
            count += n
            if dtype_name == "F8_E8M0":
                nan_scales += int(np.count_nonzero(bits == 255))
    if not count:
        return None
    position = [int(i) for i in np.unravel_index(first, array.shape)]
    position = [i + (origin[k] if k < len(origin) else 0) for k, i in enumerate(position)]
    where = f"first at index {position}" if array.shape else "the scalar"
    if dtype_name != "F8_E8M0":
        return f"{count} non-finite value(s) (NaN or Inf), {where}"
    byte = int(flat[first])
    return (f"{count} scale(s) out of range ({nan_scales} NaN byte 255; the rest above 2^{SCALE_MAX_EXPONENT}), "
            f"{where}: byte {byte} = {'NaN' if byte == 255 else f'2^{byte - 127}'}")
