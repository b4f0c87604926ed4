"""HF-transformers oracle for DeepSeek-V4-Flash: a tiny random model, its official-format checkpoint,
and reference logits / greedy continuations.

Runs in the SIDE environment (Python 3.11 + torch 2.13.0 CPU + transformers 5.24.0 + safetensors +
numpy; see ``sideenv.py``). It must not import deepinfer or jax.

    python tests/oracle/hf_v4_oracle.py --out DIR --seed N [--prompt-lens 20,45] [--gen 32]

Steps:
1. Build a tiny ``DeepseekV4ForCausalLM`` (float32, CPU, eager) with every layer type: window-only,
   CSA (rate 4, overlapping, lightning indexer), HCA (rate 8 via ``compress_rates``), 2 hash-routed
   MoE layers, YaRN on the compressed layers.
2. Draw random master weights under the OFFICIAL tensor names (scaled so activations are O(1), the
   SwiGLU clamps sometimes bind, and sinks / ape / gate bias / tid2eid / hc scales are non-trivial),
   quantise them as the release does (FP8 e4m3 + UE8M0 128x128 block scales; routed experts MXFP4 with
   UE8M0 scales per 32 inputs; BF16 / F32 / I64 elsewhere), and write ``DIR/model-0000k-of-0000n
   .safetensors`` + ``model.safetensors.index.json`` + an official-style ``config.json``.
3. Load exactly the dequantised (or BF16-rounded) values into the HF model.
4. Save ``DIR/logits.npz``: ``ids_i`` (int64 [T]), ``logits_i`` (float32 [T, vocab]) from one
   full no-cache forward per prompt; ``greedy_i`` (int64 [gen]) from repeated no-cache full forwards
   (argmax of the last row, append, repeat); ``greedy_logits_i`` (float32 [T+gen-1, vocab]), the full
   forward over prompt + continuation without its last token (row T-1+k predicted greedy[k]).
5. Check that HF's cached prefill + one-token decode equals its full forward on the longest prompt,
   that HF's YaRN frequencies equal the spec formula, and report near-ties (indexer top-k, router top-k,
   greedy argmax), SwiGLU clamp activity and activation scales in ``DIR/oracle_meta.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

if "deepinfer" in sys.modules or "jax" in sys.modules:  # pragma: no cover - sanity
    raise RuntimeError("the oracle must not import deepinfer or jax")

# ---------------------------------------------------------------------------------------------
# Tiny configuration
# ---------------------------------------------------------------------------------------------

CSA_RATE = 4
HCA_RATE = 8
# per main layer: 0 = window only, 4 = CSA, 8 = HCA (HF legacy value 128 + compress_rates)
LAYER_RATIOS = [0, CSA_RATE, HCA_RATE, CSA_RATE, HCA_RATE, 0]

TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    num_hidden_layers=len(LAYER_RATIOS),
    num_nextn_predict_layers=1,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    num_hash_layers=2,
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_factor=16.0,
    original_max_position_embeddings=65536,
    beta_fast=32.0,
    beta_slow=1.0,
    max_position_embeddings=1048576,
    swiglu_limit=10.0,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    bos_token_id=0,
    eos_token_id=1,
)

FP8_BLOCK = 128
FP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def hf_config(t: dict) -> DeepseekV4Config:
    hf_ratio = {0: 0, CSA_RATE: 4, HCA_RATE: 128}  # HF legacy values; the real rates come from compress_rates
    cfg = DeepseekV4Config(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        num_hidden_layers=t["num_hidden_layers"],
        num_nextn_predict_layers=t["num_nextn_predict_layers"],
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        qk_rope_head_dim=t["qk_rope_head_dim"],
        q_lora_rank=t["q_lora_rank"],
        o_groups=t["o_groups"],
        o_lora_rank=t["o_lora_rank"],
        n_routed_experts=t["n_routed_experts"],
        num_experts_per_tok=t["num_experts_per_tok"],
        n_shared_experts=t["n_shared_experts"],
        moe_intermediate_size=t["moe_intermediate_size"],
        num_hash_layers=t["num_hash_layers"],
        compress_ratios=[hf_ratio[r] for r in LAYER_RATIOS],
        compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
        sliding_window=t["sliding_window"],
        index_n_heads=t["index_n_heads"],
        index_head_dim=t["index_head_dim"],
        index_topk=t["index_topk"],
        hc_mult=t["hc_mult"],
        hc_sinkhorn_iters=t["hc_sinkhorn_iters"],
        hc_eps=t["hc_eps"],
        rms_norm_eps=t["rms_norm_eps"],
        rope_theta=t["rope_theta"],
        compress_rope_theta=t["compress_rope_theta"],
        rope_parameters={
            "rope_type": "yarn",
            "factor": t["rope_factor"],
            "original_max_position_embeddings": t["original_max_position_embeddings"],
            "beta_fast": t["beta_fast"],
            "beta_slow": t["beta_slow"],
        },
        max_position_embeddings=t["max_position_embeddings"],
        swiglu_limit=t["swiglu_limit"],
        scoring_func=t["scoring_func"],
        norm_topk_prob=t["norm_topk_prob"],
        routed_scaling_factor=t["routed_scaling_factor"],
        bos_token_id=t["bos_token_id"],
        eos_token_id=t["eos_token_id"],
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the plain per-expert loop of modeling_deepseek_v4 (not grouped_mm)
    return cfg


def official_config(t: dict) -> dict:
    """An official-style ``config.json`` (the key set of the DeepSeek-V4-Flash release)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "tie_word_embeddings": False,
        "vocab_size": t["vocab_size"],
        "hidden_size": t["hidden_size"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_nextn_predict_layers": t["num_nextn_predict_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"],
        "qk_rope_head_dim": t["qk_rope_head_dim"],
        "q_lora_rank": t["q_lora_rank"],
        "o_groups": t["o_groups"],
        "o_lora_rank": t["o_lora_rank"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": t["sliding_window"],
        "max_position_embeddings": t["max_position_embeddings"],
        "rope_theta": t["rope_theta"],
        "compress_rope_theta": t["compress_rope_theta"],
        "rope_scaling": {
            "type": "yarn",
            "factor": t["rope_factor"],
            "original_max_position_embeddings": t["original_max_position_embeddings"],
            "beta_fast": t["beta_fast"],
            "beta_slow": t["beta_slow"],
        },
        # main layers, then one 0 per MTP layer (no mtp.* tensors are written: HF has no MTP)
        "compress_ratios": list(LAYER_RATIOS) + [0] * t["num_nextn_predict_layers"],
        "index_n_heads": t["index_n_heads"],
        "index_head_dim": t["index_head_dim"],
        "index_topk": t["index_topk"],
        "hc_mult": t["hc_mult"],
        "hc_sinkhorn_iters": t["hc_sinkhorn_iters"],
        "hc_eps": t["hc_eps"],
        "n_routed_experts": t["n_routed_experts"],
        "n_shared_experts": t["n_shared_experts"],
        "num_experts_per_tok": t["num_experts_per_tok"],
        "moe_intermediate_size": t["moe_intermediate_size"],
        "num_hash_layers": t["num_hash_layers"],
        "scoring_func": t["scoring_func"],
        "topk_method": "noaux_tc",
        "norm_topk_prob": t["norm_topk_prob"],
        "routed_scaling_factor": t["routed_scaling_factor"],
        "swiglu_limit": t["swiglu_limit"],
        "hidden_act": "silu",
        "rms_norm_eps": t["rms_norm_eps"],
        "initializer_range": 0.02,
        "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"],
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
    }


