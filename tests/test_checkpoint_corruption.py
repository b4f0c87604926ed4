"""Corrupted checkpoints: every damage gives one clear error naming the file (and the tensor).

A tiny-v4.1 checkpoint is written once per module; each case copies it, damages the copy (the
tensor, shard and byte are drawn from a seeded generator), and checks that `load_checkpoint`,
`LLM(...)` and `verify_checkpoint` / `deepinfer verify-checkpoint` all refuse it with a message
naming the file, and the tensor where there is one. The untouched copy still loads and verifies.
"""

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from deepinfer.model import CheckpointError, init_params, load_checkpoint, load_config, write_checkpoint
from deepinfer.model.config import to_hf_config
from deepinfer.model.manifest import MANIFEST_FILE
from deepinfer.model.orbax_format import MARKER
from deepinfer.model.safetensors_io import SafetensorsFile
from deepinfer.model.tensor_checks import SCALE_MAX_BYTE
from deepinfer.model.verify import verify_checkpoint
from deepinfer.serve.api.llm import LLM
from deepinfer.serve.cli import main

INDEX = "model.safetensors.index.json"
# tiny-v4.1 with a small vocabulary and Engram tables: a 5 MB checkpoint, cheap to copy per case
CFG = load_config("tiny-v4.1", dtype="float32", vocab_size=512, engram_num_embeddings=(257, 263))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    write_checkpoint(init_params(CFG, seed=0), CFG, d)
    return str(d)


# ---- helpers ------------------------------------------------------------------------------


def weight_map(d) -> dict[str, str]:
    with open(os.path.join(d, INDEX)) as f:
        return json.load(f)["weight_map"]


def write_index(d, index) -> None:
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump(index, f)


def pick(rng, d, dtype):
    """A seeded tensor of `dtype` (safetensors name): (name, shard path)."""
    wm = weight_map(d)
    files = {fn: SafetensorsFile(os.path.join(d, fn)) for fn in set(wm.values())}
    names = sorted(n for n in wm if files[wm[n]].dtype_name(n) == dtype)
    name = names[rng.integers(len(names))]
    return name, os.path.join(d, wm[name])


def raw_header(path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def rewrite_header(path, header) -> None:
    """Replace the JSON header, keeping the data bytes."""
    _, start = raw_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    blob = json.dumps(header).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def poke(path, name, element, value: bytes) -> None:
    """Overwrite element `element` (flat) of tensor `name` with the raw bytes `value`."""
    header, start = raw_header(path)
    begin = header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(start + begin + element * len(value))
        f.write(value)


def n_elements(path, name) -> int:
    return int(np.prod(raw_header(path)[0][name]["shape"]))


def drop_manifest(d) -> None:
    """A checkpoint from elsewhere: no manifest of ours (value checks alone must catch it)."""
    os.remove(os.path.join(d, MANIFEST_FILE))


# ---- the damage: each returns the strings the error must contain -------------------------------


def truncated_shard(d, rng):
    path = os.path.join(d, sorted(set(weight_map(d).values()))[rng.integers(3)])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - int(rng.integers(1, 64)))
    return [os.path.basename(path)]


def garbage_header(d, rng):
    path = os.path.join(d, sorted(set(weight_map(d).values()))[rng.integers(5)])
    with open(path, "r+b") as f:
        f.seek(8 + int(rng.integers(1, 40)))
        f.write(bytes(rng.integers(128, 256, 6, dtype=np.uint8)))
    return [os.path.basename(path), "header"]


def header_length_overflow(d, rng):
    path = os.path.join(d, sorted(set(weight_map(d).values()))[rng.integers(5)])
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", int(rng.integers(1 << 40, 1 << 62))))
    return [os.path.basename(path)]


