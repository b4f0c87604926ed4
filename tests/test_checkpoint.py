"""Tests of deepinfer.model.checkpoint (official safetensors layout) and orbax_format (the
engine's fast-restart format) on the `tiny-v4.1` preset in float32.

The expected names, dtypes and shapes are derived here from the conventions of spec §5 (FP8
e4m3 dense weights with 32x32 UE8M0 block scales, MXFP4 experts as I8 with one scale per 32 along
K, Engram tables with 1x32 scales, BF16/F32 for the rest), independently of `param_specs`.
"""

import dataclasses
import json
import math
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from deepinfer.model import (
    CheckpointError, QuantWeight, convert_to_orbax, forward, init_params, load_checkpoint, load_config,
    write_checkpoint,
)
from deepinfer.ops import quant
from deepinfer.model.params import BF16, F32, FP4, FP8, FP8_ROWS, build_tree, param_specs, tree_get
from deepinfer.model.safetensors_io import SafetensorsFile, write_safetensors
from deepinfer.sharding import make_mesh, mesh_placement, param_sharding, params_shardings

INDEX = "model.safetensors.index.json"
CFG = load_config("tiny-v4.1", dtype="float32", fake_quant=False)
OVERRIDES = dict(dtype="float32", fake_quant=False)
D, F, H, HD = CFG.hidden_size, CFG.moe_intermediate_size, CFG.num_attention_heads, CFG.head_dim


def cdiv(a, b):
    return -(-a // b)


# ---- helpers -----------------------------------------------------------------------------


def read_index(directory) -> dict:
    with open(os.path.join(directory, INDEX)) as f:
        return json.load(f)


def write_index(directory, index) -> None:
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f)


def shard_of(directory, name) -> str:
    return os.path.join(directory, read_index(directory)["weight_map"][name])


def read_shard(path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    out = {n: np.array(f.get(n)) for n in f.names}
    f.close()
    return out


def rewrite_shard(path, tensors) -> None:
    write_safetensors(path, tensors, metadata={"format": "pt"})


def header_table(directory) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (safetensors dtype, shape, shard file) for every tensor of every shard."""
    out = {}
    for fn in sorted(os.listdir(directory)):
        if fn.endswith(".safetensors"):
            f = SafetensorsFile(os.path.join(directory, fn))
            for n in f.names:
                out[n] = (f.dtype_name(n), tuple(f.shape(n)), fn)
    return out


def leaves_equal(a, b) -> None:
    """Bit-identical pytrees (QuantWeight leaves compared through q and scale)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def host_quant_roundtrip(params) -> dict:
    """What the checkpoint stores, dequantized on the host with deepinfer.ops.quant."""
    def leaf(spec):
        a = np.asarray(tree_get(params, spec.path), np.float32)
        if spec.storage == FP8:
            q, s = quant.quantize_fp8_blocks(a, block=CFG.weight_block_size)
            return quant.dequantize_fp8_blocks(q, s, block=CFG.weight_block_size)
        if spec.storage == FP8_ROWS:
            q, s = quant.quantize_fp8_blocks(a, block=(1, 32))
            return quant.dequantize_fp8_blocks(q, s, block=(1, 32))
        if spec.storage == FP4:
            return np.stack([quant.dequantize_mxfp4(*quant.quantize_mxfp4(a[e], 32), 32) for e in range(a.shape[0])])
        if spec.storage == BF16:
            return a.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert spec.storage == F32
        return a

    return build_tree(CFG, leaf)


def one_device_mesh():
    return make_mesh("dp=1", devices=jax.devices()[:1])


def run(params):
    return np.asarray(forward(params, CFG, TOKENS))


TOKENS = np.random.default_rng(7).integers(3, CFG.vocab_size, (2, 72)).astype(np.int32)


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, params):
    d = tmp_path_factory.mktemp("official")
    write_checkpoint(params, CFG, d)
    return str(d)


