"""One definition per weight: official name, shape, storage format, logical axes, initialiser.

Everything else derives from `param_specs(config)`: random init, the abstract (shape-only) tree,
shardings, the official checkpoint name map and the orbax layout. The params pytree mirrors the
official tensor names: `layers.3.attn.wq_a.weight` lives at `params["layers"][3]["attn"]["wq_a"]`,
so the name map is the identity except for routed experts, which the tree stacks along a leading
expert axis (`ffn.experts.{e}.w1` -> `params[...]["ffn"]["experts"]["w1"][e]`).

A leaf is either a plain array (dense, in the compute dtype) or a `QuantWeight` holding the
checkpoint's quantized form (FP8 e4m3 + UE8M0 block scales, or MXFP4 packed nibbles + UE8M0
scales per 32), dequantized at use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.ops.quant_weight import FP4, FP8, FP8_ROWS, QuantWeight  # noqa: F401  (storage kinds of ParamSpec)

# storage formats of the official checkpoint
BF16 = "bf16"
F32 = "f32"
I64 = "i64"  # integer tables (V4's tid2eid); int32 in the params


@dataclass(frozen=True)
class ParamSpec:
    """A tensor of the official checkpoint as the model uses it."""

    name: str  # official name without the ".weight" suffix, e.g. "layers.3.attn.wq_a"
    shape: tuple[int, ...]  # logical (dequantized) shape; stacked experts lead with E
    storage: str  # FP8 | FP8_ROWS | FP4 | BF16 | F32
    axes: tuple[str | None, ...]  # logical axis names, one per dim of `shape`
    init: str = "normal"  # normal | ones | zeros | sink | small
    has_weight_suffix: bool = True  # `attn_sink`, `hc_*` and gate biases have no ".weight"
    experts: int = 0  # > 0: stacked over routed experts (checkpoint stores one tensor per expert)

    @property
    def path(self) -> tuple[str | int, ...]:
        """Where the leaf sits in the params tree. The router's weight sits beside its biases
        (`ffn.gate.weight`, `ffn.gate.bias`), so its path keeps the `weight` key."""
        parts: list[str | int] = [int(p) if p.isdigit() else p for p in self.name.split(".")]
        if parts[-1] == "gate" and parts[-2] == "ffn":
            parts.append("weight")
        return tuple(parts)


def _block_specs(c: ModelConfig, p: str, layer: int) -> list[ParamSpec]:
    """Norms, mHC and the attention core every block has (backbone layers and the MTP block)."""
    D, hd, H = c.hidden_size, c.head_dim, c.num_attention_heads
    hc = c.hc_mult
    mix = (2 + hc) * hc
    return [
        ParamSpec(p + "attn_norm", (D,), BF16, ("embed",), "ones"),
        ParamSpec(p + "ffn_norm", (D,), BF16, ("embed",), "ones"),
        ParamSpec(p + "hc_attn_fn", (mix, hc * D), F32, (None, "hc_embed"), "small", False),
        ParamSpec(p + "hc_attn_base", (mix,), F32, (None,), "small", False),
        ParamSpec(p + "hc_attn_scale", (3,), F32, (None,), "ones", False),
        ParamSpec(p + "hc_ffn_fn", (mix, hc * D), F32, (None, "hc_embed"), "small", False),
        ParamSpec(p + "hc_ffn_base", (mix,), F32, (None,), "small", False),
        ParamSpec(p + "hc_ffn_scale", (3,), F32, (None,), "ones", False),
        ParamSpec(p + "attn.wq_a", (c.q_lora_rank, D), FP8, ("q_lora", "embed")),
        ParamSpec(p + "attn.q_norm", (c.q_lora_rank,), BF16, ("q_lora",), "ones"),
        ParamSpec(p + "attn.wq_b", (H * hd, c.q_lora_rank), FP8, ("heads", "q_lora")),
        ParamSpec(p + "attn.wkv", (hd, D), FP8, ("kv", "embed")),
        ParamSpec(p + "attn.kv_norm", (hd,), BF16, ("kv",), "ones"),
        ParamSpec(p + "attn.wo_a", (c.o_groups * c.o_lora_rank, H * hd // c.o_groups), FP8, ("o_lora", None)),
        ParamSpec(p + "attn.wo_b", (D, c.o_groups * c.o_lora_rank), FP8, ("embed", "o_lora")),
        ParamSpec(p + "attn.attn_sink", (H,), F32, ("heads_only",), "sink", False),
    ]


def _v4_compressor_specs(c: ModelConfig, p: str, ratio: int, width: int) -> list[ParamSpec]:
    """A V4 compressor (main at head_dim, indexer at index_head_dim): CSA (ratio 4) projects two
    halves per token for its overlapping windows; `ape` is a per-slot score bias."""
    halves = 2 if ratio == 4 else 1
    return [
        ParamSpec(p + "wkv", (halves * width, c.hidden_size), BF16, (None, "embed")),
        ParamSpec(p + "wgate", (halves * width, c.hidden_size), BF16, (None, "embed")),
        ParamSpec(p + "ape", (ratio, halves * width), F32, (None, None), "sink", False),
        ParamSpec(p + "norm", (width,), BF16, (None,), "ones"),
    ]


def _layer_specs(c: ModelConfig, i: int) -> list[ParamSpec]:
    D, hd = c.hidden_size, c.head_dim
    hc = c.hc_mult
    p = f"layers.{i}."
    specs = _block_specs(c, p, i)
    ratio = c.compress_ratios[i]
    if c.is_v4 and ratio:
        specs += _v4_compressor_specs(c, p + "attn.compressor.", ratio, hd)
        if ratio == 4:
            specs += [
                ParamSpec(p + "attn.indexer.wq_b", (c.index_n_heads * c.index_head_dim, c.q_lora_rank), FP8,
                          (None, "q_lora")),
                ParamSpec(p + "attn.indexer.weights_proj", (c.index_n_heads, D), BF16, (None, "embed")),
            ]
            specs += _v4_compressor_specs(c, p + "attn.indexer.compressor.", ratio, c.index_head_dim)
    if not c.is_v4 and i in c.kv_source_layer_ids:
        specs += [
            ParamSpec(p + "attn.compressor.wkv", (hd, D), BF16, ("kv", "embed")),
            ParamSpec(p + "attn.compressor.norm", (hd,), BF16, ("kv",), "ones"),
            ParamSpec(p + "attn.indexer.wk", (c.index_head_dim, hd), BF16, (None, "kv")),
            ParamSpec(p + "attn.indexer.k_norm", (c.index_head_dim,), BF16, (None,), "ones"),
        ]
        if c.compress_ratios[i] > 1:
            specs.append(ParamSpec(p + "attn.compressor.wgate", (hd, D), BF16, ("kv", "embed")))
    if not c.is_v4 and i in c.index_source_layer_ids:
        specs += [
            ParamSpec(
                p + "attn.indexer.wq_b", (c.index_n_heads * c.index_head_dim, c.q_lora_rank), FP8, (None, "q_lora")
            ),
            ParamSpec(p + "attn.indexer.weights_proj", (c.index_n_heads, D), BF16, (None, "embed")),
        ]
    specs += _moe_specs(c, p + "ffn.", c.n_routed_experts, hash_routed=c.is_hash_layer(i))
    if i in c.engram_layer_ids:
        k = c.engram_layer_ids.index(i)
        cols = c.n_hash_columns * c.engram_head_dim
        specs += [
            ParamSpec(p + "engram.embed", (c.engram_num_embeddings[k], c.engram_head_dim), FP8_ROWS, ("engram_rows", None)),
            ParamSpec(p + "engram.wkv", ((hc + 1) * D, cols), FP8, ("hc_embed", None)),
            ParamSpec(p + "engram.q_weight", (hc, D), BF16, (None, "embed"), "ones", False),
            ParamSpec(p + "engram.k_weight", (hc, D), BF16, (None, "embed"), "ones", False),
        ]
    return specs


def _hc_head_specs(c: ModelConfig, p: str) -> list[ParamSpec]:
    """V4's learned final collapse of the streams (no Sinkhorn, no post)."""
    hc = c.hc_mult
    return [
        ParamSpec(p + "hc_head_fn", (hc, hc * c.hidden_size), F32, (None, "hc_embed"), "small", False),
        ParamSpec(p + "hc_head_base", (hc,), F32, (None,), "small", False),
        ParamSpec(p + "hc_head_scale", (1,), F32, (None,), "ones", False),
    ]