# ---------------------------------------------------------------------------------------------
# Official tensor table: name -> (storage kind, shape, init std or rule), and the HF name map
# ---------------------------------------------------------------------------------------------
# storage kinds: "fp8" (F8_E4M3 + .scale F8_E8M0 128x128), "fp4" (I8 packed e2m1 + .scale F8_E8M0 per 32),
# "bf16", "f32", "i64"


def official_tensors(t: dict) -> list[tuple[str, str, tuple[int, ...], str, float]]:
    """(official name, storage, shape, init kind, init parameter) for every checkpoint tensor."""
    d, V = t["hidden_size"], t["vocab_size"]
    H, D = t["num_attention_heads"], t["head_dim"]
    ql, g, ol = t["q_lora_rank"], t["o_groups"], t["o_lora_rank"]
    E, I, k = t["n_routed_experts"], t["moe_intermediate_size"], t["num_experts_per_tok"]
    nI, DI = t["index_n_heads"], t["index_head_dim"]
    nhc = t["hc_mult"]
    nmix = (2 + nhc) * nhc
    out = [
        ("embed.weight", "bf16", (V, d), "normal", 1.0),
        ("head.weight", "bf16", (V, d), "normal", 2.0 / math.sqrt(d)),
        ("norm.weight", "bf16", (d,), "norm", 0.0),
        ("hc_head_fn", "f32", (nhc, nhc * d), "normal", 1.0 / math.sqrt(nhc * d)),
        ("hc_head_base", "f32", (nhc,), "normal", 0.5),
        ("hc_head_scale", "f32", (1,), "uniform", (0.5, 1.5)),
    ]
    for L, ratio in enumerate(LAYER_RATIOS):
        p = f"layers.{L}."
        out += [
            (p + "attn_norm.weight", "bf16", (d,), "norm", 0.0),
            (p + "ffn_norm.weight", "bf16", (d,), "norm", 0.0),
        ]
        for hc in ("attn", "ffn"):
            out += [
                (p + f"hc_{hc}_fn", "f32", (nmix, nhc * d), "normal", 1.0 / math.sqrt(nhc * d)),
                (p + f"hc_{hc}_base", "f32", (nmix,), "normal", 0.5),
                (p + f"hc_{hc}_scale", "f32", (3,), "uniform", (0.5, 1.5)),
            ]
        a = p + "attn."
        out += [
            (a + "wq_a.weight", "fp8", (ql, d), "normal", 1.0 / math.sqrt(d)),
            (a + "q_norm.weight", "bf16", (ql,), "norm", 0.0),
            (a + "wq_b.weight", "fp8", (H * D, ql), "normal", 1.0 / math.sqrt(ql)),
            (a + "wkv.weight", "fp8", (D, d), "normal", 1.0 / math.sqrt(d)),
            (a + "kv_norm.weight", "bf16", (D,), "norm", 0.0),
            (a + "wo_a.weight", "fp8", (g * ol, H * D // g), "normal", 1.0 / math.sqrt(H * D // g)),
            (a + "wo_b.weight", "fp8", (d, g * ol), "normal", 2.0 / math.sqrt(g * ol)),
            (a + "attn_sink", "f32", (H,), "normal", 0.7),
        ]
        if ratio:
            c = 2 if ratio == CSA_RATE else 1  # overlapping (CSA) compressors project to 2 series
            cp = a + "compressor."
            out += [
                (cp + "wkv.weight", "bf16", (c * D, d), "normal", 1.0 / math.sqrt(d)),
                (cp + "wgate.weight", "bf16", (c * D, d), "normal", 1.5 / math.sqrt(d)),
                (cp + "ape", "f32", (ratio, c * D), "normal", 0.7),
                (cp + "norm.weight", "bf16", (D,), "norm", 0.0),
            ]
            if ratio == CSA_RATE:
                ip = a + "indexer."
                out += [
                    (ip + "wq_b.weight", "fp8", (nI * DI, ql), "normal", 1.0 / math.sqrt(ql)),
                    (ip + "weights_proj.weight", "bf16", (nI, d), "normal", 1.0 / math.sqrt(d)),
                    (ip + "compressor.wkv.weight", "bf16", (2 * DI, d), "normal", 1.0 / math.sqrt(d)),
                    (ip + "compressor.wgate.weight", "bf16", (2 * DI, d), "normal", 1.5 / math.sqrt(d)),
                    (ip + "compressor.ape", "f32", (ratio, 2 * DI), "normal", 0.7),
                    (ip + "compressor.norm.weight", "bf16", (DI,), "norm", 0.0),
                ]
        f = p + "ffn."
        out.append((f + "gate.weight", "bf16", (E, d), "normal", 1.5 / math.sqrt(d)))
        if L < t["num_hash_layers"]:
            out.append((f + "gate.tid2eid", "i64", (V, k), "tid2eid", 0.0))
        else:
            out.append((f + "gate.bias", "f32", (E,), "normal", 0.3))
        for e in range(E):
            ep = f + f"experts.{e}."
            out += [
                (ep + "w1.weight", "fp4", (I, d), "normal", 4.0 / math.sqrt(d)),
                (ep + "w2.weight", "fp4", (d, I), "normal", 0.08 / math.sqrt(I)),
                (ep + "w3.weight", "fp4", (I, d), "normal", 4.0 / math.sqrt(d)),
            ]
        sp = f + "shared_experts."
        out += [
            (sp + "w1.weight", "fp8", (I, d), "normal", 4.0 / math.sqrt(d)),
            (sp + "w2.weight", "fp8", (d, I), "normal", 0.08 / math.sqrt(I)),
            (sp + "w3.weight", "fp8", (I, d), "normal", 4.0 / math.sqrt(d)),
        ]
    return out


# Official -> HF names. Expert w1/w3/w2 are special-cased (they are slices of stacked HF tensors).
_TOP_MAP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}


def hf_target(name: str, I: int):
    """Official name -> (HF name, index expression) where the index selects a slice of a stacked tensor."""
    if name in _TOP_MAP:
        return _TOP_MAP[name], None
    parts = name.split(".")
    assert parts[0] == "layers", name
    L = int(parts[1])
    rest = ".".join(parts[2:])
    pre = f"model.layers.{L}."
    if rest.startswith("ffn.experts."):
        e, w = int(parts[4]), parts[5]
        if w == "w1":  # gate: first half of gate_up_proj (HF _apply_gate: gate, up = chunk(2))
            return pre + "mlp.experts.gate_up_proj", (e, slice(0, I))
        if w == "w3":  # up: second half
            return pre + "mlp.experts.gate_up_proj", (e, slice(I, 2 * I))
        if w == "w2":
            return pre + "mlp.experts.down_proj", (e,)
        raise KeyError(name)
    return pre + _LAYER_MAP[rest], None


# ---------------------------------------------------------------------------------------------
# Quantisation (release formats)
# ---------------------------------------------------------------------------------------------


def _pow2_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """2^ceil(log2(amax / qmax)) as float64, with amax floored at 1e-4."""
    return np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-4) / qmax)))