def wrong_dtype_string(d, rng):
    name, path = pick(rng, d, "F8_E4M3")
    header, _ = raw_header(path)
    header[name]["dtype"] = "F8_E5M2"  # same size: a valid header of the wrong type
    rewrite_header(path, header)
    return [name, os.path.basename(path), "F8_E5M2"]


def unknown_dtype_string(d, rng):
    name, path = pick(rng, d, "BF16")
    header, _ = raw_header(path)
    header[name]["dtype"] = "BF17"
    rewrite_header(path, header)
    return [name, os.path.basename(path), "BF17"]


def wrong_shape(d, rng):
    name, path = pick(rng, d, "F8_E4M3")
    header, _ = raw_header(path)
    header[name]["shape"] = header[name]["shape"][::-1] if len(set(header[name]["shape"])) > 1 else [
        int(np.prod(header[name]["shape"]))]
    rewrite_header(path, header)
    return [name, os.path.basename(path), str(header[name]["shape"])]


def missing_tensor(d, rng):
    name, _ = pick(rng, d, "F8_E8M0")
    write_index(d, {"weight_map": {n: f for n, f in weight_map(d).items() if n != name}})
    return [name, "missing"]


def extra_tensor(d, rng):
    wm = weight_map(d)
    name, path = pick(rng, d, "F32")
    extra = name + ".frobnicate"
    header, _ = raw_header(path)
    # the extra tensor takes the listed tensor's bytes; the listed one moves to the end (still tiled)
    header[extra] = dict(header[name])
    write_index(d, {"weight_map": {**wm, extra: wm[name]}})
    size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    header[name] = {**header[name], "data_offsets": [end, end + size]}
    rewrite_header(path, header)
    with open(path, "ab") as f:
        f.write(b"\0" * size)
    return [extra, os.path.basename(path)]


def corrupt_index_json(d, rng):
    with open(os.path.join(d, INDEX)) as f:
        text = f.read()
    with open(os.path.join(d, INDEX), "w") as f:
        f.write(text[: int(rng.integers(1, len(text) - 1))])
    return [INDEX]


def index_wrong_types(d, rng):
    wm = weight_map(d)
    name = sorted(wm)[rng.integers(len(wm))]
    variants = [
        ([], None), ({"weight_map": sorted(wm)}, "weight_map"), ({"weight_map": None}, "weight_map"),
        ({"weight_map": {**wm, name: 7}}, name), ({"weight_map": {**wm, name: ""}}, name),
        ({"metadata": {}}, "weight_map"),
    ]
    index, named = variants[rng.integers(len(variants))]
    write_index(d, index)
    return [INDEX] + ([named] if named else [])


def index_points_outside(d, rng):
    wm = weight_map(d)
    name = sorted(wm)[rng.integers(len(wm))]
    target = ["/etc/passwd", "../" + wm[name], "sub/../../" + wm[name], os.path.abspath(os.path.join(d, wm[name]))][
        rng.integers(4)]
    write_index(d, {"weight_map": {**wm, name: target}})
    return [INDEX, name, target, "outside"]


def nonfinite_weight(d, rng):
    drop_manifest(d)
    dtype = ["BF16", "F32"][rng.integers(2)]
    name, path = pick(rng, d, dtype)
    bad = [np.nan, np.inf, -np.inf][rng.integers(3)]
    raw = np.array([bad], ml_dtypes.bfloat16 if dtype == "BF16" else np.float32).tobytes()
    poke(path, name, int(rng.integers(n_elements(path, name))), raw)
    return [name, os.path.basename(path), "non-finite"]


def nan_fp8_weight(d, rng):
    drop_manifest(d)
    name, path = pick(rng, d, "F8_E4M3")
    poke(path, name, int(rng.integers(n_elements(path, name))), bytes([0x7F | (0x80 * int(rng.integers(2)))]))
    return [name, os.path.basename(path), "non-finite"]


def nan_scale(d, rng):
    drop_manifest(d)
    name, path = pick(rng, d, "F8_E8M0")
    poke(path, name, int(rng.integers(n_elements(path, name))), bytes([255]))
    return [name, os.path.basename(path), "NaN"]