def mtp_specs(c: ModelConfig) -> list[ParamSpec]:
    """V4's MTP block `mtp.0`: a window-only layer with a biased (non-hash) router, plus the
    projections that join the next token's embedding with the main model's streams."""
    D = c.hidden_size
    specs: list[ParamSpec] = []
    for k in range(c.num_nextn_predict_layers if c.is_v4 else 0):
        p = f"mtp.{k}."
        specs += _block_specs(c, p, c.num_hidden_layers + k)
        specs += _moe_specs(c, p + "ffn.", c.n_routed_experts, hash_routed=False)
        specs += [
            ParamSpec(p + "e_proj", (D, D), FP8, ("embed", None)),
            ParamSpec(p + "h_proj", (D, D), FP8, ("embed", None)),
            ParamSpec(p + "enorm", (D,), BF16, ("embed",), "ones"),
            ParamSpec(p + "hnorm", (D,), BF16, ("embed",), "ones"),
            ParamSpec(p + "norm", (D,), BF16, ("embed",), "ones"),
        ]
        specs += _hc_head_specs(c, p)
    return specs


def dspark_specs(c: ModelConfig) -> list[ParamSpec]:
    """V4.1's DSpark drafter `mtp.0..n-1`: window-only blocks with their own (smaller) MoE;
    `mtp.0` joins the target layers' stream means (`main_proj`, `main_norm`), the last block
    carries the final norm, the rank-r Markov head and the confidence head (model-v4.1-flash.md
    §2.9; vLLM `models/deepseek_v41/nvidia/dspark.py`)."""
    if c.is_v4 or not c.dspark_target_layer_ids:
        return []
    D, r, n = c.hidden_size, c.dspark_markov_rank, c.num_nextn_predict_layers
    specs: list[ParamSpec] = []
    for k in range(n):
        p = f"mtp.{k}."
        specs += _block_specs(c, p, c.num_hidden_layers + k)
        specs += _moe_specs(c, p + "ffn.", c.dspark_n_routed_experts)
    specs += [
        ParamSpec("mtp.0.main_proj", (D, len(c.dspark_target_layer_ids) * D), FP8, ("embed", None)),
        ParamSpec("mtp.0.main_norm", (D,), BF16, ("embed",), "ones"),
    ]
    last = f"mtp.{n - 1}."
    return specs + [
        ParamSpec(last + "norm", (D,), BF16, ("embed",), "ones"),
        ParamSpec(last + "markov_head.embed", (c.vocab_size, r), BF16, ("vocab", None), "markov_embed"),
        ParamSpec(last + "markov_head.head", (c.vocab_size, r), BF16, ("vocab", None)),
        ParamSpec(last + "confidence_head.proj", (1, D + r), BF16, (None, None)),
    ]