def _e8m0_bytes(scale: np.ndarray) -> np.ndarray:
    e = np.log2(scale)
    assert np.all(e == np.round(e)) and np.all(np.abs(e) < 127), "scale is not a representable power of two"
    return (np.round(e).astype(np.int64) + 127).astype(np.uint8)


def quant_fp8_blocks(w: np.ndarray):
    """FP8 e4m3 with UE8M0 [ceil(out/128), ceil(in/128)] block scales -> (e4m3 bytes, scale bytes, dequant f32)."""
    out_f, in_f = w.shape
    bo, bi = -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)
    pad = np.zeros((bo * FP8_BLOCK, bi * FP8_BLOCK), np.float64)
    pad[:out_f, :in_f] = np.abs(w)
    amax = pad.reshape(bo, FP8_BLOCK, bi, FP8_BLOCK).max(axis=(1, 3))
    scale = _pow2_scale(amax, E4M3_MAX)  # [bo, bi]
    full = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[:out_f, :in_f]
    x = torch.from_numpy((w / full).astype(np.float32))
    assert float(x.abs().max()) <= E4M3_MAX
    q = x.to(torch.float8_e4m3fn)  # round to nearest even
    deq = (q.to(torch.float64).numpy() * full).astype(np.float32)
    return q.view(torch.uint8).numpy(), _e8m0_bytes(scale), deq