@pytest.fixture(scope="module")
def loaded_q(ckpt):
    cfg, p = load_checkpoint(ckpt, **OVERRIDES)
    assert dataclasses.replace(cfg, name=CFG.name) == CFG
    return p


@pytest.fixture(scope="module")
def loaded_dq(ckpt):
    cfg, p = load_checkpoint(ckpt, dequantize=True, **OVERRIDES)
    assert dataclasses.replace(cfg, name=CFG.name) == CFG
    return p


@pytest.fixture(scope="module")
def logits_q(loaded_q):
    out = run(loaded_q)
    assert out.shape == (*TOKENS.shape, CFG.vocab_size) and np.all(np.isfinite(out))
    return out


@pytest.fixture
def broken(tmp_path, ckpt):
    """A private copy of the good checkpoint to damage."""
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    return str(d)


# ---- writing: layout, names, dtypes, shapes --------------------------------------------------


def test_write_load_write_is_byte_identical(ckpt, loaded_q, tmp_path):
    write_checkpoint(loaded_q, CFG, tmp_path / "again")
    names = sorted(os.listdir(ckpt))
    assert names == sorted(os.listdir(tmp_path / "again"))
    # embed, one per layer, head + norm, one per draft block (the official grouping, spec §5)
    assert sum(n.endswith(".safetensors") for n in names) == CFG.num_hidden_layers + 2 + CFG.num_nextn_predict_layers
    for fn in names:
        with open(os.path.join(ckpt, fn), "rb") as a, open(tmp_path / "again" / fn, "rb") as b:
            assert a.read() == b.read(), fn


def test_dequantized_load_requantizes_to_the_same_values(loaded_dq, tmp_path):
    write_checkpoint(loaded_dq, CFG, tmp_path / "dq")
    _, again = load_checkpoint(tmp_path / "dq", dequantize=True, **OVERRIDES)
    leaves_equal(loaded_dq, again)


def test_index_matches_shards(ckpt):
    index = read_index(ckpt)
    table = header_table(ckpt)
    assert set(index["weight_map"]) == set(table)
    for name, fn in index["weight_map"].items():
        assert table[name][2] == fn, name
    itemsize = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
    total = sum(math.prod(s) * itemsize[dt] for dt, s, _ in table.values())
    assert index["metadata"]["total_size"] == total
    # official grouping: embedding first, one shard per layer, head + norm, one per draft block
    files = sorted(set(index["weight_map"].values()))
    L = CFG.num_hidden_layers
    assert {n for n, v in index["weight_map"].items() if v == files[0]} == {"embed.weight"}
    assert {n for n, v in index["weight_map"].items() if v == files[L + 1]} == {"head.weight", "norm.weight"}
    for i in range(L):
        assert {v for n, v in index["weight_map"].items() if n.startswith(f"layers.{i}.")} == {files[i + 1]}
    for k in range(CFG.num_nextn_predict_layers):
        assert {v for n, v in index["weight_map"].items() if n.startswith(f"mtp.{k}.")} == {files[L + 2 + k]}
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["text_config"]["num_hidden_layers"] == CFG.num_hidden_layers