def huge_scale(d, rng):
    drop_manifest(d)
    name, path = pick(rng, d, "F8_E8M0")
    poke(path, name, int(rng.integers(n_elements(path, name))), bytes([int(rng.integers(SCALE_MAX_BYTE + 1, 255))]))
    return [name, os.path.basename(path), "out of range"]


def flipped_bit(d, rng):
    """A bit flip that decodes to a plausible value: only the manifest can see it."""
    name, path = pick(rng, d, "I8")  # MXFP4 nibbles: every byte is a valid pair of e2m1 codes
    header, start = raw_header(path)
    begin = header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(start + begin + int(rng.integers(n_elements(path, name))))
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ (1 << int(rng.integers(8)))]))
    return [os.path.basename(path), MANIFEST_FILE]


def shard_is_missing(d, rng):
    wm = weight_map(d)
    name = sorted(wm)[rng.integers(len(wm))]
    os.remove(os.path.join(d, wm[name]))
    return [wm[name]]


def config_float_invalid(d, rng):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    key, value = [("rms_norm_eps", float("nan")), ("rope_theta", "abc"), ("rope_theta", -5.0),
                  ("routed_scaling_factor", float("inf")), ("gate_temp", 0), ("hidden_size", True)][rng.integers(6)]
    cfg["text_config"][key] = value
    with open(path, "w") as f:
        json.dump(cfg, f)  # NaN / Infinity as Python's json writes them
    return ["config.json", key]


CASES = [
    truncated_shard, garbage_header, header_length_overflow, wrong_dtype_string, unknown_dtype_string, wrong_shape,
    missing_tensor, extra_tensor, corrupt_index_json, index_wrong_types, index_points_outside, nonfinite_weight,
    nan_fp8_weight, nan_scale, huge_scale, flipped_bit, shard_is_missing, config_float_invalid,
]
SEEDS = (0, 1)


def assert_names(message: str, expected: list[str]) -> None:
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case,seed", [(c, s) for c in CASES for s in SEEDS],
                         ids=[f"{c.__name__}-{s}" for c in CASES for s in SEEDS])