def _e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Round |x| <= 6 to the nearest e2m1 value (ties to the even code); returns 4-bit codes."""
    a = np.abs(x.astype(np.float64))
    mids = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    lo = np.searchsorted(mids, a, side="left")  # ties round down
    hi = np.searchsorted(mids, a, side="right")  # ties round up
    idx = np.where((lo != hi) & (lo % 2 == 1), hi, lo)  # on a tie, take the even code
    sign = (x < 0).astype(np.uint8) << 3
    return idx.astype(np.uint8) | sign


def quant_mxfp4(w: np.ndarray):
    """MXFP4: int8 [out, in/2] (even input in the LOW nibble) + UE8M0 [out, in/32] -> (bytes, scale, dequant)."""
    out_f, in_f = w.shape
    assert in_f % FP4_BLOCK == 0, w.shape
    blocks = w.reshape(out_f, in_f // FP4_BLOCK, FP4_BLOCK).astype(np.float64)
    scale = _pow2_scale(np.abs(blocks).max(axis=2), E2M1_MAX)  # [out, in/32]
    codes = _e2m1_codes(blocks / scale[..., None]).reshape(out_f, in_f)
    vals = E2M1_GRID[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    deq = (vals.reshape(out_f, in_f // FP4_BLOCK, FP4_BLOCK) * scale[..., None]).reshape(out_f, in_f)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, _e8m0_bytes(scale), deq.astype(np.float32)


def bf16_round(w: np.ndarray):
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy(), t.to(torch.float32).numpy()


# ---------------------------------------------------------------------------------------------
# safetensors writing (hand-rolled: F8_E8M0 / F8_E4M3 byte-exact, no dependence on library dtype support)
# ---------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> int:
    """tensors: name -> (safetensors dtype string, shape, raw array whose bytes are the data)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        dtype, shape, arr = tensors[name]
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
    return offset


def shard_of(name: str, n_layers: int) -> int:
    """Shard 0: embed + layers 0,1; then two layers per shard; last shard: head, norm, hc_head."""
    if name.startswith("embed"):
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) // 2
    return (n_layers + 1) // 2  # head / norm / hc_head_*


# ---------------------------------------------------------------------------------------------
# Build, quantise, write, load
# ---------------------------------------------------------------------------------------------


