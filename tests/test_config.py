"""Tests of deepinfer.model.config against the spec (model-v4.1-flash.md §1.1 and §2.1).

The expected values below are typed in from the spec's configuration table, not taken from the
code, and the official-format config files are built here by hand from the same table.
"""

import dataclasses
import json

import pytest

from deepinfer.model import ConfigError, ModelConfig, load_config
from deepinfer.model.config import PRESETS, config_from_dict, to_hf_config

FLASH = "deepseek-v4.1-flash"

# §1.1: (ModelConfig field, released value). Lists are compared as tuples.
TABLE = [
    ("vocab_size", 129280),
    ("hidden_size", 5120),
    ("num_hidden_layers", 40),
    ("num_nextn_predict_layers", 3),
    ("num_attention_heads", 64),
    ("head_dim", 512),
    ("qk_rope_head_dim", 64),
    ("q_lora_rank", 1280),
    ("o_groups", 8),
    ("o_lora_rank", 1024),
    ("sliding_window", 128),
    ("compress_ratios", [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]),
    ("kv_source_layer_ids", [2, 8, 14, 20]),
    ("index_source_layer_ids", [2, 8, 14, 20, 24, 28, 32, 36]),
    ("candidate_source_layer_id", 20),
    ("candidate_topk_blocks", 2048),
    ("candidate_block_size", 8),
    ("index_n_heads", 32),
    ("index_head_dim", 128),
    ("index_topk", 512),
    ("rope_theta", 10000.0),
    ("compress_rope_theta", 160000.0),
    ("rope_factor", 16.0),
    ("original_seq_len", 65536),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("max_position_embeddings", 1048576),
    ("n_routed_experts", 384),
    ("n_shared_experts", 1),
    ("num_experts_per_tok", 6),
    ("moe_intermediate_size", 2304),
    ("scoring_func", "sqrtsoftplus"),
    ("gate_temp", 1.0),
    ("norm_topk_prob", True),
    ("routed_scaling_factor", 1.5),
    ("swiglu_limit", 10.0),
    ("rms_norm_eps", 1e-20),
    ("hc_mult", 4),
    ("hc_sinkhorn_iters", 20),
    ("hc_eps", 1e-6),
    ("engram_layer_ids", [1, 14]),
    ("engram_num_embeddings", [384006168, 384016682]),
    ("engram_max_ngram_size", 4),
    ("engram_vocab_size", 16000000),
    ("engram_n_heads", 8),
    ("engram_head_dim", 256),
    ("engram_pad_token_id", 2),
    ("engram_compressed_vocab_size", 99092),
    ("dspark_block_size", 5),
    ("dspark_noise_token_id", 128799),
    ("dspark_target_layer_ids", [37, 38, 39]),
    ("dspark_markov_rank", 256),
    ("dspark_n_routed_experts", 128),
    ("dspark_num_experts_per_tok", 3),
    ("tie_word_embeddings", False),
    # top-level config.json / quantization_config
    ("bos_token_id", 0),
    ("eos_token_id", 1),
    ("pad_token_id", 2),
    ("weight_block_size", [32, 32]),
    ("expert_dtype", "fp4"),
    ("model_type", "deepseek_v41"),
]

# §2.1 layer schedule
SWA = {0, 1}
FULL = {2, 8, 14, 20}
REINDEX = {24, 28, 32, 36}
REUSE = set(range(3, 8)) | set(range(9, 14)) | set(range(15, 20)) | {21, 22, 23, 25, 26, 27, 29, 30, 31,
                                                                      33, 34, 35, 37, 38, 39}


def _norm(v):
    return tuple(v) if isinstance(v, list) else v


@pytest.fixture(scope="module")
def flash() -> ModelConfig:
    return load_config(FLASH)


# ---- §1.1 values -----------------------------------------------------------------------


@pytest.mark.parametrize("field,value", TABLE, ids=[f for f, _ in TABLE])
def test_flash_preset_value(flash, field, value):
    got = getattr(flash, field)
    assert got == _norm(value), f"{field}: {got!r} != {value!r}"
    assert type(got) is type(_norm(value)) or isinstance(value, float), f"{field}: type {type(got)}"


def test_flash_compress_ratios_cover_draft_layers(flash):
    assert len(flash.compress_ratios) == 43 == flash.num_hidden_layers + flash.num_nextn_predict_layers
    assert flash.compress_ratios[40:] == (0, 0, 0)


def test_flash_candidate_pool_positions(flash):
    assert flash.candidate_topk_blocks * flash.candidate_block_size == 16384


