"""Model configuration: one frozen dataclass, its presets, and readers for the official files.

A `ModelConfig` is hashable and static under `jax.jit`; it holds no mesh and reads no
environment variable. It is read from an HF `config.json` (optionally nested under
`text_config`), from the flat `inference/config.json` of the official release, or built
from a preset name. Every value is validated on construction and errors name the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

LayerKind = str  # "swa" | "full" | "reuse" | "reindex"


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a DeepSeek-V4.1-style model (names follow the HF `text_config`)."""

    name: str = "custom"
    model_type: str = "deepseek_v41"
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_nextn_predict_layers: int = 3
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    tie_word_embeddings: bool = False
    # DeepSeek-V4 only: the first `num_hash_layers` MoE layers route by a token-id table.
    num_hash_layers: int = 0
    weight_block_size: tuple[int, int] = (32, 32)
    expert_dtype: str = "fp4"
    # Runtime numerics (not in the official files): the reference's QAT fake-quant of the
    # window KV (FP8), compressed KV and indexer keys/queries (FP4); and the activation dtype.
    fake_quant: bool = True
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _validate(self)

    # ---- layer schedule -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def is_v4(self) -> bool:
        """DeepSeek-V4(-Flash): every compressed layer owns its compressor (CSA ratio 4 with
        overlap and an indexer, HCA otherwise); per-head q norm; mHC `pre` used at its own site;
        learned `hc_head`; hash-routed first layers."""
        return self.model_type == "deepseek_v4"

    def kv_source(self, layer: int) -> int | None:
        """The KV-source layer whose compressed KV `layer` attends to (None: window only)."""
        if self.compress_ratios[layer] == 0:
            return None
        if self.is_v4:
            return layer
        sources = [s for s in self.kv_source_layer_ids if s <= layer]
        return max(sources) if sources else None

    def index_source(self, layer: int) -> int | None:
        """The index-source layer whose top-k selection `layer` uses (None: window only, or
        V4's HCA, which attends to every visible compressed row)."""
        if self.compress_ratios[layer] == 0:
            return None
        if self.is_v4:
            return layer if self.compress_ratios[layer] == 4 else None
        sources = [s for s in self.index_source_layer_ids if s <= layer]
        return max(sources) if sources else None

    def layer_kind(self, layer: int) -> LayerKind:
        """V4.1: swa | full | reuse | reindex. V4: swa | csa | hca."""
        if self.compress_ratios[layer] == 0:
            return "swa"
        if self.is_v4:
            return "csa" if self.compress_ratios[layer] == 4 else "hca"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    def uses_candidates(self, layer: int) -> bool:
        """Reindex layers after the candidate source score only inside its candidate pool."""
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids

    def owns_compressor(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0 and (self.is_v4 or layer in self.kv_source_layer_ids)

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def decoder_start(self) -> int:
        """First decoder layer of the CED split: the last KV source (layer 20 in the release)."""
        return max(self.kv_source_layer_ids)

    @property
    def n_hash_columns(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def global_cache_bytes_per_token(self) -> float:
        """Bytes of persistent (prefix-cacheable) cache per context token.

        Per KV source: one FP4 main-KV entry (e2m1 values + one e4m3 scale per 16) and one FP4
        indexer key (e2m1 values + one ue8m0 scale per 32) every `ratio` tokens.
        """
        if self.is_v4:
            # the reference's bf16 rows: main KV on every compressed layer, indexer keys on CSA
            return sum((2 * self.head_dim + (2 * self.index_head_dim if r == 4 else 0)) / r
                       for r in self.compress_ratios[: self.num_hidden_layers] if r)
        kv_entry = self.head_dim // 2 + self.head_dim // 16
        idx_entry = self.index_head_dim // 2 + self.index_head_dim // 32
        return sum((kv_entry + idx_entry) / self.compress_ratios[s] for s in self.kv_source_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


class ConfigError(ValueError):
    """An invalid or inconsistent configuration; the message names the key."""


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"config key `{key}`: {message}")


# Floating-point fields: (lower bound, whether the bound itself is allowed) and why.
_FLOAT_BOUNDS: dict[str, tuple[float, bool]] = {
    "rope_theta": (1.0, False),  # RoPE base: frequencies base^(-2i/d) must fall, log(base) > 0
    "compress_rope_theta": (1.0, False),  # the same base for the compressed layers' YaRN RoPE
    "rope_factor": (1.0, True),  # YaRN interpolation factor (1 = none)
    "beta_fast": (0.0, False),  # YaRN correction range: log(original_seq_len / (beta * 2 pi))
    "beta_slow": (0.0, False),
    "gate_temp": (0.0, False),  # router logits are divided by it
    "routed_scaling_factor": (0.0, False),  # multiplies the routed experts' weights
    "swiglu_limit": (0.0, True),  # SwiGLU clamp; 0 turns it off
    "rms_norm_eps": (0.0, False),  # rsqrt(mean(x^2) + eps): 0 divides an all-zero row by zero
    "hc_eps": (0.0, True),  # added to positive mHC mixes
}
# Integer fields that may be zero or must be token ids / layer ids (the rest must be positive).
_NON_NEGATIVE_INTS = (
    "num_nextn_predict_layers n_shared_experts num_hash_layers bos_token_id eos_token_id pad_token_id "
    "engram_pad_token_id dspark_noise_token_id"
).split()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_types(c: ModelConfig) -> None:
    """Every field has its annotated type (no bool for a number, no string for a float), every
    float is finite and in its range, every integer in its range: errors name the field and the
    value, before any rule below compares or indexes a value of the wrong type."""
    for f in dataclasses.fields(c):
        key, value, kind = f.name, getattr(c, f.name), f.type
        shown = _as_list(value)  # as the JSON file spells it
        if kind == "str" and not isinstance(value, str):
            _fail(key, f"must be a string, got {shown!r}")
        elif kind == "bool" and not isinstance(value, bool):
            _fail(key, f"must be true or false, got {shown!r}")
        elif kind == "float":
            low, inclusive = _FLOAT_BOUNDS[key]
            if not (_is_int(value) or isinstance(value, float)):
                _fail(key, f"must be a number, got {shown!r}")
            if not math.isfinite(value) or value < low or (value == low and not inclusive):
                _fail(key, f"must be a finite number {'>=' if inclusive else '>'} {low:g}, got {shown!r}")
        elif kind == "int":
            if not _is_int(value):
                _fail(key, f"must be an integer, got {shown!r}")
            low = -1 if key == "candidate_source_layer_id" else 0 if key in _NON_NEGATIVE_INTS else 1
            if value < low:
                _fail(key, f"must be an integer >= {low}, got {shown!r}")
        elif kind.startswith("tuple"):
            if not isinstance(value, tuple) or not all(_is_int(v) and v >= 0 for v in value):
                _fail(key, f"must be a list of non-negative integers, got {shown!r}")


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _validate(c: ModelConfig) -> None:
    _validate_types(c)
    if c.model_type not in MODEL_TYPES:
        _fail("model_type", f"unsupported model type {c.model_type!r} (supported: {', '.join(MODEL_TYPES)})")
    n_total = c.num_hidden_layers + c.num_nextn_predict_layers
    if len(c.compress_ratios) != n_total:
        _fail(
            "compress_ratios",
            f"needs num_hidden_layers + num_nextn_predict_layers = {n_total} entries, got {len(c.compress_ratios)}",
        )
    if not 0 <= c.num_hash_layers <= c.num_hidden_layers:
        _fail("num_hash_layers", f"{c.num_hash_layers} is out of range [0, {c.num_hidden_layers}]")
    if c.is_v4:
        _validate_v4_schedule(c)
    else:
        _validate_v41_schedule(c)
    if c.num_attention_heads % c.o_groups:
        _fail("o_groups", f"{c.o_groups} must divide num_attention_heads ({c.num_attention_heads})")
    if not 0 < c.qk_rope_head_dim <= min(c.head_dim, c.index_head_dim) or c.qk_rope_head_dim % 2:
        _fail("qk_rope_head_dim", f"must be even and at most head_dim and index_head_dim, got {c.qk_rope_head_dim}")
    if c.num_experts_per_tok > c.n_routed_experts:
        _fail("num_experts_per_tok", f"{c.num_experts_per_tok} exceeds n_routed_experts ({c.n_routed_experts})")
    if c.n_shared_experts not in (0, 1):
        _fail("n_shared_experts", f"only 0 or 1 shared expert is supported, got {c.n_shared_experts}")
    if c.scoring_func != "sqrtsoftplus":
        _fail("scoring_func", f"unsupported scoring function {c.scoring_func!r} (V4 and V4.1 use sqrtsoftplus)")
    if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        _fail(
            "engram_num_embeddings",
            f"needs one table size per Engram layer ({len(c.engram_layer_ids)}), got {len(c.engram_num_embeddings)}",
        )
    if c.expert_dtype not in ("fp4", "fp8", "bf16"):
        _fail("expert_dtype", f"unknown expert dtype {c.expert_dtype!r}")
    if c.dtype not in ("float32", "bfloat16"):
        _fail("dtype", f"activation dtype must be float32 or bfloat16, got {c.dtype!r}")
    if len(c.weight_block_size) != 2 or min(c.weight_block_size) < 1:
        _fail("weight_block_size", f"must be two positive sizes, got {list(c.weight_block_size)}")


def _validate_v41_schedule(c: ModelConfig) -> None:
    """CSA2: ratios 0/1/2, KV sources shared by the layers after them, index sources, candidates."""
    if c.num_hash_layers:
        _fail("num_hash_layers", "DeepSeek-V4.1 has no hash-routed layers")
    for i, r in enumerate(c.compress_ratios):
        if r not in (0, 1, 2):
            _fail("compress_ratios", f"entry {i} is {r}; V4.1 uses ratios 0, 1 and 2")
    L = c.num_hidden_layers
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
        ids = getattr(c, key)
        if list(ids) != sorted(set(ids)):
            _fail(key, f"must be strictly increasing layer ids, got {list(ids)}")
        for i in ids:
            if not 0 <= i < L:
                _fail(key, f"layer id {i} is out of range [0, {L})")
    for s in c.kv_source_layer_ids:
        if c.compress_ratios[s] == 0:
            _fail("kv_source_layer_ids", f"layer {s} has compress ratio 0 and cannot produce compressed KV")
    for s in c.index_source_layer_ids:
        if c.compress_ratios[s] == 0:
            _fail("index_source_layer_ids", f"layer {s} has compress ratio 0")
    for s in c.kv_source_layer_ids:
        if s not in c.index_source_layer_ids:
            _fail("index_source_layer_ids", f"KV source {s} must also be an index source (it owns the indexer keys)")
    for layer in range(L):
        r = c.compress_ratios[layer]
        if r == 0:
            continue
        src = c.kv_source(layer)
        if src is None:
            _fail("kv_source_layer_ids", f"layer {layer} has ratio {r} but no KV source at or before it")
        if c.compress_ratios[src] != r:
            _fail("compress_ratios", f"layer {layer} (ratio {r}) reads KV source {src} of ratio {c.compress_ratios[src]}")
        isrc = c.index_source(layer)
        if isrc is None or isrc < src:
            _fail("index_source_layer_ids", f"layer {layer} has no index source at or after its KV source {src}")
    cand = c.candidate_source_layer_id
    if cand >= 0 and cand not in c.kv_source_layer_ids:
        _fail("candidate_source_layer_id", f"layer {cand} is not a KV source")


def _validate_v4_schedule(c: ModelConfig) -> None:
    """V4: every compressed layer owns its compressor; ratio 4 = CSA, >= 8 = HCA; one MTP block."""
    for i, r in enumerate(c.compress_ratios):
        if r not in (0, 4) and r < 8:
            _fail("compress_ratios", f"entry {i} is {r}; V4 uses 0 (window), 4 (CSA) or >= 8 (HCA, 128 in the release)")
    for i in range(c.num_hidden_layers, len(c.compress_ratios)):
        if c.compress_ratios[i]:
            _fail("compress_ratios", f"entry {i} (an MTP block) must be 0")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        if getattr(c, key):
            _fail(key, "DeepSeek-V4 has no shared KV sources or Engram layers; leave it empty")
    if c.candidate_source_layer_id >= 0:
        _fail("candidate_source_layer_id", "DeepSeek-V4 has no candidate pool; use -1")
    if c.num_nextn_predict_layers > 1:
        _fail("num_nextn_predict_layers", "DeepSeek-V4 ships one MTP block")


MODEL_TYPES = ("deepseek_v41", "deepseek_v4")

# ---- presets ---------------------------------------------------------------------------

DEEPSEEK_V41_FLASH = ModelConfig(name="deepseek-v4.1-flash")

# Every mechanism of the release schedule at small widths: SWA-only layers 0-1 (Engram on 1),
# ratio-2 sources 2 and 4 (Engram on 4) with a Reuse layer between, the ratio-1 decoder source 5
# that builds the candidate pool, Reuse 6, Reindex 7 and Reuse 8-9; real vocabulary and tokenizer.
# Small widths shared by the tiny presets (fp32 activations, fast on a laptop CPU).
_TINY_WIDTHS = dict(
    hidden_size=128,
    num_attention_heads=4,
    head_dim=128,
    qk_rope_head_dim=32,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    max_position_embeddings=65536,
    original_seq_len=4096,
    dtype="float32",
)

TINY_V41 = ModelConfig(
    name="tiny-v4.1",
    num_hidden_layers=10,
    num_nextn_predict_layers=3,
    sliding_window=128,
    compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 4, 5),
    index_source_layer_ids=(2, 4, 5, 7),
    candidate_source_layer_id=5,
    candidate_topk_blocks=8,
    candidate_block_size=8,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=32,
    engram_layer_ids=(1, 4),
    engram_num_embeddings=(12458, 13416),
    engram_vocab_size=1000,
    engram_n_heads=4,
    engram_head_dim=32,
    dspark_target_layer_ids=(7, 8, 9),
    dspark_markov_rank=16,
    dspark_n_routed_experts=8,
    dspark_num_experts_per_tok=2,
    **_TINY_WIDTHS,
)

# TINY_V41's layer roles, one layer each: window-only (Engram), a ratio-2 KV + index source
# (Engram), a ratio-2 layer reading it, a ratio-1 KV + index source (the candidate pool, the first
# decoder layer), a ratio-1 layer with only its own indexer keys; the drafter listens to the last
# three. Engram stays in encoder layers as in the release (layers 1 and 14, decoder from 20): on a
# decoder layer its gate is shut below the compact-prefill floor, so a KV source's bytes would
# depend on the floor. Half the layers compile in about 60 % of the time: the engine's tests run
# on it where the number of layers does not matter (a step equals the forward, ...).
TINY_V41_SHORT = dataclasses.replace(
    TINY_V41,
    name="tiny-v4.1-short",
    num_hidden_layers=5,
    compress_ratios=(0, 2, 2, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3, 4),
    candidate_source_layer_id=3,
    engram_layer_ids=(0, 1),
    dspark_target_layer_ids=(2, 3, 4),
)

_V4_COMMON = dict(
    model_type="deepseek_v4",
    kv_source_layer_ids=(),
    index_source_layer_ids=(),
    candidate_source_layer_id=-1,
    engram_layer_ids=(),
    engram_num_embeddings=(),
    dspark_target_layer_ids=(),
    rms_norm_eps=1e-6,
    weight_block_size=(128, 128),
)

# The April 2026 release: layers 0-1 window-only, then CSA (4) / HCA (128) alternating, one MTP.
DEEPSEEK_V4_FLASH = ModelConfig(
    name="deepseek-v4-flash",
    hidden_size=4096,
    num_hidden_layers=43,
    num_nextn_predict_layers=1,
    q_lora_rank=1024,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
    index_n_heads=64,
    n_routed_experts=256,
    moe_intermediate_size=2048,
    num_hash_layers=3,
    **_V4_COMMON,
)

# Every V4 mechanism at small widths with the real vocabulary: window-only layers, CSA with
# overlapping windows, ape and its own indexer compressor, HCA (real ratio 128), two hash-routed
# layers, per-head q norm, hc_head collapse, and the MTP block.
TINY_V4 = ModelConfig(
    name="tiny-v4",
    num_hidden_layers=6,
    num_nextn_predict_layers=1,
    compress_ratios=(0, 0, 4, 128, 4, 128, 0),
    index_n_heads=16,
    index_head_dim=64,
    index_topk=32,
    num_hash_layers=2,
    **_TINY_WIDTHS,
    **_V4_COMMON,
)

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (DEEPSEEK_V41_FLASH, TINY_V41, TINY_V41_SHORT, DEEPSEEK_V4_FLASH, TINY_V4)
}