EXPECTED = {
    # name: (dtype, shape) by the §5 conventions at tiny widths
    "embed.weight": ("BF16", (CFG.vocab_size, D)),
    "head.weight": ("BF16", (CFG.vocab_size, D)),
    "norm.weight": ("BF16", (D,)),
    "layers.2.attn.wq_a.weight": ("F8_E4M3", (CFG.q_lora_rank, D)),
    "layers.2.attn.wq_a.scale": ("F8_E8M0", (cdiv(CFG.q_lora_rank, 32), cdiv(D, 32))),
    "layers.2.attn.wq_b.weight": ("F8_E4M3", (H * HD, CFG.q_lora_rank)),
    "layers.2.attn.wq_b.scale": ("F8_E8M0", (cdiv(H * HD, 32), cdiv(CFG.q_lora_rank, 32))),
    "layers.0.attn.wkv.weight": ("F8_E4M3", (HD, D)),
    "layers.0.attn.wo_a.weight": ("F8_E4M3", (CFG.o_groups * CFG.o_lora_rank, H * HD // CFG.o_groups)),
    "layers.0.attn.wo_a.scale": ("F8_E8M0", (cdiv(CFG.o_groups * CFG.o_lora_rank, 32), cdiv(H * HD // CFG.o_groups, 32))),
    "layers.0.attn.wo_b.weight": ("F8_E4M3", (D, CFG.o_groups * CFG.o_lora_rank)),
    "layers.0.attn.q_norm.weight": ("BF16", (CFG.q_lora_rank,)),
    "layers.0.attn.kv_norm.weight": ("BF16", (HD,)),
    "layers.0.attn.attn_sink": ("F32", (H,)),
    "layers.0.attn_norm.weight": ("BF16", (D,)),
    "layers.0.ffn_norm.weight": ("BF16", (D,)),
    "layers.0.hc_attn_fn": ("F32", ((2 + 4) * 4, 4 * D)),
    "layers.0.hc_attn_base": ("F32", (24,)),
    "layers.0.hc_attn_scale": ("F32", (3,)),
    "layers.9.hc_ffn_fn": ("F32", (24, 4 * D)),
    "layers.0.ffn.gate.weight": ("BF16", (CFG.n_routed_experts, D)),
    "layers.0.ffn.gate.bias": ("F32", (CFG.n_routed_experts,)),
    "layers.0.ffn.gate.bias_vl": ("F32", (CFG.n_routed_experts,)),
    "layers.0.ffn.experts.3.w1.weight": ("I8", (F, D // 2)),
    "layers.0.ffn.experts.3.w1.scale": ("F8_E8M0", (F, D // 32)),
    "layers.0.ffn.experts.7.w3.weight": ("I8", (F, D // 2)),
    "layers.9.ffn.experts.0.w2.weight": ("I8", (D, F // 2)),
    "layers.9.ffn.experts.0.w2.scale": ("F8_E8M0", (D, F // 32)),
    "layers.0.ffn.shared_experts.w1.weight": ("F8_E4M3", (F, D)),
    "layers.0.ffn.shared_experts.w1.scale": ("F8_E8M0", (cdiv(F, 32), cdiv(D, 32))),
    "layers.0.ffn.shared_experts.w2.scale": ("F8_E8M0", (cdiv(D, 32), cdiv(F, 32))),
    "layers.2.attn.compressor.wgate.weight": ("BF16", (HD, D)),
    "layers.4.attn.compressor.wgate.weight": ("BF16", (HD, D)),
    "layers.2.attn.compressor.wkv.weight": ("BF16", (HD, D)),
    "layers.5.attn.compressor.wkv.weight": ("BF16", (HD, D)),
    "layers.5.attn.compressor.norm.weight": ("BF16", (HD,)),
    "layers.5.attn.indexer.wk.weight": ("BF16", (CFG.index_head_dim, HD)),
    "layers.5.attn.indexer.k_norm.weight": ("BF16", (CFG.index_head_dim,)),
    "layers.7.attn.indexer.wq_b.weight": ("F8_E4M3", (CFG.index_n_heads * CFG.index_head_dim, CFG.q_lora_rank)),
    "layers.7.attn.indexer.wq_b.scale": ("F8_E8M0", (cdiv(CFG.index_n_heads * CFG.index_head_dim, 32),
                                                     cdiv(CFG.q_lora_rank, 32))),
    "layers.7.attn.indexer.weights_proj.weight": ("BF16", (CFG.index_n_heads, D)),
    "layers.1.engram.embed.weight": ("F8_E4M3", (CFG.engram_num_embeddings[0], CFG.engram_head_dim)),
    "layers.1.engram.embed.scale": ("F8_E8M0", (CFG.engram_num_embeddings[0], cdiv(CFG.engram_head_dim, 32))),
    "layers.4.engram.embed.weight": ("F8_E4M3", (CFG.engram_num_embeddings[1], CFG.engram_head_dim)),
    "layers.1.engram.wkv.weight": ("F8_E4M3", (5 * D, 24 // 8 * CFG.engram_n_heads * CFG.engram_head_dim)),
    "layers.1.engram.q_weight": ("BF16", (4, D)),
    "layers.1.engram.k_weight": ("BF16", (4, D)),
    # the DSpark drafter (spec §2.9, §5): backbone-like blocks with their own smaller MoE
    "mtp.0.main_proj.weight": ("F8_E4M3", (D, 3 * D)),
    "mtp.0.main_proj.scale": ("F8_E8M0", (cdiv(D, 32), cdiv(3 * D, 32))),
    "mtp.0.main_norm.weight": ("BF16", (D,)),
    "mtp.1.attn.wkv.weight": ("F8_E4M3", (HD, D)),
    "mtp.1.attn.attn_sink": ("F32", (H,)),
    "mtp.1.ffn.gate.weight": ("BF16", (CFG.dspark_n_routed_experts, D)),
    "mtp.1.ffn.experts.7.w2.weight": ("I8", (D, F // 2)),
    "mtp.2.norm.weight": ("BF16", (D,)),
    "mtp.2.markov_head.embed.weight": ("BF16", (CFG.vocab_size, CFG.dspark_markov_rank)),
    "mtp.2.markov_head.head.weight": ("BF16", (CFG.vocab_size, CFG.dspark_markov_rank)),
    "mtp.2.confidence_head.proj.weight": ("BF16", (1, D + CFG.dspark_markov_rank)),
}

ABSENT = [
    "layers.5.attn.compressor.wgate.weight",  # ratio-1 source: no gate
    "layers.3.attn.compressor.wkv.weight",  # reuse layer
    "layers.3.attn.indexer.wq_b.weight",
    "layers.7.attn.indexer.wk.weight",  # reindex layer: own query, shared keys
    "layers.7.attn.compressor.wkv.weight",
    "layers.0.engram.embed.weight",
    "layers.0.attn.sink",
    "layers.0.attn.attn_sink.weight",
    "layers.0.hc_attn_fn.weight",
    "layers.0.ffn.experts.8.w1.weight",
    "layers.0.ffn.experts.w1.weight",
    "layers.0.ffn.gate.bias.weight",
    "layers.0.attn.q_norm.scale",
    "layers.2.attn.compressor.wgate.scale",
    "layers.10.attn_norm.weight",
    "mtp.0.norm.weight",  # only the last draft block has the heads
    "mtp.1.main_proj.weight",  # only the first joins the target's streams
    "mtp.0.attn.compressor.wkv.weight",  # window-only blocks
    "mtp.0.ffn.experts.8.w1.weight",  # dspark_n_routed_experts = 8
]


@pytest.fixture(scope="module")
def table(ckpt):
    return header_table(ckpt)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_tensor_format(table, name):
    assert name in table, name
    assert table[name][:2] == EXPECTED[name]


@pytest.mark.parametrize("name", ABSENT)
def test_tensor_absent(ckpt, name):
    assert name not in read_index(ckpt)["weight_map"]


def test_every_tensor_follows_the_conventions(table):
    """Independent rules of §5 applied to every written tensor."""
    fp8 = re.compile(r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                     r"|engram\.(embed|wkv)|main_proj)\.weight$")
    fp4 = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
    f32 = re.compile(r"(layers|mtp)\.\d+\.(attn\.attn_sink|hc_(attn|ffn)_(fn|base|scale)|ffn\.gate\.bias(_vl)?)$")
    for name, (dtype, shape, _) in table.items():
        if name.endswith(".scale"):
            base = name[: -len(".scale")] + ".weight"
            assert dtype == "F8_E8M0" and base in table, name
            wdt, wshape, _ = table[base]
            if wdt == "I8":
                assert shape == (wshape[0], 2 * wshape[1] // 32), name
            elif ".engram.embed." in name:
                assert shape == (wshape[0], cdiv(wshape[1], 32)), name
            else:
                assert wdt == "F8_E4M3" and shape == (cdiv(wshape[0], 32), cdiv(wshape[1], 32)), name
        elif fp8.match(name):
            assert dtype == "F8_E4M3", name
            assert name[: -len(".weight")] + ".scale" in table, name
        elif fp4.match(name):
            assert dtype == "I8", name
        elif f32.match(name):
            assert dtype == "F32", name
        else:
            # §2.7 names the Engram gate vectors `q_weight` / `k_weight` (no `.weight` suffix)
            assert dtype == "BF16", name
            assert name.endswith(".weight") or re.fullmatch(r"layers\.\d+\.engram\.[qk]_weight", name), name
    # counts: every layer has all experts, 2 tensors each of 3 projections
    n_expert_tensors = sum(bool(fp4.match(n)) for n in table)
    assert n_expert_tensors == (CFG.num_hidden_layers * CFG.n_routed_experts
                                + CFG.num_nextn_predict_layers * CFG.dspark_n_routed_experts) * 3
    wgate = sorted(int(n.split(".")[1]) for n in table if n.endswith("compressor.wgate.weight"))
    assert wgate == [s for s in CFG.kv_source_layer_ids if CFG.compress_ratios[s] == 2] == [2, 4]
    wk = sorted(int(n.split(".")[1]) for n in table if n.endswith("indexer.wk.weight"))
    assert wk == list(CFG.kv_source_layer_ids)
    wq = sorted(int(n.split(".")[1]) for n in table if n.endswith("indexer.wq_b.weight"))
    assert wq == list(CFG.index_source_layer_ids)
    engram = sorted(int(n.split(".")[1]) for n in table if n.endswith("engram.embed.weight"))
    assert engram == list(CFG.engram_layer_ids)


def test_fp4_expert_bytes_decode_to_the_written_values(ckpt, params):
    """Low nibble = even k, scale per 32 along K (checked through quant's decoder)."""
    f = SafetensorsFile(shard_of(ckpt, "layers.0.ffn.experts.3.w1.weight"))
    q, s = f.get("layers.0.ffn.experts.3.w1.weight"), f.get("layers.0.ffn.experts.3.w1.scale")
    w = np.asarray(params["layers"][0]["ffn"]["experts"]["w1"][3])
    deq = quant.dequantize_mxfp4(q, s, 32)
    codes = np.asarray(q).view(np.uint8)
    # even k from the low nibble
    low = quant.E2M1_VALUES[codes & 0xF] * quant.e8m0_to_float32(s, np)[:, np.arange(0, w.shape[1], 2) // 32]
    np.testing.assert_array_equal(deq[:, 0::2], low)
    # per 32-block: scale < 2 * amax / 6 and the widest e2m1 gap is 2, so |error| < amax / 3
    amax = np.abs(w).reshape(w.shape[0], -1, 32).max(-1)
    err = np.abs(deq - w).reshape(w.shape[0], -1, 32).max(-1)
    assert np.all(err < amax / 3)


# ---- reading: values and logits ----------------------------------------------------------


def test_loaded_leaves_kind(loaded_q, loaded_dq):
    for spec in param_specs(CFG):
        q, dq = tree_get(loaded_q, spec.path), tree_get(loaded_dq, spec.path)
        assert not isinstance(dq, QuantWeight)
        if spec.storage in (FP8, FP8_ROWS, FP4):
            assert isinstance(q, QuantWeight) and q.kind == spec.storage, spec.name
            assert q.q.dtype == (np.int8 if spec.storage == FP4 else ml_dtypes.float8_e4m3fn)
            assert q.scale.dtype == ml_dtypes.float8_e8m0fnu
            assert dq.dtype == np.float32 and dq.shape == spec.shape
        else:
            assert not isinstance(q, QuantWeight) and q.dtype == np.float32, spec.name


def test_dequantized_load_equals_host_quant_roundtrip(params, loaded_dq):
    leaves_equal(loaded_dq, host_quant_roundtrip(params))


def test_quantized_and_dequantized_loads_give_identical_logits(logits_q, loaded_dq):
    np.testing.assert_array_equal(run(loaded_dq), logits_q)


def test_logits_equal_host_quant_roundtrip_of_initial_params(params, logits_q):
    host = jax.device_put(host_quant_roundtrip(params), params_shardings(CFG, one_device_mesh()))
    np.testing.assert_array_equal(run(host), logits_q)


def test_a_checkpoint_without_the_drafter_loads_the_backbone(broken, loaded_q):
    """HF conversions drop `mtp.*`: the params then have no drafter and the rest is unchanged."""
    index = read_index(broken)
    drafter_shards = {fn for n, fn in index["weight_map"].items() if n.startswith("mtp.")}
    index["weight_map"] = {n: fn for n, fn in index["weight_map"].items() if not n.startswith("mtp.")}
    write_index(broken, index)
    for fn in drafter_shards:
        os.remove(os.path.join(broken, fn))
    os.remove(os.path.join(broken, "deepinfer-manifest.json"))  # an HF conversion has no manifest of ours
    _, p = load_checkpoint(broken, **OVERRIDES)
    assert "mtp" not in p and "mtp" in loaded_q
    leaves_equal(p, {k: v for k, v in loaded_q.items() if k != "mtp"})


def test_a_malformed_drafter_tensor_is_named(broken):
    path = shard_of(broken, "mtp.0.main_proj.weight")
    tensors = read_shard(path)
    tensors["mtp.0.main_proj.weight"] = tensors["mtp.0.main_proj.weight"][:, :D]
    rewrite_shard(path, tensors)
    with pytest.raises(CheckpointError, match=r"mtp\.0\.main_proj\.weight.*expected F8_E4M3"):
        load_checkpoint(broken, **OVERRIDES)


def test_loaded_config_keeps_release_fields_and_applies_overrides(ckpt):
    cfg, _ = load_checkpoint(ckpt, dequantize=True, dtype="float32", fake_quant=True)
    assert cfg.fake_quant is True and cfg.dtype == "float32"
    assert dataclasses.replace(cfg, name=CFG.name, fake_quant=False) == CFG


# ---- reading: errors name the tensor and the file ---------------------------------------------


def load_error(directory) -> str:
    with pytest.raises(ValueError) as e:
        load_checkpoint(directory, **OVERRIDES)
    return str(e.value)


def test_missing_tensor_in_shard(broken):
    name = "layers.3.attn.wkv.scale"
    path = shard_of(broken, name)
    tensors = read_shard(path)
    del tensors[name]
    rewrite_shard(path, tensors)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    assert name in str(e.value) and os.path.basename(path) in str(e.value)


def test_missing_tensor_in_shard_and_index(broken):
    name = "layers.6.ffn.experts.5.w2.weight"
    path = shard_of(broken, name)
    tensors = read_shard(path)
    del tensors[name]
    rewrite_shard(path, tensors)
    index = read_index(broken)
    del index["weight_map"][name]
    write_index(broken, index)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    assert name in str(e.value) and "missing" in str(e.value) and broken in str(e.value)


def test_unexpected_tensor(broken):
    name = "layers.3.attn.compressor.wgate.weight"  # exists only on sources, not on reuse layer 3
    path = shard_of(broken, "layers.3.attn.wkv.weight")
    tensors = read_shard(path)
    tensors[name] = np.zeros((HD, D), ml_dtypes.bfloat16)
    rewrite_shard(path, tensors)
    index = read_index(broken)
    index["weight_map"][name] = os.path.basename(path)
    write_index(broken, index)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    assert name in str(e.value) and os.path.basename(path) in str(e.value)


@pytest.mark.parametrize("name,replacement,found", [
    ("layers.0.attn.attn_sink", lambda a: a.astype(ml_dtypes.bfloat16), "BF16"),
    ("layers.2.attn.wq_a.weight", lambda a: a.astype(np.float32).astype(ml_dtypes.bfloat16), "BF16"),
    ("layers.2.attn.wq_a.scale", lambda a: a.view(np.uint8), "U8"),
    ("layers.4.ffn.experts.1.w1.weight", lambda a: a.view(np.uint8), "U8"),
    ("embed.weight", lambda a: a.astype(np.float32), "F32"),
])
def test_wrong_dtype(broken, name, replacement, found):
    path = shard_of(broken, name)
    tensors = read_shard(path)
    tensors[name] = replacement(tensors[name])
    rewrite_shard(path, tensors)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    msg = str(e.value)
    assert name in msg and os.path.basename(path) in msg and found in msg


@pytest.mark.parametrize("name,shape", [
    ("layers.2.attn.wq_a.scale", (2, 3)),
    ("layers.0.ffn.experts.3.w1.weight", (F, D)),  # one byte per value instead of two nibbles
    ("layers.5.attn.indexer.wk.weight", (HD, CFG.index_head_dim)),  # transposed
    ("norm.weight", (D, 1)),
])
def test_wrong_shape(broken, name, shape):
    path = shard_of(broken, name)
    tensors = read_shard(path)
    tensors[name] = np.zeros(shape, tensors[name].dtype)
    rewrite_shard(path, tensors)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    msg = str(e.value)
    assert name in msg and os.path.basename(path) in msg and str(list(shape)) in msg


def test_truncated_shard(broken):
    path = shard_of(broken, "layers.4.attn.wq_a.weight")
    with open(path, "rb") as f:  # the tensor stored last, read from the raw header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 7)
    msg = load_error(broken)
    assert os.path.basename(path) in msg and last in msg


def test_corrupt_header(broken):
    path = shard_of(broken, "layers.4.attn.wq_a.weight")
    with open(path, "r+b") as f:
        f.seek(8 + 20)
        f.write(b"\xff\x00{{")
    msg = load_error(broken)
    assert os.path.basename(path) in msg and "header" in msg


def test_header_length_corrupt(broken):
    path = shard_of(broken, "layers.8.attn.wq_a.weight")
    with open(path, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))
    msg = load_error(broken)
    assert os.path.basename(path) in msg


def test_index_points_to_missing_shard(broken):
    index = read_index(broken)
    name = "layers.9.attn.wo_b.weight"
    index["weight_map"][name] = "model-00099-of-00012.safetensors"
    write_index(broken, index)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    assert name in str(e.value) and "model-00099-of-00012.safetensors" in str(e.value)


def test_deleted_shard(broken):
    path = shard_of(broken, "head.weight")
    os.remove(path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(broken, **OVERRIDES)
    assert os.path.basename(path) in str(e.value) and ("head.weight" in str(e.value) or "norm.weight" in str(e.value))


def test_invalid_index(broken):
    with open(os.path.join(broken, INDEX), "w") as f:
        f.write('{"weight_map": ')
    with pytest.raises(CheckpointError, match=INDEX):
        load_checkpoint(broken, **OVERRIDES)


def test_config_mismatch_is_reported(broken):
    # a checkpoint loaded with a config that expects more experts names the first missing tensor
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.8\.w1"):
        load_checkpoint(broken, n_routed_experts=16, **OVERRIDES)


# ---- orbax fast-restart format ------------------------------------------------------------------


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory, ckpt):
    d = tmp_path_factory.mktemp("orbax") / "tiny"
    cfg = convert_to_orbax(ckpt, d, placement=mesh_placement(make_mesh("dp=8")))  # saved from an 8-way expert-sharded load
    assert cfg.num_hidden_layers == CFG.num_hidden_layers
    return str(d)


def check_target_shardings(params, mesh):
    """Every leaf sits on `mesh` with the sharding the rules give for that mesh."""
    for spec in param_specs(CFG):
        leaf = tree_get(params, spec.path)
        quantized = spec.storage in (FP8, FP8_ROWS, FP4)
        want = param_sharding(spec, mesh, CFG, quantized=quantized)
        pairs = [(leaf.q, want.q), (leaf.scale, want.scale)] if quantized else [(leaf, want)]
        if quantized:
            assert isinstance(leaf, QuantWeight) and leaf.kind == spec.storage, spec.name
        for arr, w in pairs:
            assert arr.sharding.mesh.shape == mesh.shape, spec.name
            assert set(arr.sharding.device_set) == set(mesh.devices.flat), spec.name
            assert arr.sharding.is_equivalent_to(w, arr.ndim), (spec.name, arr.sharding, w)


def test_orbax_restore_on_single_device(orbax_dir, loaded_q, logits_q):
    mesh = one_device_mesh()
    cfg, p = load_checkpoint(orbax_dir, placement=mesh_placement(mesh), **OVERRIDES)
    assert dataclasses.replace(cfg, name=CFG.name) == CFG
    check_target_shardings(p, mesh)
    leaves_equal(p, loaded_q)
    np.testing.assert_array_equal(run(p), logits_q)


def test_orbax_restore_default_placement_is_the_first_device(orbax_dir, loaded_q):
    _, p = load_checkpoint(orbax_dir, **OVERRIDES)
    for leaf in jax.tree.leaves(p):
        assert leaf.sharding.device_set == {jax.local_devices()[0]}
    leaves_equal(p, loaded_q)


def test_orbax_restore_on_other_mesh_leaves(orbax_dir, loaded_q):
    mesh = make_mesh("dp=2,cp=2,tp=2")
    _, p = load_checkpoint(orbax_dir, placement=mesh_placement(mesh), **OVERRIDES)
    check_target_shardings(p, mesh)
    leaves_equal(p, loaded_q)
    w1 = p["layers"][0]["ffn"]["experts"]["w1"]
    assert isinstance(w1, QuantWeight)
    assert tuple(w1.q.sharding.spec)[0] == ("dp", "cp", "tp")
    assert {s.data.shape for s in w1.q.addressable_shards} == {(1, F, D // 2)}
    assert tuple(p["embed"].sharding.spec)[0] == "tp"


@pytest.mark.slow
def test_orbax_restore_on_other_mesh_logits(orbax_dir, logits_q):
    _, p = load_checkpoint(orbax_dir, placement=mesh_placement(make_mesh("dp=2,cp=2,tp=2")), **OVERRIDES)
    # experts now split 8 ways: the fp32 sum over experts runs in another order (see test_sharding)
    out = run(p)
    assert float(np.abs(out - logits_q).max()) <= 1e-5 * max(1.0, float(np.abs(logits_q).max()))


def test_orbax_marker_records_quantized_storage(orbax_dir):
    with open(os.path.join(orbax_dir, "deepinfer_orbax.json")) as f:
        marker = json.load(f)
    assert set(marker["quantized"]) == {FP8, FP8_ROWS, FP4}
    assert marker["config"]["text_config"]["n_routed_experts"] == CFG.n_routed_experts


def test_orbax_restore_dequantized(orbax_dir, loaded_dq):
    """`dequantize=True` is honoured for orbax checkpoints too: dense leaves, dense shardings,
    and the same values as the dequantized load of the official checkpoint."""
    mesh = make_mesh("dp=2,cp=2,tp=2")
    _, p = load_checkpoint(orbax_dir, placement=mesh_placement(mesh), dequantize=True, **OVERRIDES)
    for spec in param_specs(CFG):
        leaf = tree_get(p, spec.path)
        assert not isinstance(leaf, QuantWeight), spec.name
        assert leaf.sharding.is_equivalent_to(param_sharding(spec, mesh, CFG), leaf.ndim), spec.name
    leaves_equal(p, loaded_dq)