def test_preset_is_hashable_and_default(flash):
    # static under jit: hashable, and equal to a freshly built preset
    assert hash(flash) == hash(load_config(FLASH))
    assert flash.fake_quant is True and flash.dtype == "bfloat16"
    assert dataclasses.replace(flash, fake_quant=False).fake_quant is False
    assert set(PRESETS) >= {FLASH, "tiny-v4.1"}


# ---- §2.1 layer schedule ---------------------------------------------------------------


def test_schedule_partition_is_complete():
    assert SWA | FULL | REINDEX | REUSE == set(range(40))
    assert len(SWA) + len(FULL) + len(REINDEX) + len(REUSE) == 40


@pytest.mark.parametrize("layer", range(40))
def test_flash_layer_kind(flash, layer):
    want = "swa" if layer in SWA else "full" if layer in FULL else "reindex" if layer in REINDEX else "reuse"
    assert flash.layer_kind(layer) == want
    ratio = 0 if layer < 2 else 2 if layer < 20 else 1
    assert flash.compress_ratio(layer) == ratio


@pytest.mark.parametrize("layer", range(40))
def test_flash_sources(flash, layer):
    if layer < 2:
        assert flash.kv_source(layer) is None and flash.index_source(layer) is None
        return
    kv = max(s for s in (2, 8, 14, 20) if s <= layer)
    idx = max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= layer)
    assert flash.kv_source(layer) == kv
    assert flash.index_source(layer) == idx
    # the deeper reindex layers score only inside layer 20's candidate pool
    assert flash.uses_candidates(layer) == (layer in REINDEX)


def test_flash_decoder_start_and_hash_columns(flash):
    assert flash.decoder_start == 20
    assert flash.n_hash_columns == 24  # 3 n-gram sizes x 8 heads (§2.7)


def test_global_cache_bytes_per_token(flash):
    assert flash.global_cache_bytes_per_token() == 890


def test_tiny_preset_exercises_every_layer_kind():
    tiny = load_config("tiny-v4.1")
    kinds = [tiny.layer_kind(i) for i in range(tiny.num_hidden_layers)]
    assert kinds == ["swa", "swa", "full", "reuse", "full", "full", "reuse", "reindex", "reuse", "reuse"]
    assert tiny.uses_candidates(7) and not tiny.uses_candidates(5)
    assert tiny.dtype == "float32"


# ---- official config files ---------------------------------------------------------------

# HF names (text_config) for the §1.1 rows, by hand
HF_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_nextn_predict_layers": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-20,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "tie_word_embeddings": False,
}

HF_TOP = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "vision_config": {
        "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
        "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 1024,
        "min_pixels": 295936, "max_wh_ratio": None,
    },
}

# flat inference/config.json names for the §1.1 rows, by hand
FLAT = {
    "vocab_size": 129280,
    "dim": 5120,
    "n_layers": 40,
    "n_mtp_layers": 3,
    "n_heads": 64,
    "head_dim": 512,
    "rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "window_size": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_factor": 16,
    "original_seq_len": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "n_activated_experts": 6,
    "moe_inter_dim": 2304,
    "score_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "norm_eps": 1e-20,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_n_activated_experts": 3,
    "dtype": "fp8",
    "expert_dtype": "fp4",
    "scale_fmt": "ue8m0",
    "image_token_id": 129264,
    "vision_dim": 1024,
    "vision_layers": 32,
    "vision_heads": 16,
}


def same_as_flash(cfg: ModelConfig, flash: ModelConfig) -> None:
    """Every field equal to the preset's (the name differs by construction)."""
    for f in dataclasses.fields(ModelConfig):
        if f.name == "name":
            continue
        assert getattr(cfg, f.name) == getattr(flash, f.name), f.name
    assert dataclasses.replace(cfg, name=flash.name) == flash