# ---- readers ---------------------------------------------------------------------------

# flat `inference/config.json` name -> ModelConfig field
_FLAT_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
    "engram_pad_id": "engram_pad_token_id",
    "n_hash_layers": "num_hash_layers",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "rope_factor": "rope_factor",
}
# keys of the official files that carry no model math for a text-only engine
_IGNORED = {
    "architectures", "transformers_version", "use_cache", "max_seq_len", "initializer_range",
    "attention_bias", "attention_dropout", "mlp_bias", "hidden_act", "num_key_value_heads",
    "topk_method", "image_token_id", "vision_config", "quantization_config", "auto_map",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "max_batch_size",
    "vision_dim", "vision_layers", "vision_heads", "vision_inter_dim", "vision_patch_size",
    "vision_rope_theta", "vision_downsample_ratio", "vision_max_image_tokens", "vision_min_pixels",
    "vision_max_wh_ratio", "scale_fmt", "n_dense_layers", "rope_parameters", "rope_type",
    "generation_config", "chat_template", "dtype_fp8", "_name_or_path", "text_config",
}


def _canonical(raw: dict[str, Any], source: str) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "model_type":
            mt = str(value).removesuffix("_text")
            if mt not in MODEL_TYPES:
                _fail("model_type", f"{source}: unsupported model type {value!r}")
            out["model_type"] = mt
            continue
        if key == "rope_scaling":
            if value:
                out.update(_rope_scaling(value, source))
            continue
        if key == "dtype":  # flat config: storage dtype of the dense weights ("fp8")
            if value not in ("fp8", "bf16", "float32", "bfloat16"):
                _fail("dtype", f"{source}: unknown weight dtype {value!r}")
            continue
        if key == "torch_dtype":  # HF: the activation dtype the checkpoint was written for
            if value in ("float32", "bfloat16"):
                out["dtype"] = value
            continue
        if key in _IGNORED:
            continue
        name = _FLAT_NAMES.get(key, key)
        if name not in fields or name in ("name", "fake_quant", "dtype"):
            _fail(key, f"{source}: unknown key")
        if isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        out[name] = value
    return out