def _moe_specs(c: ModelConfig, p: str, n_experts: int, hash_routed: bool = False) -> list[ParamSpec]:
    D, F = c.hidden_size, c.moe_intermediate_size
    expert_storage = FP4 if c.expert_dtype == "fp4" else FP8
    specs = [ParamSpec(p + "gate", (n_experts, D), BF16, ("experts_only", "embed"))]
    if hash_routed:
        # token id -> expert ids (I64 on disk, int32 in the params: ids < 2^31)
        specs.append(ParamSpec(p + "gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), I64, ("vocab_only", None),
                               "expert_ids", False))
    else:
        specs.append(ParamSpec(p + "gate.bias", (n_experts,), F32, ("experts_only",), "small", False))
    if not c.is_v4:
        specs.append(ParamSpec(p + "gate.bias_vl", (n_experts,), F32, ("experts_only",), "small", False))
    specs += [
        ParamSpec(p + "experts.w1", (n_experts, F, D), expert_storage, ("experts", "ffw", "embed"), experts=n_experts),
        ParamSpec(p + "experts.w3", (n_experts, F, D), expert_storage, ("experts", "ffw", "embed"), experts=n_experts),
        ParamSpec(p + "experts.w2", (n_experts, D, F), expert_storage, ("experts", "embed", "ffw"), experts=n_experts),
    ]
    if c.n_shared_experts:
        specs += [
            ParamSpec(p + "shared_experts.w1", (F, D), FP8, ("ffw", "embed")),
            ParamSpec(p + "shared_experts.w3", (F, D), FP8, ("ffw", "embed")),
            ParamSpec(p + "shared_experts.w2", (D, F), FP8, ("embed", "ffw")),
        ]
    return specs


def param_specs(config: ModelConfig, include_mtp: bool = True) -> list[ParamSpec]:
    """Every tensor of the official checkpoint that the model uses: the text backbone and the
    draft blocks (`mtp.*`: V4's MTP block, V4.1's DSpark drafter); vision is not listed."""
    c = config
    specs = [
        ParamSpec("embed", (c.vocab_size, c.hidden_size), BF16, ("vocab", "embed"), "normal"),
        ParamSpec("head", (c.vocab_size, c.hidden_size), BF16, ("vocab", "embed"), "normal"),
        ParamSpec("norm", (c.hidden_size,), BF16, ("embed",), "ones"),
    ]
    if c.is_v4:
        specs += _hc_head_specs(c, "")
    for i in range(c.num_hidden_layers):
        specs += _layer_specs(c, i)
    if include_mtp:
        specs += mtp_specs(c) + dspark_specs(c)
    return specs