def write_json(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def test_hf_config_with_text_config_nesting(tmp_path, flash):
    write_json(tmp_path / "ckpt" / "config.json", {**HF_TOP, "text_config": HF_TEXT})
    from_dir = load_config(tmp_path / "ckpt")
    from_file = load_config(tmp_path / "ckpt" / "config.json")
    same_as_flash(from_dir, flash)
    same_as_flash(from_file, flash)
    assert from_dir.name == "ckpt"


def test_hf_config_flat_hf_names(tmp_path, flash):
    # an HF config.json without the text_config nesting
    top = {k: v for k, v in HF_TOP.items() if k != "model_type"}
    write_json(tmp_path / "config.json", {**top, **HF_TEXT, "model_type": "deepseek_v41"})
    same_as_flash(load_config(tmp_path), flash)


def test_hf_config_rope_scaling_and_quantization_are_read(tmp_path):
    text = dict(HF_TEXT, rope_scaling={"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 4096,
                                       "beta_fast": 16, "beta_slow": 2})
    top = dict(HF_TOP, quantization_config=dict(HF_TOP["quantization_config"], weight_block_size=[64, 64],
                                                expert_dtype="fp8"))
    cfg = config_from_dict({**top, "text_config": text})
    assert (cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow) == (8.0, 4096, 16.0, 2.0)
    assert cfg.weight_block_size == (64, 64)
    assert cfg.expert_dtype == "fp8"


def test_flat_inference_config(tmp_path, flash):
    write_json(tmp_path / "inference" / "config.json", FLAT)
    cfg = load_config(tmp_path)  # no config.json at the top: falls back to inference/config.json
    same_as_flash(cfg, flash)


def test_hf_config_wins_over_flat(tmp_path, flash):
    write_json(tmp_path / "config.json", {**HF_TOP, "text_config": HF_TEXT})
    write_json(tmp_path / "inference" / "config.json", dict(FLAT, dim=1024))
    assert load_config(tmp_path).hidden_size == 5120


@pytest.mark.parametrize("key", ["engram_pad_token_id", "engram_pad_id"])
def test_engram_pad_spellings(key):
    cfg = config_from_dict({key: 7})
    assert cfg.engram_pad_token_id == 7


def test_load_config_overrides(tmp_path):
    write_json(tmp_path / "config.json", {**HF_TOP, "text_config": HF_TEXT})
    cfg = load_config(tmp_path, fake_quant=False, dtype="float32")
    assert cfg.fake_quant is False and cfg.dtype == "float32"
    assert load_config("tiny-v4.1", fake_quant=False).fake_quant is False


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_to_hf_config_round_trip(preset):
    cfg = PRESETS[preset]
    hf = json.loads(json.dumps(to_hf_config(cfg)))  # through real JSON: lists, not tuples
    assert hf["model_type"] == cfg.model_type
    assert hf["text_config"]["model_type"] == cfg.model_type + "_text"
    assert hf["quantization_config"]["weight_block_size"] == list(cfg.weight_block_size)
    back = config_from_dict(hf, name=cfg.name)
    # the activation dtype is a runtime choice and is not written
    assert dataclasses.replace(back, dtype=cfg.dtype) == cfg


def test_flash_preset_config_json_names():
    hf = to_hf_config(load_config(FLASH))
    assert hf["architectures"] == ["DeepseekV41ForCausalLM"]
    assert hf["model_type"] == "deepseek_v41" and hf["text_config"]["model_type"] == "deepseek_v41_text"
    assert hf["quantization_config"]["scale_fmt"] == "ue8m0"


def test_to_hf_config_round_trip_of_modified_config():
    cfg = dataclasses.replace(
        PRESETS["tiny-v4.1"], weight_block_size=(64, 64), expert_dtype="fp8", engram_pad_token_id=5,
        rope_factor=4.0, original_seq_len=2048, beta_fast=8.0, beta_slow=0.5, fake_quant=False,
    )
    back = config_from_dict(json.loads(json.dumps(to_hf_config(cfg))), name=cfg.name)
    assert dataclasses.replace(back, dtype=cfg.dtype, fake_quant=False) == cfg


# ---- errors ------------------------------------------------------------------------------


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="frobnicate_factor"):
        config_from_dict({"text_config": dict(HF_TEXT, frobnicate_factor=3)})
    with pytest.raises(ConfigError, match="frobnicate_factor"):
        config_from_dict(dict(FLAT, frobnicate_factor=3))


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    write_json(tmp_path / "config.json", {**HF_TOP, "text_config": dict(HF_TEXT, bogus_key=1)})
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert "bogus_key" in str(e.value) and "config.json" in str(e.value)


def test_runtime_fields_are_not_accepted_from_files():
    with pytest.raises(ConfigError, match="fake_quant"):
        config_from_dict({"fake_quant": False})


def test_compress_ratios_wrong_length():
    with pytest.raises(ConfigError, match="compress_ratios") as e:
        config_from_dict(dict(FLAT, compress_ratios=[0, 0] + [2] * 18 + [1] * 20))  # draft entries missing
    assert "43" in str(e.value) and "40" in str(e.value)
    with pytest.raises(ConfigError, match="compress_ratios"):
        dataclasses.replace(load_config(FLASH), compress_ratios=(0,) * 44)


def test_compress_ratio_value_out_of_set():
    ratios = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    ratios[5] = 4
    with pytest.raises(ConfigError, match="compress_ratios"):
        config_from_dict({"compress_ratios": ratios})


@pytest.mark.parametrize("key,flat_key", [("kv_source_layer_ids", "kv_source_layers"),
                                          ("index_source_layer_ids", "index_source_layers")])