def test_the_damage_is_named_by_every_reader(good, tmp_path, case, seed, capsys):
    d = str(tmp_path / "ckpt")
    shutil.copytree(good, d)
    expected = case(d, np.random.default_rng(1000 * CASES.index(case) + seed))

    with pytest.raises(ValueError) as e:  # CheckpointError, or ConfigError for config.json
        load_checkpoint(d)
    assert type(e.value).__name__ in ("CheckpointError", "CheckpointFormatError", "ConfigError")
    assert_names(str(e.value), expected)

    with pytest.raises(ValueError) as e:
        LLM(d)
    assert type(e.value) is ValueError and str(e.value).startswith("model: ")
    assert_names(str(e.value), expected)

    report = verify_checkpoint(d)
    assert any(all(part in p for part in expected) for p in report.problems), report.problems
    assert main(["verify-checkpoint", d]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: " in out and expected[0] in out


def test_a_valid_checkpoint_loads_and_verifies(good, capsys):
    config, params = load_checkpoint(good)
    assert config.hidden_size == CFG.hidden_size and "mtp" in params
    report = verify_checkpoint(good)
    assert report.ok and report.tensors_checked == len(weight_map(good)), report.problems
    assert main(["verify-checkpoint", good]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: ")


def test_the_writer_records_every_file_in_the_manifest(good):
    with open(os.path.join(good, MANIFEST_FILE)) as f:
        files = json.load(f)["files"]
    assert sorted(files) == sorted(set(weight_map(good).values()) | {INDEX, "config.json"})
    assert all(len(digest) == 64 for digest in files.values())


def test_a_symlinked_shard_is_followed(good, tmp_path):
    """Documented: index entries may not leave the directory, but a shard that is a symlink (the
    Hugging Face cache layout: snapshots/<rev>/shard -> ../../blobs/<hash>) is read."""
    d = tmp_path / "snapshot"
    shutil.copytree(good, d)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shard = sorted(set(weight_map(d).values()))[0]
    os.replace(d / shard, blobs / shard)
    os.symlink(os.path.join("..", "blobs", shard), d / shard)
    assert verify_checkpoint(d).ok


# ---- the orbax marker ------------------------------------------------------------------------


MARKERS = [
    ("{", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"format_version": 1}', "quantized"),
    ('{"format_version": 2, "quantized": [], "config": {}}', "format_version"),
    ('{"format_version": 1, "quantized": "fp8", "config": {}}', "quantized"),
    ('{"format_version": 1, "quantized": [], "include_mtp": "yes", "config": {}}', "include_mtp"),
    ('{"format_version": 1, "quantized": [], "config": []}', "config"),
    ('{"format_version": 1, "quantized": [], "config": {"rms_norm_eps": -1}}', "rms_norm_eps"),
    ('{"format_version": 1, "quantized": [], "config": {"text_config": {"rope_theta": "abc"}}}', "rope_theta"),
]


@pytest.mark.parametrize("text,named", MARKERS)
def test_a_corrupt_orbax_marker_is_named(tmp_path, text, named, capsys):
    (tmp_path / MARKER).write_text(text)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert_names(str(e.value), [MARKER, named])
    report = verify_checkpoint(tmp_path)
    assert any(MARKER in p and named in p for p in report.problems), report.problems


def test_orbax_params_that_cannot_be_restored_are_named(tmp_path):
    marker = {"format_version": 1, "quantized": [], "include_mtp": False, "config": to_hf_config(CFG)}
    (tmp_path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert os.path.join(str(tmp_path), "params") in str(e.value)


# ---- random byte damage ----------------------------------------------------------------------


def test_random_byte_damage_is_always_a_named_error(good, tmp_path):
    """Seeded fuzz: 1-3 changed bytes in a JSON file (config, index, manifest) or a shard header.
    The manifest covers every file, so no damage may load; each error names the directory's file."""
    rng = np.random.default_rng(12)
    files = sorted(os.listdir(good))
    shards = [f for f in files if f.endswith(".safetensors")]
    for trial in range(40):
        d = str(tmp_path / f"fuzz{trial}")
        shutil.copytree(good, d)
        target = [*(f for f in files if f.endswith(".json")), *shards[:3]][rng.integers(len(files) - len(shards) + 3)]
        path = os.path.join(d, target)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        end = len(data) if target.endswith(".json") else 8 + int.from_bytes(data[:8], "little")
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(end)] ^= int(rng.integers(1, 256))
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ValueError) as e:
            load_checkpoint(d)
        assert d in str(e.value), (target, str(e.value))
        report = verify_checkpoint(d)
        assert not report.ok and all(d in p for p in report.problems), (target, report.problems)


def test_a_sharded_load_reads_slices_and_names_the_tensor_index(good, tmp_path):
    """Each device's slice is checked as it is read; the message gives the index in the tensor."""
    from deepinfer.sharding import make_mesh, mesh_placement

    d = str(tmp_path / "ckpt")
    shutil.copytree(good, d)
    drop_manifest(d)
    name = "embed.weight"
    path = os.path.join(d, weight_map(d)[name])
    entry = raw_header(path)[0][name]
    rows, cols = entry["shape"]
    assert entry["dtype"] == "BF16"
    poke(path, name, rows * cols - 2, np.array([np.nan], ml_dtypes.bfloat16).tobytes())
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, placement=mesh_placement(make_mesh("dp=1,cp=1,tp=8")))
    assert_names(str(e.value), [name, os.path.basename(path), f"first at index [{rows - 1}, {cols - 2}]"])
