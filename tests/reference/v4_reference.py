"""A plain float64 numpy reference of the DeepSeek-V4(-Flash) full-sequence forward and its MTP block.

A test oracle written from `shared/spec/model-v4-flash.md` (§2 forward, §4 MTP). It imports
nothing from `deepinfer`: the config is read only through its attributes (`hidden_size`,
`compress_ratios`, `num_hash_layers`, ...), and the layer schedule is recomputed here from
`compress_ratios` (0: window only; 4: CSA, overlapping compressor + lightning indexer; >= 8: HCA,
non-overlapping compressor, every visible row attended).

Pieces whose math is the same as in DeepSeek-V4.1 come from the independent V4.1 reference
(`v41_reference`): RMSNorm, interleaved RoPE with DeepSeek's YaRN and the per-layer rope choice,
the mHC mixes (Sinkhorn), stream collapse/expand, the sink softmax, the clamped SwiGLU expert, the
top-k selection and the FP8 / FP4 fake quantisers. What is V4-specific lives here: per-head q norm
without weight; each site collapses with its own `pre`; the learned final `hc_head`; every
compressed layer's own compressor (per-channel softmax of gate + ape over the window's slots,
overlapping for CSA); the CSA indexer with its own compressor; HCA's dense selection; hash routing;
the V4 QAT (FP8 on the non-rope dims per 64; indexer Hadamard + FP4 per 32); and the MTP block.

Numerics: float64 everywhere except the fake quantisers, which do their arithmetic in float32.
One sequence at positions 0..T-1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.reference.v41_reference import (
    apply_rope,
    attention_with_sink,
    fake_quant_fp4,
    fake_quant_fp8_ue8m0,
    hc_collapse,
    hc_expand,
    hc_mixes,
    layer_inv_freq,
    rms_norm,
    select_topk,
    swiglu_expert,
    window_mask,
)

__all__ = [
    "reference_forward_v4",
    "reference_mtp_v4",
    "hadamard",
    "kv_fake_quant",
    "index_fake_quant",
    "compress_rows",
    "hc_head_collapse",
]

F64 = np.float64
CSA_RATIO = 4  # the only overlapping ratio; every other positive ratio is HCA


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _softmax_axis0(x: np.ndarray) -> np.ndarray:
    """Softmax over the first axis (slots), separately for every other index (channel)."""
    top = np.max(x, axis=0, keepdims=True)
    e = np.exp(x - top)
    return e / e.sum(axis=0, keepdims=True)


# ---------------------------------------------------------------------------------------------
# QAT (spec §2.4 step 3, §2.5, §2.6)
# ---------------------------------------------------------------------------------------------


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix: H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    idx = np.arange(n)
    parity = np.zeros((n, n), dtype=np.int64)
    both = idx[:, None] & idx[None, :]
    while both.any():
        parity ^= both & 1
        both = both >> 1
    return np.where(parity == 1, -1.0, 1.0) / np.sqrt(n)


def kv_fake_quant(x: np.ndarray, cfg: Any) -> np.ndarray:
    """Window / compressed KV: FP8 e4m3 with a ue8m0 scale per 64 on the first
    head_dim - rope dims; the rope dims pass through unchanged."""
    x = np.asarray(x, dtype=F64)
    nope = x.shape[-1] - cfg.qk_rope_head_dim
    out = x.copy()
    out[..., :nope] = fake_quant_fp8_ue8m0(x[..., :nope], 64)
    return out


def index_fake_quant(x: np.ndarray) -> np.ndarray:
    """Indexer queries / keys: rotate by the orthonormal Hadamard of the vector size, then FP4
    (e2m1) with a ue8m0 scale per 32."""
    x = np.asarray(x, dtype=F64)
    rotated = x @ hadamard(x.shape[-1])
    return fake_quant_fp4(rotated, 32, e4m3_scale=False)


# ---------------------------------------------------------------------------------------------
# mHC final collapse
# ---------------------------------------------------------------------------------------------


def hc_head_collapse(streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, *,
                     norm_eps: float, hc_eps: float) -> np.ndarray:
    """streams [T, hc, D] -> [T, D]: sigmoid mix of the normalized flattened streams (no
    Sinkhorn, no post), + hc_eps, then the weighted sum of the streams."""
    T = streams.shape[0]
    flat = rms_norm(streams.reshape(T, -1), None, norm_eps)
    mix = flat @ fn.T  # [T, hc]
    pre = _sigmoid(mix * scale[0] + base[None, :]) + hc_eps
    return hc_collapse(streams, pre)


# ---------------------------------------------------------------------------------------------
# compressor (spec §2.5)
# ---------------------------------------------------------------------------------------------


def compress_rows(x: np.ndarray, wkv: np.ndarray, wgate: np.ndarray, ape: np.ndarray, norm_w: np.ndarray,
                  ratio: int, eps: float) -> np.ndarray:
    """Normalized, pre-RoPE compressed rows [T // ratio, width] of x [T, d].

    Window w holds tokens w*ratio .. w*ratio + ratio - 1. Every slot's score is its gate logit plus
    `ape[slot]`; per channel, a softmax over the slots weighs the slots' kv. CSA (ratio 4) has two
    halves per token: row w pools the first halves of window w-1 and the second halves of window w
    (8 slots; window -1 does not exist: its slots are dropped, i.e. score -inf). HCA pools its own
    window. Rows are RMS-normalized with `norm_w`."""
    width = norm_w.shape[0]
    n = x.shape[0] // ratio
    rows = np.zeros((n, width))
    if n == 0:
        return rows
    kv = (x[: n * ratio] @ wkv.T).reshape(n, ratio, -1)
    score = (x[: n * ratio] @ wgate.T).reshape(n, ratio, -1) + ape[None]
    for w in range(n):
        if ratio == CSA_RATIO:
            slot_kv = [kv[w, :, width:]]
            slot_score = [score[w, :, width:]]
            if w > 0:
                slot_kv.insert(0, kv[w - 1, :, :width])
                slot_score.insert(0, score[w - 1, :, :width])
            slot_kv = np.concatenate(slot_kv, axis=0)
            slot_score = np.concatenate(slot_score, axis=0)
        else:
            slot_kv, slot_score = kv[w], score[w]
        rows[w] = np.sum(_softmax_axis0(slot_score) * slot_kv, axis=0)
    return rms_norm(rows, norm_w, eps)


# ---------------------------------------------------------------------------------------------
# attention (spec §2.4, §2.6)
# ---------------------------------------------------------------------------------------------


def _attention(cfg: Any, W: dict, p: str, layer: int, x: np.ndarray, fake_quant: bool) -> np.ndarray:
    """The attention sublayer of block prefix `p` (layer id `layer`) on attn-normed x [T, d]."""
    T = x.shape[0]
    H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    ratio = cfg.compress_ratios[layer]
    inv_freq = layer_inv_freq(cfg, layer)  # ratio 0: rope_theta; else compress rope + YaRN
    pos = np.arange(T)
    a = p + "attn."

    qr = rms_norm(x @ W[a + "wq_a.weight"].T, W[a + "q_norm.weight"], eps)
    q = (qr @ W[a + "wq_b.weight"].T).reshape(T, H, hd)
    q = rms_norm(q, None, eps)  # per-head, no weight
    q = apply_rope(q, pos, inv_freq)

    kv = rms_norm(x @ W[a + "wkv.weight"].T, W[a + "kv_norm.weight"], eps)
    kv = apply_rope(kv, pos, inv_freq)
    if fake_quant:
        kv = kv_fake_quant(kv, cfg)

    keys, visible = kv, window_mask(T, cfg.sliding_window)
    if ratio > 0:
        c = a + "compressor."
        rows = compress_rows(x, W[c + "wkv.weight"], W[c + "wgate.weight"], W[c + "ape"], W[c + "norm.weight"],
                             ratio, eps)
        n = rows.shape[0]
        row_pos = ratio * np.arange(n)
        rows = apply_rope(rows, row_pos, inv_freq)
        if fake_quant:
            rows = kv_fake_quant(rows, cfg)
        row_visible = np.arange(n)[None, :] < ((pos + 1) // ratio)[:, None]  # [T, n]
        if ratio == CSA_RATIO:
            ic = a + "indexer.compressor."
            idx_k = compress_rows(x, W[ic + "wkv.weight"], W[ic + "wgate.weight"], W[ic + "ape"],
                                  W[ic + "norm.weight"], ratio, eps)
            idx_k = apply_rope(idx_k, row_pos, inv_freq)
            Hi, di = cfg.index_n_heads, cfg.index_head_dim
            idx_q = (qr @ W[a + "indexer.wq_b.weight"].T).reshape(T, Hi, di)
            idx_q = apply_rope(idx_q, pos, inv_freq)
            if fake_quant:
                idx_k, idx_q = index_fake_quant(idx_k), index_fake_quant(idx_q)
            head_w = (x @ W[a + "indexer.weights_proj.weight"].T) * (di**-0.5 * Hi**-0.5)  # [T, Hi]
            per_head = np.maximum(np.einsum("thd,nd->thn", idx_q, idx_k), 0.0)
            scores = np.einsum("thn,th->tn", per_head, head_w)
            scores = np.where(row_visible, scores, -np.inf)
            row_visible = select_topk(scores, cfg.index_topk)
        if n:
            keys = np.concatenate([kv, rows], axis=0)
            visible = np.concatenate([visible, row_visible], axis=1)

    out = attention_with_sink(q, keys, visible, W[a + "attn_sink"], hd**-0.5)
    out = apply_rope(out, pos, inv_freq, inverse=True)
    G, r = cfg.o_groups, cfg.o_lora_rank
    grouped = out.reshape(T, G, H * hd // G)
    wo_a = W[a + "wo_a.weight"].reshape(G, r, H * hd // G)
    mid = np.einsum("tgi,gri->tgr", grouped, wo_a).reshape(T, G * r)
    return mid @ W[a + "wo_b.weight"].T


# ---------------------------------------------------------------------------------------------
# MoE (spec §2.7)
# ---------------------------------------------------------------------------------------------


def _moe(cfg: Any, W: dict, p: str, layer: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    f = p + "ffn."
    k = cfg.num_experts_per_tok
    scores = np.sqrt(_softplus(x @ W[f + "gate.weight"].T))  # [T, E]
    if layer < cfg.num_hash_layers:
        chosen = W[f + "gate.tid2eid"][ids].astype(np.int64)  # [T, k]
    else:
        chosen = np.argsort(-(scores + W[f + "gate.bias"][None, :]), axis=-1, kind="stable")[:, :k]
    route_w = np.take_along_axis(scores, chosen, axis=1)
    route_w = route_w / route_w.sum(axis=-1, keepdims=True) * cfg.routed_scaling_factor
    y = np.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        rows, slot = np.nonzero(chosen == e)
        if rows.size == 0:
            continue
        q = f"{f}experts.{e}."
        y[rows] += swiglu_expert(x[rows], W[q + "w1.weight"], W[q + "w2.weight"], W[q + "w3.weight"],
                                 cfg.swiglu_limit, route_w[rows, slot])
    if cfg.n_shared_experts:
        q = f + "shared_experts."
        y += swiglu_expert(x, W[q + "w1.weight"], W[q + "w2.weight"], W[q + "w3.weight"], cfg.swiglu_limit)
    return y


# ---------------------------------------------------------------------------------------------
# blocks, forward, MTP
# ---------------------------------------------------------------------------------------------


def _block(cfg: Any, W: dict, p: str, layer: int, streams: np.ndarray, ids: np.ndarray,
           fake_quant: bool) -> np.ndarray:
    """One decoder block; each site collapses the streams with its OWN `pre`."""
    eps = cfg.rms_norm_eps
    mix = dict(hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, norm_eps=eps)
    pre, post, comb = hc_mixes(streams, W[p + "hc_attn_fn"], W[p + "hc_attn_base"], W[p + "hc_attn_scale"], **mix)
    x = rms_norm(hc_collapse(streams, pre), W[p + "attn_norm.weight"], eps)
    streams = hc_expand(_attention(cfg, W, p, layer, x, fake_quant), streams, post, comb)
    pre, post, comb = hc_mixes(streams, W[p + "hc_ffn_fn"], W[p + "hc_ffn_base"], W[p + "hc_ffn_scale"], **mix)
    x = rms_norm(hc_collapse(streams, pre), W[p + "ffn_norm.weight"], eps)
    return hc_expand(_moe(cfg, W, p, layer, x, ids), streams, post, comb)


def _head(cfg: Any, W: dict, p: str, streams: np.ndarray) -> np.ndarray:
    h = hc_head_collapse(streams, W[p + "hc_head_fn"], W[p + "hc_head_base"], W[p + "hc_head_scale"],
                         norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    return rms_norm(h, W[p + "norm.weight"], cfg.rms_norm_eps) @ W["head.weight"].T


def _as_f64(weights: dict) -> dict:
    return {k: np.asarray(v, dtype=F64) for k, v in weights.items()}


def reference_forward_v4(weights: dict[str, np.ndarray], cfg, token_ids, *, fake_quant: bool = False,
                         return_streams: bool = False):
    """token_ids [T] (positions 0..T-1) -> logits float64 [T, vocab]; with `return_streams`
    also the final residual streams [T, hc, d] (before hc_head), the MTP block's input."""
    W = _as_f64(weights)
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D array, got shape {ids.shape}")
    streams = np.repeat(W["embed.weight"][ids][:, None, :], cfg.hc_mult, axis=1)
    for layer in range(cfg.num_hidden_layers):
        streams = _block(cfg, W, f"layers.{layer}.", layer, streams, ids, fake_quant)
    logits = _head(cfg, W, "", streams)
    return (logits, streams) if return_streams else logits


def reference_mtp_v4(weights: dict[str, np.ndarray], cfg, streams, next_ids, *, fake_quant: bool = False) -> np.ndarray:
    """The MTP block `mtp.0` over a whole sequence (spec §4): at position i it joins the main
    model's final streams h_i [T, hc, d] with the embedding of t_{i+1} (`next_ids[i]`) and returns
    logits [T, vocab] for t_{i+2}."""
    W = _as_f64(weights)
    p = "mtp.0."
    eps = cfg.rms_norm_eps
    next_ids = np.asarray(next_ids, dtype=np.int64)
    h = np.asarray(streams, dtype=F64)
    e = rms_norm(W["embed.weight"][next_ids], W[p + "enorm.weight"], eps)
    x = (e @ W[p + "e_proj.weight"].T)[:, None, :] + rms_norm(h, W[p + "hnorm.weight"], eps) @ W[p + "h_proj.weight"].T
    x = _block(cfg, W, p, cfg.num_hidden_layers, x, next_ids, fake_quant)
    return _head(cfg, W, p, x)