def draw_master(t: dict, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    master = {}
    for name, kind, shape, init, p in official_tensors(t):
        if init == "normal":
            w = rng.standard_normal(shape) * p
        elif init == "uniform":
            w = rng.uniform(p[0], p[1], shape)
        elif init == "norm":
            w = rng.uniform(0.8, 1.2, shape)
        elif init == "tid2eid":  # distinct expert ids per row, as in real checkpoints
            V, k = shape
            w = np.argsort(rng.random((V, t["n_routed_experts"])), axis=1)[:, :k].astype(np.int64)
        else:
            raise ValueError(init)
        master[name] = (kind, w)
    return master


def quantise_and_write(t: dict, master: dict, out: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Write the official checkpoint; return official name -> the value the HF model must use."""
    shards: dict[int, dict] = {}
    used: dict[str, np.ndarray] = {}
    for name, (kind, w) in master.items():
        sh = shards.setdefault(shard_of(name, t["num_hidden_layers"]), {})
        if kind == "fp8":
            q, s, deq = quant_fp8_blocks(w)
            sh[name] = ("F8_E4M3", q.shape, q)
            sh[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", s.shape, s)
            used[name] = deq
        elif kind == "fp4":
            q, s, deq = quant_mxfp4(w)
            sh[name] = ("I8", q.shape, q)
            sh[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", s.shape, s)
            used[name] = deq
        elif kind == "bf16":
            raw, val = bf16_round(w)
            sh[name] = ("BF16", raw.shape, raw)
            used[name] = val
        elif kind == "f32":
            val = np.asarray(w, np.float32)
            sh[name] = ("F32", val.shape, val)
            used[name] = val
        elif kind == "i64":
            val = np.asarray(w, np.int64)
            sh[name] = ("I64", val.shape, val)
            used[name] = val
        else:
            raise ValueError(kind)
    n = len(shards)
    weight_map, total = {}, 0
    for i, key in enumerate(sorted(shards)):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        total += write_safetensors(out / fname, shards[key])
        for name in shards[key]:
            weight_map[name] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(official_config(t), indent=2) + "\n")
    return used, {"n_shards": n, "n_tensors": len(weight_map), "total_bytes": total}


def load_into_hf(model, t: dict, used: dict[str, np.ndarray]) -> dict[str, str]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    filled: dict[str, torch.Tensor] = {}
    name_map: dict[str, str] = {}
    I = t["moe_intermediate_size"]
    for name, val in used.items():
        hf_name, idx = hf_target(name, I)
        if hf_name not in sd:
            raise KeyError(f"{name} maps to {hf_name}, which the HF model does not have")
        dst = filled.setdefault(hf_name, torch.full_like(sd[hf_name], float("nan"))
                                if sd[hf_name].is_floating_point() else torch.full_like(sd[hf_name], -1))
        src = torch.from_numpy(np.ascontiguousarray(val)).to(dst.dtype)
        view = dst if idx is None else dst[idx]
        if tuple(view.shape) != tuple(src.shape):
            raise ValueError(f"{name} {tuple(src.shape)} does not fit {hf_name}{'' if idx is None else idx} "
                             f"{tuple(view.shape)}")
        view.copy_(src)
        name_map[name] = hf_name + ("" if idx is None else _idx_str(idx))
    missing = sorted(set(sd) - set(filled))
    if missing:
        raise KeyError(f"HF tensors not covered by the official checkpoint: {missing}")
    for k, v in filled.items():
        bad = torch.isnan(v).any() if v.is_floating_point() else (v < 0).any()
        if bad:
            raise ValueError(f"{k} was only partly filled")
    model.load_state_dict(filled, strict=True)
    return name_map


_E2M1_LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
_ST_NP = {"BF16": np.uint16, "F32": np.float32, "I64": np.int64, "I8": np.int8, "F8_E4M3": np.uint8,
          "F8_E8M0": np.uint8}


def read_back(out: Path) -> dict[str, np.ndarray]:
    """Re-read the written checkpoint through the index and dequantise it per spec §1.4 (float64)."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for fname in sorted(set(index["weight_map"].values())):
        blob = (out / fname).read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        header.pop("__metadata__", None)
        base = 8 + n
        for name, e in header.items():
            b0, b1 = e["data_offsets"]
            arr = np.frombuffer(blob[base + b0:base + b1], dtype=_ST_NP[e["dtype"]]).reshape(e["shape"])
            raw[name] = (e["dtype"], arr)
            if index["weight_map"].get(name) != fname:
                raise SystemExit(f"FAIL: index maps {name} to {index['weight_map'].get(name)}, found in {fname}")
    if set(raw) != set(index["weight_map"]):
        raise SystemExit("FAIL: index and shard contents differ")
    dense: dict[str, np.ndarray] = {}
    for name, (dt, arr) in raw.items():
        if name.endswith(".scale") and dt == "F8_E8M0":
            continue
        if dt == "BF16":
            dense[name] = (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif dt in ("F32", "I64"):
            dense[name] = arr.astype(np.float64) if dt == "F32" else arr
        elif dt == "F8_E4M3":
            s = np.exp2(raw[name.removesuffix(".weight") + ".scale"][1].astype(np.float64) - 127)
            v = torch.from_numpy(arr.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()
            full = np.repeat(np.repeat(s, FP8_BLOCK, 0), FP8_BLOCK, 1)[:v.shape[0], :v.shape[1]]
            dense[name] = v * full
        elif dt == "I8":
            s = np.exp2(raw[name.removesuffix(".weight") + ".scale"][1].astype(np.float64) - 127)
            u = arr.view(np.uint8)
            codes = np.stack([u & 0xF, u >> 4], axis=-1).reshape(u.shape[0], -1)  # low nibble = even column
            dense[name] = _E2M1_LUT[codes] * np.repeat(s, FP4_BLOCK, axis=1)
        else:
            raise SystemExit(f"FAIL: unexpected dtype {dt} for {name}")
    return dense


def check_read_back(model, t: dict, out: Path) -> None:
    """The checkpoint, dequantised independently, must equal the HF model's weights exactly."""
    sd = model.state_dict()
    dense = read_back(out)
    I = t["moe_intermediate_size"]
    for name, val in dense.items():
        hf_name, idx = hf_target(name, I)
        ref = sd[hf_name] if idx is None else sd[hf_name][idx]
        ref = ref.numpy().astype(np.float64) if ref.is_floating_point() else ref.numpy()
        if ref.shape != val.shape or not np.array_equal(ref, val):
            raise SystemExit(f"FAIL: checkpoint tensor {name} != HF {hf_name} after dequantisation")
    print(f"[oracle] read-back: {len(dense)} dequantised checkpoint tensors equal the HF weights exactly")


def _idx_str(idx) -> str:
    parts = []
    for i in idx:
        parts.append(f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i))
    return "[" + ", ".join(parts) + "]"


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def yarn_inv_freq(base: float, dim: int, factor: float, orig: int, beta_fast: float, beta_slow: float) -> np.ndarray:
    """Spec §2.3 (REF precompute_freqs_cis), in float64."""
    f = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)

    def corr(n):
        return dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / max(high - low, 1e-3), 0, 1)
    return f * (1 - ramp) + f / factor * ramp


def check_rope(model, t: dict) -> dict:
    rot = model.model.rotary_emb
    rd = t["qk_rope_head_dim"]
    want_c = yarn_inv_freq(t["compress_rope_theta"], rd, t["rope_factor"], t["original_max_position_embeddings"],
                           t["beta_fast"], t["beta_slow"])
    want_m = t["rope_theta"] ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    got_c = rot.compress_inv_freq.double().numpy()
    got_m = rot.main_inv_freq.double().numpy()
    err_c = float(np.max(np.abs(got_c - want_c) / want_c))
    err_m = float(np.max(np.abs(got_m - want_m) / want_m))
    scal = (float(rot.compress_attention_scaling), float(rot.main_attention_scaling))
    print(f"[oracle] rope: compress inv_freq rel err {err_c:.2e}, main {err_m:.2e}, attention scaling {scal}")
    if err_c > 1e-6 or err_m > 1e-6 or scal != (1.0, 1.0):
        raise SystemExit("FAIL: HF rotary frequencies differ from the spec YaRN formula")
    return {"compress_inv_freq_rel_err": err_c, "main_inv_freq_rel_err": err_m}


@torch.inference_mode()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].float()