def test_source_layer_out_of_range(key, flat_key):
    bad = [2, 8, 14, 20, 40] if key == "kv_source_layer_ids" else [2, 8, 14, 20, 24, 28, 32, 36, 40]
    with pytest.raises(ConfigError, match=key) as e:
        config_from_dict({key: bad})
    assert "40" in str(e.value)
    with pytest.raises(ConfigError, match=key):
        config_from_dict(dict(FLAT, **{flat_key: bad}))


def test_kv_source_on_ratio0_layer():
    with pytest.raises(ConfigError, match="kv_source_layer_ids"):
        config_from_dict({"kv_source_layer_ids": [1, 2, 8, 14, 20]})


def test_reuse_layer_ratio_differs_from_source():
    ratios = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    ratios[21] = 2  # a reuse layer of the ratio-1 source 20
    with pytest.raises(ConfigError, match="compress_ratios") as e:
        config_from_dict({"compress_ratios": ratios})
    assert "21" in str(e.value)


def test_candidate_source_must_be_kv_source():
    with pytest.raises(ConfigError, match="candidate_source_layer_id"):
        config_from_dict({"candidate_source_layer_id": 24})


def test_engram_tables_per_layer():
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        config_from_dict({"engram_num_embeddings": [384006168]})


@pytest.mark.parametrize("key,value", [("hidden_size", 0), ("num_attention_heads", -1), ("head_dim", 1.5)])
def test_non_positive_sizes(key, value):
    with pytest.raises(ConfigError, match=key):
        config_from_dict({key: value})


def test_unsupported_model_type_and_rope_scaling():
    with pytest.raises(ConfigError, match="model_type"):
        config_from_dict({"model_type": "deepseek_v3"})
    with pytest.raises(ConfigError, match="rope_scaling"):
        config_from_dict({"rope_scaling": {"type": "linear", "factor": 2}})


def test_invalid_json_names_the_line(tmp_path):
    text = '{\n  "vocab_size": 129280,\n  "hidden_size": 5120,,\n  "num_hidden_layers": 40\n}\n'
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="line 3") as e:
        load_config(tmp_path)
    assert "config.json" in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_config("no-such-preset")


@pytest.mark.parametrize("key,value", [
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0.0), ("rope_theta", "abc"),
    ("rope_theta", -10000.0), ("rope_theta", 1.0), ("compress_rope_theta", float("inf")),
    ("routed_scaling_factor", float("inf")), ("routed_scaling_factor", 0), ("gate_temp", 0.0), ("rope_factor", 0.5),
    ("beta_fast", 0), ("beta_slow", -1.0), ("swiglu_limit", -1.0), ("hc_eps", -1e-6), ("hc_eps", float("nan")),
    ("gate_temp", True), ("swiglu_limit", None), ("rms_norm_eps", [1e-6]),
])
def test_invalid_float_values_are_named(key, value):
    with pytest.raises(ConfigError, match=key) as e:
        config_from_dict({"text_config": {key: value}})
    assert repr(value) in str(e.value)


@pytest.mark.parametrize("key,value", [("swiglu_limit", 0.0), ("hc_eps", 0.0), ("rope_factor", 1), ("rope_theta", 500000)])
def test_float_boundary_values_are_accepted(key, value):
    assert getattr(config_from_dict({key: value}), key) == value


@pytest.mark.parametrize("key,value", [
    ("hidden_size", True), ("qk_rope_head_dim", "64"), ("n_shared_experts", True), ("original_seq_len", 4.5),
    ("bos_token_id", -1), ("candidate_source_layer_id", -2), ("compress_ratios", 5), ("engram_layer_ids", ["1"]),
    ("norm_topk_prob", 1), ("tie_word_embeddings", "false"), ("scoring_func", 3),
])
def test_wrong_types_are_named(key, value):
    with pytest.raises(ConfigError, match=key):
        config_from_dict({key: value})


@pytest.mark.parametrize("raw,key", [
    ([1, 2], "top level"), ({"text_config": [1]}, "text_config"), ({"quantization_config": "fp8"}, "quantization_config"),
    ({"rope_scaling": "yarn"}, "rope_scaling"), ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"rope_scaling": {"type": "yarn", "factor": "x"}}, "rope_factor"),
    ({"quantization_config": {"weight_block_size": 128}}, "weight_block_size"),
])
def test_malformed_objects_are_config_errors(raw, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(raw)


def test_a_file_error_names_the_file(tmp_path):
    write_json(tmp_path / "config.json", {**HF_TOP, "text_config": dict(HF_TEXT, rope_theta="abc")})
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert "rope_theta" in str(e.value) and "config.json" in str(e.value) and "'abc'" in str(e.value)