def _rope_scaling(value: Any, source: str) -> dict[str, Any]:
    """The YaRN fields of an HF `rope_scaling` object (types and ranges are checked with the rest)."""
    if not isinstance(value, dict):
        _fail("rope_scaling", f"{source}: must be an object, got {value!r}")
    kind = value.get("type", value.get("rope_type"))
    if kind != "yarn":
        _fail("rope_scaling", f"{source}: only YaRN is supported, got {kind!r}")
    if "factor" not in value:
        _fail("rope_scaling", f"{source}: lacks `factor`")
    out = {"rope_factor": value["factor"]}
    for src, dst in (("original_max_position_embeddings", "original_seq_len"), ("original_seq_len", "original_seq_len"),
                     ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
        if src in value:
            out[dst] = value[src]
    return out


def _object(value: Any, key: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(key, f"{source}: must be a JSON object, got {type(value).__name__}")
    return value


def config_from_dict(raw: dict[str, Any], *, source: str = "config", name: str = "custom") -> ModelConfig:
    """Build a config from an HF `config.json` dict (flat or `text_config`-nested) or a flat
    `inference/config.json` dict; keys the dict lacks keep the values of the release of the same
    model type."""
    raw = _object(raw, "(top level)", source)
    text = dict(_object(raw.get("text_config", {}), "text_config", source))
    top = {k: v for k, v in raw.items() if k != "text_config"}
    quant = top.get("quantization_config") or text.get("quantization_config") or {}
    merged = {**{k: v for k, v in top.items() if k not in text}, **text}
    values = _canonical(merged, source)
    if quant:
        quant = _object(quant, "quantization_config", source)
        if "weight_block_size" in quant:
            block = quant["weight_block_size"]
            values["weight_block_size"] = tuple(block) if isinstance(block, list) else block
        if "expert_dtype" in quant:
            values["expert_dtype"] = quant["expert_dtype"]
    model_type = values.get("model_type") or _infer_model_type(values)
    base = DEEPSEEK_V4_FLASH if model_type == "deepseek_v4" else DEEPSEEK_V41_FLASH
    values.update(model_type=model_type, name=name)
    values.setdefault("dtype", "bfloat16")
    return dataclasses.replace(base, **values)


def _infer_model_type(values: dict[str, Any]) -> str:
    """The flat `inference/config.json` carries no model type: V4 has hash layers and ratios 4/128."""
    ratios = values.get("compress_ratios", ())
    if values.get("num_hash_layers") or any(_is_int(r) and r >= 4 for r in (ratios if isinstance(ratios, tuple) else ())):
        return "deepseek_v4"
    return "deepseek_v41"


def load_config(name_or_path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """A preset name, a checkpoint directory, or a path to a `config.json`.

    In a directory, `config.json` (HF names) wins over `inference/config.json` (flat names).
    `overrides` replace fields afterwards (e.g. `fake_quant=False`, `dtype="float32"`).
    """
    key = str(name_or_path)
    if key in PRESETS:
        config = PRESETS[key]
    else:
        path = os.fspath(name_or_path)
        if os.path.isdir(path):
            for candidate in ("config.json", os.path.join("inference", "config.json")):
                if os.path.isfile(os.path.join(path, candidate)):
                    path = os.path.join(path, candidate)
                    break
            else:
                raise FileNotFoundError(
                    f"{name_or_path}: no config.json or inference/config.json in this directory"
                )
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config file"
            )
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        try:
            config = config_from_dict(raw, source=path, name=os.path.basename(os.path.dirname(os.path.abspath(path))))
        except ConfigError as e:
            raise (e if path in str(e) else ConfigError(f"{path}: {e}")) from None
    return dataclasses.replace(config, **overrides) if overrides else config


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The HF-style `config.json` written next to a checkpoint (text_config nesting)."""
    text = config.to_dict()
    for k in ("name", "fake_quant", "dtype", "weight_block_size", "expert_dtype", "model_type"):
        text.pop(k)
    text["model_type"] = config.model_type + "_text"
    return {
        "architectures": ["DeepseekV4ForCausalLM" if config.is_v4 else "DeepseekV41ForCausalLM"],
        "torch_dtype": config.dtype,
        "model_type": config.model_type,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(config.weight_block_size),
            "scale_fmt": "ue8m0",
            "expert_dtype": config.expert_dtype,
        },
        "text_config": text,
    }