@torch.inference_mode()
def instrumented_forward(model, t: dict, ids: list[int]) -> dict:
    """One no-cache forward with hooks: indexer/router top-k margins, clamp activity, activation scales."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    stats = {"indexer_min_margin": math.inf, "indexer_queries_selecting": 0, "indexer_exact_ties": 0,
             "router_min_margin": math.inf, "clamp": {}, "act_rms": {}}
    hooks = []
    k_idx, k_moe, lim = t["index_topk"], t["num_experts_per_tok"], t["swiglu_limit"]
    pos = torch.arange(len(ids))

    def scorer_hook(mod, inp, out):  # out: [B, S, T] raw index scores
        T = out.shape[-1]
        thr = ((pos + 1) // CSA_RATE).tolist()
        for s, n_valid in enumerate(thr):
            n_valid = min(n_valid, T)
            if n_valid <= k_idx:
                continue
            v = torch.sort(out[0, s, :n_valid].double(), descending=True).values
            margin = float(v[k_idx - 1] - v[k_idx])
            stats["indexer_queries_selecting"] += 1
            stats["indexer_exact_ties"] += int(margin == 0.0)
            stats["indexer_min_margin"] = min(stats["indexer_min_margin"], margin)

    def router_hook(mod, inp, out):
        x = inp[0].reshape(-1, mod.hidden_dim)
        scores = mod.score_fn(torch.nn.functional.linear(x, mod.weight)) + mod.e_score_correction_bias
        v = torch.sort(scores.double(), dim=-1, descending=True).values
        stats["router_min_margin"] = min(stats["router_min_margin"], float((v[:, k_moe - 1] - v[:, k_moe]).min()))

    def experts_hook(name):
        def hook(mod, inp, out):
            x, idx = inp[0], inp[1]
            n = gate_hi = up_hi = 0
            for e in range(mod.num_experts):
                tok = (idx == e).any(-1).nonzero().flatten()
                if tok.numel() == 0:
                    continue
                gu = torch.nn.functional.linear(x[tok], mod.gate_up_proj[e])
                gate, up = gu.chunk(2, dim=-1)
                n += gate.numel()
                gate_hi += int((gate > lim).sum())
                up_hi += int((up.abs() > lim).sum())
            stats["clamp"][name] = {"routed_values": n, "gate_gt_limit": gate_hi, "up_abs_gt_limit": up_hi}
        return hook

    def shared_hook(name, which):
        def hook(mod, inp, out):
            d = stats["clamp"].setdefault(name + ".shared", {"values": out.numel()})
            d[which] = int((out > lim).sum()) if which == "gate_gt_limit" else int((out.abs() > lim).sum())
        return hook

    def rms_hook(name):
        def hook(mod, inp, out):
            o = out[0] if isinstance(out, tuple) else out
            stats["act_rms"][name] = round(float(o.float().pow(2).mean().sqrt()), 4)
        return hook

    for L, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.compressor is not None and hasattr(attn.compressor, "indexer"):
            hooks.append(attn.compressor.indexer.scorer.register_forward_hook(scorer_hook))
        if isinstance(mlp.gate, m.DeepseekV4TopKRouter):
            hooks.append(mlp.gate.register_forward_hook(router_hook))
        hooks.append(mlp.experts.register_forward_hook(experts_hook(f"layer{L}")))
        hooks.append(mlp.shared_experts.gate_proj.register_forward_hook(shared_hook(f"layer{L}", "gate_gt_limit")))
        hooks.append(mlp.shared_experts.up_proj.register_forward_hook(shared_hook(f"layer{L}", "up_abs_gt_limit")))
        hooks.append(attn.register_forward_hook(rms_hook(f"layer{L}.attn_out")))
        hooks.append(mlp.register_forward_hook(rms_hook(f"layer{L}.moe_out")))
        hooks.append(layer.register_forward_hook(rms_hook(f"layer{L}.streams")))
    try:
        full_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return stats


@torch.inference_mode()
def check_cached(model, config, ids: list[int], full: torch.Tensor, split: int) -> float:
    """HF's cached prefill(split) + one-token decodes must equal its full forward."""
    cache = DynamicCache(config=config)
    rows = [model(input_ids=torch.tensor([ids[:split]]), cache=cache, use_cache=True).logits[0].float()]
    for p in range(split, len(ids)):
        rows.append(model(input_ids=torch.tensor([[ids[p]]]), cache=cache, use_cache=True).logits[0].float())
    cached = torch.cat(rows, 0)
    return float((cached - full).abs().max())


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, margins = list(ids), []
    for _ in range(n):
        last = full_logits(model, seq)[-1]
        top2 = torch.topk(last, 2).values
        margins.append(float(top2[0] - top2[1]))
        seq.append(int(torch.argmax(last)))
    return seq[len(ids):], margins


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="DeepSeek-V4-Flash HF oracle (tiny random model)")
    ap.add_argument("--out", type=Path, required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-lens", default="20,45", help="comma-separated prompt lengths")
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt (0: skip)")
    ap.add_argument("--cache-split", type=int, default=13,
                    help="prefill length for the cached-vs-full check on the longest prompt (0: skip)")
    ap.add_argument("--cache-tol", type=float, default=1e-4)
    ap.add_argument("--dump-hf-state", type=Path, default=None,
                    help="also save the HF state dict (float32 / int64 npz, HF names) for debugging")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the model is tiny and extra threads are far "
                         "slower on a busy CPU); 0 keeps the torch default")
    a = ap.parse_args(argv)

    t0 = time.monotonic()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    t = dict(TINY)
    lens = [int(x) for x in a.prompt_lens.split(",") if x]

    config = hf_config(t)
    model = DeepseekV4ForCausalLM(config).eval().float()
    model.config._experts_implementation = "eager"
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    print(f"[oracle] transformers {transformers.__version__}, torch {torch.__version__}; layer_types "
          f"{config.layer_types}, mlp {config.mlp_layer_types}, rates {config.compress_rates}")

    master = draw_master(t, rng)
    used, ckpt = quantise_and_write(t, master, out)
    name_map = load_into_hf(model, t, used)
    print(f"[oracle] wrote {ckpt['n_tensors']} tensors in {ckpt['n_shards']} shards ({ckpt['total_bytes']} bytes) "
          f"to {out}")
    check_read_back(model, t, out)
    rope = check_rope(model, t)
    if a.dump_hf_state:
        np.savez(a.dump_hf_state, **{k: v.numpy() for k, v in model.state_dict().items()})

    prompts = [rng.integers(0, t["vocab_size"], size=n).tolist() for n in lens]
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"seed": a.seed, "tiny_config": t, "layer_ratios": LAYER_RATIOS,
                  "hf_config": json.loads(config.to_json_string()), "checkpoint": ckpt, "rope": rope,
                  "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                               "numpy": np.__version__, "python": sys.version.split()[0]},
                  "name_map": name_map, "prompts": {}, "timings_s": {}}
    t1 = time.monotonic()
    for i, ids in enumerate(prompts):
        lg = full_logits(model, ids)
        if not torch.isfinite(lg).all():
            raise SystemExit(f"FAIL: non-finite logits for prompt {i}")
        arrays[f"ids_{i}"] = np.asarray(ids, np.int64)
        arrays[f"logits_{i}"] = lg.numpy().astype(np.float32)
        info = {"len": len(ids), "max_abs_logit": float(lg.abs().max()), "logit_std": float(lg.std())}
        if a.gen:
            gen, margins = greedy(model, ids, a.gen)
            arrays[f"greedy_{i}"] = np.asarray(gen, np.int64)
            gl = full_logits(model, ids + gen[:-1])
            arrays[f"greedy_logits_{i}"] = gl.numpy().astype(np.float32)
            consistent = gl[len(ids) - 1:].argmax(-1).tolist() == gen
            info.update({"greedy_min_top2_margin": min(margins), "greedy_consistent_with_full_forward": consistent})
            if not consistent:
                print(f"[oracle] WARNING: prompt {i}: argmax of the full forward over the continuation differs "
                      f"from the step-by-step greedy (near-tie; min top-2 margin {min(margins):.2e})")
        meta["prompts"][str(i)] = info
        print(f"[oracle] prompt {i}: T={len(ids)} max|logit|={info['max_abs_logit']:.3f} "
              + (f"greedy min top-2 margin {info['greedy_min_top2_margin']:.3e}" if a.gen else ""))
    meta["timings_s"]["forwards"] = round(time.monotonic() - t1, 2)
    np.savez(out / "logits.npz", **arrays)

    longest = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    st = instrumented_forward(model, t, prompts[longest])
    meta["stats_longest_prompt"] = st
    print(f"[oracle] indexer: {st['indexer_queries_selecting']} queries choose top-{t['index_topk']}, "
          f"min margin {st['indexer_min_margin']:.3e}, exact ties {st['indexer_exact_ties']}; "
          f"router min margin {st['router_min_margin']:.3e}")
    clamp_g = sum(v.get("gate_gt_limit", 0) for v in st["clamp"].values())
    clamp_u = sum(v.get("up_abs_gt_limit", 0) for v in st["clamp"].values())
    print(f"[oracle] SwiGLU clamp active: gate>{t['swiglu_limit']} {clamp_g}x, |up|>{t['swiglu_limit']} {clamp_u}x; "
          f"act rms {st['act_rms']}")
    if st["indexer_exact_ties"]:
        raise SystemExit("FAIL: exact ties at the indexer top-k boundary; raise index_n_heads or change the seed")

    if a.cache_split:
        t2 = time.monotonic()
        ids = prompts[longest]
        err = check_cached(model, config, ids, torch.from_numpy(arrays[f"logits_{longest}"]), a.cache_split)
        meta["cached_vs_full_max_abs_diff"] = err
        meta["timings_s"]["cache_check"] = round(time.monotonic() - t2, 2)
        print(f"[oracle] HF cached prefill({a.cache_split}) + {len(ids) - a.cache_split} decodes vs full forward: "
              f"max |diff| {err:.3e}")
        if not err <= a.cache_tol:
            raise SystemExit(f"FAIL: HF cached decode differs from its full forward by {err:.3e} > {a.cache_tol}")

    # fp32 noise floor: the same HF model in float64 on the longest prompt
    import copy
    m64 = copy.deepcopy(model).double()
    with torch.inference_mode():
        l64 = m64(input_ids=torch.tensor([prompts[longest]]), use_cache=False).logits[0]
    noise = float((l64 - torch.from_numpy(arrays[f"logits_{longest}"]).double()).abs().max())
    meta["fp32_vs_fp64_max_abs_diff"] = noise
    print(f"[oracle] fp32 vs fp64 (HF, longest prompt): max |diff| {noise:.3e}")
    del m64

    meta["timings_s"]["total"] = round(time.monotonic() - t0, 2)
    (out / "oracle_meta.json").write_text(json.dumps(meta, indent=1, default=float) + "\n")
    print(f"[oracle] done in {meta['timings_s']['total']:.1f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