# ---- tree helpers ----------------------------------------------------------------------


def tree_get(tree: Any, path: tuple[str | int, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _tree_set(tree: dict, path: tuple[str | int, ...], value: Any) -> None:
    node: Any = tree
    for p, nxt in zip(path[:-1], path[1:]):
        if isinstance(p, int):
            while len(node) <= p:
                node.append({})
            node = node[p]
        else:
            if p not in node:
                node[p] = [] if isinstance(nxt, int) else {}
            node = node[p]
    node[path[-1]] = value


def build_tree(config: ModelConfig, leaf_fn, include_mtp: bool = True) -> dict:
    """A params tree with `leaf_fn(spec)` at each spec's path."""
    tree: dict = {}
    for spec in param_specs(config, include_mtp):
        _tree_set(tree, spec.path, leaf_fn(spec))
    return tree


def iter_specs_with_leaves(config: ModelConfig, params: dict) -> Iterator[tuple[ParamSpec, Any]]:
    for spec in param_specs(config):
        yield spec, tree_get(params, spec.path)


def compute_dtype(config: ModelConfig):
    return jnp.float32 if config.dtype == "float32" else jnp.bfloat16


def dense_dtype(spec: ParamSpec, config: ModelConfig):
    """The dtype a dense (dequantized) leaf is kept in: f32 tensors stay f32, id tables int32."""
    if spec.storage == I64:
        return jnp.int32
    return jnp.float32 if spec.storage == F32 else compute_dtype(config)


def _init_value(spec: ParamSpec, rng: np.random.Generator) -> np.ndarray:
    shape = spec.shape
    if spec.init == "ones":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if spec.init == "zeros":
        return np.zeros(shape)
    if spec.init == "sink":
        return rng.standard_normal(shape)
    if spec.init == "small":
        return 0.1 * rng.standard_normal(shape)
    if spec.init == "markov_embed":  # an embedding table: unit-variance rows
        return rng.standard_normal(shape)

    fan_in = shape[-1]
    return rng.standard_normal(shape) / np.sqrt(fan_in)


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random dense params (host RNG, deterministic per seed and tensor name), for tests, the
    tiny presets and benchmarks. Values are O(1)-scaled so every mechanism is exercised."""
    def leaf(spec: ParamSpec):
        rng = np.random.default_rng(np.random.SeedSequence([seed, *spec.name.encode()]))
        if spec.init == "expert_ids":  # distinct expert ids per token, as in the release
            order = np.argsort(rng.random((spec.shape[0], config.n_routed_experts)), axis=1)
            return jnp.asarray(order[:, : spec.shape[1]], dtype=jnp.int32)
        value = _init_value(spec, rng).astype(np.float32)
        return jnp.asarray(value, dtype=dense_dtype(spec, config))

    return build_tree(config, leaf)


def abstract_params(config: ModelConfig, quantized: bool = False, include_mtp: bool = True) -> dict:
    """Shape/dtype tree without allocating (dense or checkpoint-quantized form)."""
    def leaf(spec: ParamSpec):
        if quantized and spec.storage in (FP8, FP8_ROWS, FP4):
            return abstract_quant(spec, config)
        return jax.ShapeDtypeStruct(spec.shape, dense_dtype(spec, config))

    return build_tree(config, leaf, include_mtp)


def quant_block(spec: ParamSpec, config: ModelConfig) -> tuple[int, int]:
    return tuple(config.weight_block_size) if spec.storage == FP8 else (1, 32)


def quant_shapes(spec: ParamSpec, config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (q, scale) of a quantized leaf, stacked experts included."""
    *lead, n, k = spec.shape
    bn, bk = quant_block(spec, config)
    scale = (*lead, -(-n // bn), -(-k // bk))
    q = (*lead, n, k // 2) if spec.storage == FP4 else spec.shape
    return q, scale


def abstract_quant(spec: ParamSpec, config: ModelConfig) -> QuantWeight:
    q_shape, s_shape = quant_shapes(spec, config)
    q_dtype = jnp.int8 if spec.storage == FP4 else jnp.float8_e4m3fn
    return QuantWeight(
        jax.ShapeDtypeStruct(q_shape, q_dtype),
        jax.ShapeDtypeStruct(s_shape, jnp.float8_e8m0fnu),
        kind=spec.storage,
        block=quant_block(spec, config),
    )
