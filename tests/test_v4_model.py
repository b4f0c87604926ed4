"""DeepSeek-V4(-Flash) model checks against the spec (shared/spec/model-v4-flash.md) and against the
independent float64 numpy reference `tests/reference/v4_reference.py`:

(a) the `deepseek-v4-flash` preset and both official config files (§1.1), cache size (§2.9);
(b) the tiny-v4 forward (real vocabulary, real HCA ratio 128, long prompt) vs the reference,
    with QAT fake-quant off and on;
(c) the MTP block (§4) on the model's own final streams;
(d) the official checkpoint layout (§1.4) for tiny-v4 incl. MTP, round trip byte-identical;
(e) the V4 QAT pieces (FP8 on the non-rope KV dims per 64; Hadamard + FP4 for the indexer).

Run with `-s` to print the measured differences.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_checkpoint, load_config, qat, write_checkpoint
from deepinfer.model.checkpoint import official_dense_tensors
from deepinfer.model.config import PRESETS
from deepinfer.model.forward import mtp_logits
from deepinfer.model.safetensors_io import SafetensorsFile
from tests import qat_sites
from tests.argmax_check import assert_argmax_agrees
from tests.reference import v4_reference as R4

FLASH = "deepseek-v4-flash"
MEASURED: dict[str, float] = {}


def _rel(name: str, ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    assert np.isfinite(ours).all() and np.isfinite(ref).all(), name
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    MEASURED[name] = max(MEASURED.get(name, 0.0), err)
    return err


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if MEASURED:
        print("\nV4 max |ours - ref| / max |ref|:")
        for name, err in MEASURED.items():
            print(f"  {name:<34} {err:.2e}")


# =============================================================================================
# (a) configuration (§1.1) and cache size (§2.9)
# =============================================================================================

FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)

# §1.1, the HF config.json of DeepSeek-V4-Flash (every key)
HF_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "tie_word_embeddings": False,
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_nextn_predict_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "attention_bias": False, "attention_dropout": 0.0,
    "sliding_window": 128, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "compress_ratios": list(FLASH_RATIOS),
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 1,
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}

# §1.1, REF's flat inference/config.json (norm_eps and hc_eps come from the ModelArgs defaults)
FLAT_CONFIG = {
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3, "n_heads": 64,
    "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
    "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": "fp4", "compress_rope_theta": 160000, "compress_ratios": list(FLASH_RATIOS),
}

# (field, value) of the §1.1 table
FLASH_VALUES = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43,
    num_nextn_predict_layers=1, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
    o_groups=8, o_lora_rank=1024, sliding_window=128, max_position_embeddings=1048576,
    compress_ratios=FLASH_RATIOS, index_n_heads=64, index_head_dim=128, index_topk=512,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2048,
    num_hash_layers=3, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    swiglu_limit=10.0, rms_norm_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0,
    rope_theta=10000.0, compress_rope_theta=160000.0, weight_block_size=(128, 128), expert_dtype="fp4",
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)


def _check_flash_values(config) -> None:
    for field, value in FLASH_VALUES.items():
        got = getattr(config, field)
        if isinstance(value, tuple):
            got = tuple(got)
        assert got == value, f"{field}: {got!r} != {value!r}"
    assert config.is_v4


def test_flash_preset_matches_spec_table():
    config = PRESETS[FLASH]
    _check_flash_values(config)
    assert len(config.compress_ratios) == 44
    kinds = [config.layer_kind(i) for i in range(43)]
    assert kinds[:2] == ["swa", "swa"]
    assert kinds.count("csa") == 21 and kinds.count("hca") == 20 and kinds.count("swa") == 2
    assert all(kinds[i] == ("csa" if i % 2 == 0 else "hca") for i in range(2, 43))
    assert config.compress_ratios[43] == 0  # the MTP block: window only
    assert [config.is_hash_layer(i) for i in range(5)] == [True, True, True, False, False]


def test_flash_cache_bytes_per_token():
    # §2.9: CSA 512*2/4 + 128*2/4 = 320 B, HCA 512*2/128 = 8 B; 21*320 + 20*8
    assert PRESETS[FLASH].global_cache_bytes_per_token() == 21 * 320 + 20 * 8 == 6880


@pytest.mark.parametrize("layout", ["hf", "flat"])
def test_official_config_files_read_as_the_preset(tmp_path, layout):
    if layout == "hf":
        path = tmp_path / "config.json"
        path.write_text(json.dumps(HF_CONFIG))
    else:
        (tmp_path / "inference").mkdir()
        path = tmp_path / "inference" / "config.json"
        path.write_text(json.dumps(FLAT_CONFIG))
    for source in (path, tmp_path):  # the file itself, and its checkpoint directory
        config = load_config(source)
        _check_flash_values(config)
        assert dataclasses.replace(config, name=FLASH) == PRESETS[FLASH]


# =============================================================================================
# shared fixtures: tiny-v4 in float32 and its float64 weights
# =============================================================================================

LONG_T = 400  # > 3 HCA rows (ratio 128), 100 CSA rows (> index_topk 32), > window 128


def _prompt(n: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(3, 128000, n)
    ids[0] = 0
    return ids


@pytest.fixture(scope="module")
def tiny():
    config = load_config("tiny-v4", fake_quant=False, dtype="float32")
    params = init_params(config, seed=3)
    return config, params, official_dense_tensors(params, config)


@pytest.fixture(scope="module")
def long_run(tiny):
    """The JAX forward (logits and final streams) and the reference on one long prompt."""
    config, params, weights = tiny
    ids = _prompt(LONG_T, seed=11)
    logits, streams = forward(params, config, ids, return_streams=True)
    ref_logits, ref_streams = R4.reference_forward_v4(weights, config, ids, return_streams=True)
    return ids, np.asarray(logits, np.float64), np.asarray(streams, np.float64), ref_logits, ref_streams


def test_tiny_v4_exercises_every_v4_mechanism(tiny):
    config, params, weights = tiny
    assert config.vocab_size == 129280 and weights["embed.weight"].shape[0] == 129280
    kinds = [config.layer_kind(i) for i in range(config.num_hidden_layers)]
    assert {"swa", "csa", "hca"} <= set(kinds) and 128 in config.compress_ratios
    assert LONG_T // 128 >= 3 and LONG_T // 4 > config.index_topk and LONG_T > config.sliding_window
    assert config.num_hash_layers >= 1 and "tid2eid" in params["layers"][0]["ffn"]["gate"]
    assert "mtp" in params


# =============================================================================================
# (b) forward vs the float64 reference
# =============================================================================================


def test_forward_matches_reference(long_run):
    _, ours, _, ref, _ = long_run
    err = _rel("logits (T=400, QAT off)", ours, ref)
    assert err <= 1e-4, err
    assert_argmax_agrees(ours, ref, 1e-4 * np.abs(ref).max())


def test_final_streams_match_reference(long_run):
    _, _, streams, _, ref_streams = long_run
    assert _rel("final streams (T=400)", streams, ref_streams) <= 1e-4


QAT_CASES = {
    # case: (config changes, prompt length)
    # The preset: head_dim - rope = 96 is not a multiple of 64, so the KV FP8 cannot block (the
    # quantizer leaves such shapes alone, as the reference's does) and only the indexer's
    # Hadamard + FP4 acts; 160 tokens -> 40 CSA rows > index_topk = 32, so it changes selections.
    "tiny-v4": (dict(), 160),
    # nope = 128 (two FP8 blocks of 64) and a top-k far below the rows: every QAT site acts.
    "tiny-v4-hd160-topk2": (dict(head_dim=160, index_topk=2), 48),
}


@pytest.fixture(scope="module")
def qat_models(tiny):
    """Per QAT case: (config with fake-quant off, params, official weights)."""
    base, params, weights = tiny
    models = {}
    for case, (changes, _) in QAT_CASES.items():
        if changes:
            config = dataclasses.replace(base, **changes)
            p = init_params(config, seed=4)
            models[case] = (config, p, official_dense_tensors(p, config))
        else:
            models[case] = (base, params, weights)
    return models


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("case", list(QAT_CASES))
def test_forward_matches_reference_with_fake_quant(qat_models, case, seed):
    """QAT on, ordinary seeded prompts. A value that fp32 and fp64 put on different sides of an
    FP8/FP4 rounding boundary would move every later logit by up to 0.3 of their scale, and which
    values do depends on the CPU and XLA's fusion; so the reference adopts the model's checked
    quantization decisions (tests/qat_sites.py: bit-exact quantizers, site inputs within 1e-3,
    few flips) and the logits then agree as with QAT off. A wrong QAT site or block size moves
    the logits by 0.1-0.6 of their scale."""
    base, params, weights = qat_models[case]
    config = dataclasses.replace(base, fake_quant=True)
    ids = _prompt(QAT_CASES[case][1], seed=seed)
    ours, sites = qat_sites.record_forward(params, config, ids)
    sites.check_quantizers()
    with qat_sites.adopting(sites) as found:
        ref = R4.reference_forward_v4(weights, config, ids, fake_quant=True)
    found.check()
    err = _rel(f"logits QAT on ({case})", ours, ref)
    assert err <= 1e-4, err
    plain = np.asarray(forward(params, base, ids), np.float64)
    assert np.abs(plain - ref).max() > 100 * np.abs(ours - ref).max()  # the switch matters
    if QAT_CASES[case][0]:  # the KV FP8 alone also matters here (selecting every row hides the indexer)
        select_all = dataclasses.replace(config, index_topk=10**6)
        kv_only = R4.reference_forward_v4(weights, select_all, ids, fake_quant=True)
        no_qat = R4.reference_forward_v4(weights, select_all, ids, fake_quant=False)
        assert np.abs(kv_only - no_qat).max() > 1e-2 * np.abs(ref).max()


# =============================================================================================
# (c) MTP
# =============================================================================================


def test_mtp_matches_reference(tiny, long_run):
    config, params, weights = tiny
    ids, _, streams, _, _ = long_run
    next_ids = np.concatenate([ids[1:], [1]])  # t_{i+1}; the last position gets EOS
    ours = mtp_logits(params, config, jnp.asarray(streams[None], jnp.float32),
                      jnp.asarray(next_ids[None], jnp.int32))
    ours = np.asarray(ours[0], np.float64)
    ref = R4.reference_mtp_v4(weights, config, streams, next_ids)
    err = _rel("MTP logits (T=400)", ours, ref)
    assert err <= 1e-4, err
    assert_argmax_agrees(ours, ref, 1e-4 * np.abs(ref).max())


# =============================================================================================
# (d) official checkpoint layout (§1.4) and round trip
# =============================================================================================


def _headers(directory) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out, files = {}, {}
    for name, filename in weight_map.items():
        if filename not in files:
            files[filename] = SafetensorsFile(os.path.join(directory, filename))
        out[name] = (files[filename].dtype_name(name), tuple(files[filename].shape(name)))
    for f in files.values():
        f.close()
    return out


@pytest.fixture(scope="module")
def checkpoint_dirs(tiny, tmp_path_factory):
    config, params, _ = tiny
    first = tmp_path_factory.mktemp("v4_ckpt_a")
    write_checkpoint(params, config, first)
    loaded_config, loaded = load_checkpoint(first, fake_quant=False, dtype="float32")
    second = tmp_path_factory.mktemp("v4_ckpt_b")
    write_checkpoint(loaded, loaded_config, second)
    return first, second, loaded_config, loaded


def test_checkpoint_round_trip_is_byte_identical(checkpoint_dirs, tiny):
    first, second, loaded_config, loaded = checkpoint_dirs
    config, params, _ = tiny
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    assert any(n.endswith(".safetensors") for n in names)
    match, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    assert dataclasses.replace(loaded_config, name=config.name) == config
    assert "mtp" in loaded
    np.testing.assert_array_equal(np.asarray(loaded["layers"][0]["ffn"]["gate"]["tid2eid"]),
                                  np.asarray(params["layers"][0]["ffn"]["gate"]["tid2eid"]))


def test_checkpoint_tensor_formats(checkpoint_dirs, tiny):
    config, _, _ = tiny
    first = checkpoint_dirs[0]
    h = _headers(first)
    k, E, D, F = config.num_experts_per_tok, config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    hd, di, hc = config.head_dim, config.index_head_dim, config.hc_mult
    expected = {
        "layers.0.ffn.gate.tid2eid": ("I64", (129280, k)),
        "layers.1.ffn.gate.tid2eid": ("I64", (129280, k)),
        "layers.2.attn.compressor.ape": ("F32", (4, 2 * hd)),
        "layers.2.attn.compressor.wkv.weight": ("BF16", (2 * hd, D)),
        "layers.2.attn.compressor.wgate.weight": ("BF16", (2 * hd, D)),
        "layers.2.attn.compressor.norm.weight": ("BF16", (hd,)),
        "layers.2.attn.indexer.compressor.wkv.weight": ("BF16", (2 * di, D)),
        "layers.2.attn.indexer.compressor.ape": ("F32", (4, 2 * di)),
        "layers.2.attn.indexer.compressor.norm.weight": ("BF16", (di,)),
        "layers.2.attn.indexer.weights_proj.weight": ("BF16", (config.index_n_heads, D)),
        "layers.2.attn.indexer.wq_b.weight": ("F8_E4M3", (config.index_n_heads * di, config.q_lora_rank)),
        "layers.2.ffn.gate.bias": ("F32", (E,)),
        "layers.3.attn.compressor.ape": ("F32", (128, hd)),
        "layers.3.attn.compressor.wkv.weight": ("BF16", (hd, D)),
        "layers.0.attn.attn_sink": ("F32", (config.num_attention_heads,)),
        "layers.0.hc_attn_fn": ("F32", ((2 + hc) * hc, hc * D)),
        "layers.0.ffn.experts.0.w1.weight": ("I8", (F, D // 2)),
        "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", (F, D // 32)),
        "layers.0.ffn.experts.7.w2.weight": ("I8", (D, F // 2)),
        "hc_head_fn": ("F32", (hc, hc * D)),
        "hc_head_base": ("F32", (hc,)),
        "hc_head_scale": ("F32", (1,)),
        "embed.weight": ("BF16", (129280, D)),
        "head.weight": ("BF16", (129280, D)),
        "mtp.0.e_proj.weight": ("F8_E4M3", (D, D)),
        "mtp.0.e_proj.scale": ("F8_E8M0", (1, 1)),
        "mtp.0.h_proj.weight": ("F8_E4M3", (D, D)),
        "mtp.0.enorm.weight": ("BF16", (D,)),
        "mtp.0.hnorm.weight": ("BF16", (D,)),
        "mtp.0.norm.weight": ("BF16", (D,)),
        "mtp.0.hc_head_fn": ("F32", (hc, hc * D)),
        "mtp.0.ffn.gate.bias": ("F32", (E,)),
        "mtp.0.attn.wkv.weight": ("F8_E4M3", (hd, D)),
    }
    for name, want in expected.items():
        assert h.get(name) == want, f"{name}: {h.get(name)} != {want}"
    # no bias on hash layers, no tid2eid elsewhere; the MTP block has no compressor / indexer
    for name in h:
        if name.endswith("gate.bias"):
            assert not name.startswith(("layers.0.", "layers.1.")), name
        if name.endswith("tid2eid"):
            assert name.split(".")[:2] in (["layers", "0"], ["layers", "1"]), name
        assert not (name.startswith("mtp.") and (".compressor." in name or ".indexer." in name)), name
        assert not name.startswith("model."), name
    assert not any(n.startswith("layers.0.attn.compressor") or n.startswith("layers.1.attn.compressor") for n in h)
    # every FP8 weight has an E8M0 scale of [ceil(out/128), ceil(in/128)]
    fp8 = [n for n, (dt, _) in h.items() if dt == "F8_E4M3"]
    assert len(fp8) > 20
    for name in fp8:
        out_dim, in_dim = h[name][1]
        scale = name.removesuffix(".weight") + ".scale"
        assert h.get(scale) == ("F8_E8M0", (math.ceil(out_dim / 128), math.ceil(in_dim / 128))), (name, h.get(scale))


def test_checkpoint_without_mtp_loads_without_mtp_block(tiny, tmp_path):
    config, params, _ = tiny
    backbone = {k: v for k, v in params.items() if k != "mtp"}
    write_checkpoint(backbone, config, tmp_path)
    assert not any(name.startswith("mtp.") for name in _headers(tmp_path))
    loaded_config, loaded = load_checkpoint(tmp_path, fake_quant=False, dtype="float32")
    assert "mtp" not in loaded
    assert loaded_config.num_nextn_predict_layers == config.num_nextn_predict_layers
    assert set(loaded) == set(backbone)


# =============================================================================================
# (e) QAT pieces
# =============================================================================================


@pytest.mark.parametrize("preset", [FLASH, "tiny-v4-hd160"])
def test_window_kv_fake_quant_is_fp8_per_64_on_nope_only(preset):
    if preset == FLASH:
        config = load_config(FLASH, fake_quant=True)
    else:
        config = dataclasses.replace(load_config("tiny-v4"), head_dim=160, fake_quant=True)
    hd, rope = config.head_dim, config.qk_rope_head_dim
    nope = hd - rope
    assert nope % 64 == 0 and nope // 64 >= 2
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 37, hd)) * np.exp(rng.uniform(-4, 4, (3, 37, 1)))).astype(np.float32)
    x[0, 0, :nope] *= 1e-6  # blocks under the amax floor
    x[1, 1, 64:128] *= 1e3  # one large block must not change its neighbours' scales
    out = np.asarray(qat.window_kv(jnp.asarray(x), config))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.astype(np.float64), R4.kv_fake_quant(x, config))
    np.testing.assert_array_equal(out[..., nope:], x[..., nope:])  # rope dims untouched
    assert (out[..., :nope] != x[..., :nope]).mean() > 0.5  # the nope dims are quantized
    # per-64 blocking: scaling one block by 2^k scales only that block's output, exactly
    y = x.copy()
    y[..., 64:128] *= 2.0**5
    out_y = np.asarray(qat.window_kv(jnp.asarray(y), config))
    np.testing.assert_array_equal(out_y[..., 64:128], out[..., 64:128] * 2.0**5)
    np.testing.assert_array_equal(np.delete(out_y, np.s_[64:128], axis=-1), np.delete(out, np.s_[64:128], axis=-1))
    # compressed KV rows use the same quantizer
    np.testing.assert_array_equal(np.asarray(qat.compressed_kv(jnp.asarray(x), config)), out)
    # off switch
    plain = dataclasses.replace(config, fake_quant=False)
    np.testing.assert_array_equal(np.asarray(qat.window_kv(jnp.asarray(x), plain)), x)


@pytest.mark.parametrize("n", [64, 128])
def test_hadamard_is_orthonormal_sylvester(n):
    h = np.asarray(qat.hadamard_matrix(n), np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
    np.testing.assert_allclose(h, R4.hadamard(n), rtol=0, atol=1e-7)
    np.testing.assert_allclose(R4.hadamard(n) @ R4.hadamard(n).T, np.eye(n), atol=1e-12)


@pytest.mark.parametrize("preset", [FLASH, "tiny-v4"])
def test_index_vector_is_hadamard_fp4_and_preserves_dot_products(preset):
    config = load_config(preset, fake_quant=True)
    d = config.index_head_dim
    rng = np.random.default_rng(9)
    q = (rng.standard_normal((16, 8, d)) * np.exp(rng.uniform(-3, 3, (16, 8, 1)))).astype(np.float32)
    k = (rng.standard_normal((16, 1, d)) * np.exp(rng.uniform(-3, 3, (16, 1, 1)))).astype(np.float32)
    q[:, :, 5] *= 30.0  # an outlier channel: the rotation spreads it
    iq = np.asarray(qat.index_vector(jnp.asarray(q), config), np.float64)
    ik = np.asarray(qat.index_vector(jnp.asarray(k), config), np.float64)
    rq, rk = R4.index_fake_quant(q), R4.index_fake_quant(k)
    _rel(f"index_vector ({preset})", iq, rq)
    np.testing.assert_allclose(iq, rq, rtol=1e-6, atol=1e-6 * np.abs(rq).max())
    np.testing.assert_allclose(ik, rk, rtol=1e-6, atol=1e-6 * np.abs(rk).max())
    # rotated-and-quantized dot products equal the plain ones up to the FP4 rounding:
    # |Q(Hq).Q(Hk) - q.k| <= |Q(Hq) - Hq| |Q(Hk)| + |Hq| |Q(Hk) - Hk|   (H orthonormal)
    H = R4.hadamard(d)
    hq, hk = q.astype(np.float64) @ H, k.astype(np.float64) @ H
    exact = np.sum(q.astype(np.float64) * k.astype(np.float64), axis=-1)
    got = np.sum(iq * ik, axis=-1)
    bound = (np.linalg.norm(iq - hq, axis=-1) * np.linalg.norm(ik, axis=-1)
             + np.linalg.norm(hq, axis=-1) * np.linalg.norm(ik - hk, axis=-1))
    assert (np.abs(got - exact) <= bound * (1 + 1e-6) + 1e-9).all()
    # FP4 keeps about 3 significant bits: the relative quantization error stays well below 1
    assert np.median(np.linalg.norm(iq - hq, axis=-1) / np.linalg.norm(hq, axis=-1)) < 0.2
    plain = dataclasses.replace(config, fake_quant=False)
    np.testing.assert_array_equal(np.asarray(qat.index_vector(jnp.asarray(q), plain)), q)
