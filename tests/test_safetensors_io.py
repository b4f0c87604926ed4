"""Tests of deepinfer.model.safetensors_io: byte layout, dtypes, zero-copy reads, error reporting."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from deepinfer.model.safetensors_io import CheckpointFormatError, SafetensorsFile, write_safetensors


def raw_file(path, header: dict, data: bytes, pad: bool = True) -> str:
    """Build a safetensors file by hand (independent of the writer)."""
    blob = json.dumps(header).encode()
    if pad:
        blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def all_dtype_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 256, 24, dtype=np.uint8)
    return {
        "f8_e4m3": u8.reshape(4, 6).view(ml_dtypes.float8_e4m3fn),  # includes NaN bytes
        "f8_e8m0": u8[:10].view(ml_dtypes.float8_e8m0fnu),
        "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "i8": rng.integers(-128, 128, (5, 3), dtype=np.int8),
        "u8": u8.reshape(2, 12),
        "i32": rng.integers(-(2**31), 2**31, 9, dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, (3, 1), dtype=np.int64),
        "bool": rng.integers(0, 2, (2, 2)).astype(bool),
        "scalar_f32": np.array(3.5, np.float32),
        "empty_bf16": np.zeros((0, 4), ml_dtypes.bfloat16),
        "f64": rng.standard_normal(3),
        "strided_f32": rng.standard_normal((6, 8)).astype(np.float32)[::2, ::3],
        "big_endian_i32": np.arange(5, dtype=">i4"),
    }


EXPECTED_DTYPE_NAMES = {
    "f8_e4m3": "F8_E4M3", "f8_e8m0": "F8_E8M0", "bf16": "BF16", "f32": "F32", "f16": "F16",
    "i8": "I8", "u8": "U8", "i32": "I32", "i64": "I64", "bool": "BOOL", "scalar_f32": "F32",
    "empty_bf16": "BF16", "f64": "F64", "strided_f32": "F32", "big_endian_i32": "I32",
}


def test_round_trip_every_dtype_bit_exact(tmp_path):
    tensors = all_dtype_tensors()
    path = tmp_path / "all.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt", "note": "ünïcode"})
    f = SafetensorsFile(path)
    assert f.names == sorted(tensors)
    assert f.metadata == {"format": "pt", "note": "ünïcode"}
    for name, arr in tensors.items():
        got = f.get(name)
        want = arr.astype(arr.dtype.newbyteorder("="), order="C")
        assert f.shape(name) == arr.shape
        assert f.dtype(name) == want.dtype
        assert f.dtype_name(name) == EXPECTED_DTYPE_NAMES[name]
        assert same_bits(got, want), name
    # Values, not just bytes, for the two FP8 kinds and BF16.
    np.testing.assert_array_equal(
        f.get("bf16").astype(np.float32), tensors["bf16"].astype(np.float32)
    )
    assert np.array_equal(f.get("big_endian_i32"), np.arange(5))


def test_header_follows_the_standard_layout(tmp_path):
    tensors = all_dtype_tensors()
    path = tmp_path / "layout.safetensors"
    write_safetensors(path, tensors, metadata={"k": "v"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    text = raw[8 : 8 + n].decode()
    assert text.rstrip(" ") == text.rstrip() and text.lstrip().startswith("{")
    header = json.loads(text)
    assert header.pop("__metadata__") == {"k": "v"}
    assert sorted(header) == sorted(tensors)
    position = 0
    for name in sorted(tensors):  # contiguous, in sorted name order
        entry = header[name]
        assert set(entry) == {"dtype", "shape", "data_offsets"}
        assert entry["dtype"] == EXPECTED_DTYPE_NAMES[name]
        assert entry["shape"] == list(tensors[name].shape)
        begin, end = entry["data_offsets"]
        assert begin == position
        want = tensors[name].astype(tensors[name].dtype.newbyteorder("<"), order="C")
        assert raw[8 + n + begin : 8 + n + end] == want.tobytes()
        position = end
    assert 8 + n + position == len(raw)


def test_reads_hand_built_file(tmp_path):
    # e4m3 1.0 = 0 0111 000 = 0x38, 2.0 = 0x40, -1.5 = 1 0111 100 = 0xBC;
    # e8m0 0x7F = 2^0, 0x80 = 2^1, 0x7B = 2^-4; bf16 1.0 = 0x3F80, -2.0 = 0xC000 (little-endian).
    header = {
        "__metadata__": {"format": "pt"},
        "a.weight": {"dtype": "F8_E4M3", "shape": [3], "data_offsets": [0, 3]},
        "a.scale": {"dtype": "F8_E8M0", "shape": [3, 1], "data_offsets": [3, 6]},
        "n.weight": {"dtype": "BF16", "shape": [2], "data_offsets": [6, 10]},
        "e.weight": {"dtype": "I8", "shape": [1, 2], "data_offsets": [10, 12]},
    }
    data = bytes([0x38, 0x40, 0xBC, 0x7F, 0x80, 0x7B, 0x80, 0x3F, 0x00, 0xC0, 0x21, 0xF7])
    path = raw_file(tmp_path / "hand.safetensors", header, data, pad=False)
    f = SafetensorsFile(path)
    assert f.get("a.weight").astype(np.float32).tolist() == [1.0, 2.0, -1.5]
    assert f.get("a.weight").dtype == ml_dtypes.float8_e4m3fn
    assert f.get("a.scale").astype(np.float32).tolist() == [[1.0], [2.0], [0.0625]]
    assert f.get("a.scale").dtype == ml_dtypes.float8_e8m0fnu
    assert f.get("n.weight").astype(np.float32).tolist() == [1.0, -2.0]
    assert f.get("e.weight").tolist() == [[0x21, 0xF7 - 256]]
    assert f.metadata == {"format": "pt"} and len(f) == 4 and "a.scale" in f


def test_get_is_a_zero_copy_read_only_view(tmp_path):
    path = tmp_path / "view.safetensors"
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    write_safetensors(path, {"w": w})
    f = SafetensorsFile(path)
    v = f.get("w")
    assert not v.flags.writeable
    assert np.shares_memory(v, f.get("w"))  # both views of the one mapping
    base = v
    while getattr(base, "base", None) is not None:
        base = base.base
    assert isinstance(base, np.memmap) or type(base).__name__ == "mmap"
    with pytest.raises(ValueError):
        v[0, 0] = 1.0
    assert np.array_equal(v[2:4, 1:3], w[2:4, 1:3])


def test_writer_rejects_unsupported(tmp_path):
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "f4.safetensors", {"c": np.zeros(2, ml_dtypes.float4_e2m1fn)})
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "m.safetensors", {"c": np.zeros(2)}, metadata={"a": 1})
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_empty_file_and_metadata_only(tmp_path):
    path = tmp_path / "empty.safetensors"
    write_safetensors(path, {})
    f = SafetensorsFile(path)
    assert f.names == [] and f.metadata == {}


# ------------------------------------------------------------------------------------------------
# error cases: each must name the file and (where there is one) the tensor
# ------------------------------------------------------------------------------------------------


def _good_header():
    return {
        "x.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "y.scale": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [16, 20]},
    }


def _expect_error(path, tensor=None, match=None):
    with pytest.raises(CheckpointFormatError) as info:
        SafetensorsFile(path)
    msg = str(info.value)
    assert str(path) in msg
    if tensor is not None:
        assert repr(tensor) in msg and info.value.tensor == tensor
    if match is not None:
        assert match in msg
    assert isinstance(info.value, ValueError)
    return msg


def test_good_hand_header_reads(tmp_path):
    path = raw_file(tmp_path / "ok.safetensors", _good_header(), bytes(20))
    assert SafetensorsFile(path).names == ["x.weight", "y.scale"]


def test_error_corrupt_header(tmp_path):
    p = tmp_path / "corrupt.safetensors"
    blob = b'{"x.weight": {"dtype": "F32", "sha'
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(16))
    _expect_error(str(p), match="JSON")
    p2 = tmp_path / "notutf8.safetensors"
    p2.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}" + bytes(8))
    _expect_error(str(p2))
    p3 = tmp_path / "list.safetensors"
    p3.write_bytes(struct.pack("<Q", 8) + b"[]      ")
    _expect_error(str(p3), match="JSON object")


def test_error_header_length_beyond_file(tmp_path):
    p = tmp_path / "hugeheader.safetensors"
    p.write_bytes(struct.pack("<Q", 10_000) + b"{}      ")
    _expect_error(str(p), match="header length")
    p2 = tmp_path / "short.safetensors"
    p2.write_bytes(b"\x01\x02\x03")
    _expect_error(str(p2))


def test_error_truncated_shard(tmp_path):
    path = tmp_path / "trunc.safetensors"
    write_safetensors(path, {"a.weight": np.ones((4, 4), np.float32), "b.weight": np.ones(8, np.float32)})
    raw = path.read_bytes()
    path.write_bytes(raw[:-5])  # cut into b.weight
    _expect_error(str(path), tensor="b.weight", match="past the end")


def test_error_overlapping_offsets(tmp_path):
    h = _good_header()
    h["y.scale"]["data_offsets"] = [12, 16]
    h["x.weight"]["shape"] = [4]  # x: [0, 16) overlaps y: [12, 16)
    path = raw_file(tmp_path / "overlap.safetensors", h, bytes(16))
    _expect_error(path, tensor="y.scale", match="overlap")


def test_error_gap_and_trailing_bytes(tmp_path):
    h = _good_header()
    h["y.scale"]["data_offsets"] = [17, 21]
    _expect_error(raw_file(tmp_path / "gap.safetensors", h, bytes(21)), tensor="y.scale", match="gap")
    _expect_error(raw_file(tmp_path / "tail.safetensors", _good_header(), bytes(23)), tensor="y.scale")


def test_error_dtype_shape_inconsistent_with_bytes(tmp_path):
    h = _good_header()
    h["x.weight"]["dtype"] = "BF16"  # [2, 2] BF16 is 8 bytes, not 16
    _expect_error(raw_file(tmp_path / "dtype.safetensors", h, bytes(20)), tensor="x.weight", match="16")
    h = _good_header()
    h["y.scale"]["shape"] = [5]
    _expect_error(raw_file(tmp_path / "shape.safetensors", h, bytes(20)), tensor="y.scale")


def test_error_unknown_dtype(tmp_path):
    h = _good_header()
    h["y.scale"]["dtype"] = "F8_E4M3FNUZ"
    _expect_error(raw_file(tmp_path / "unk.safetensors", h, bytes(20)), tensor="y.scale", match="F8_E4M3FNUZ")


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]},
        {"dtype": "F32", "shape": [2, 2], "data_offsets": [0]},
        {"dtype": "F32", "shape": "2x2", "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [2, 2]},
        [1, 2, 3],
    ],
)
def test_error_malformed_entry(tmp_path, entry):
    h = _good_header()
    h["x.weight"] = entry
    _expect_error(raw_file(tmp_path / "bad.safetensors", h, bytes(20)), tensor="x.weight")


def test_error_duplicate_name_and_bad_metadata(tmp_path):
    p = tmp_path / "dup.safetensors"
    blob = (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(2))
    _expect_error(str(p), match="duplicate")
    h = _good_header()
    h["__metadata__"] = {"n": 3}
    _expect_error(raw_file(tmp_path / "meta.safetensors", h, bytes(20)), match="__metadata__")


def test_cross_check_with_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(-3, 3, dtype=np.int8)}
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, metadata={"format": "np"})
    loaded = st.load_file(str(path))
    for k, v in tensors.items():
        assert same_bits(loaded[k], v)
    path2 = tmp_path / "y.safetensors"
    st.save_file(tensors, str(path2))
    f = SafetensorsFile(path2)
    for k, v in tensors.items():
        assert same_bits(np.asarray(f.get(k)), v)
