"""A plain float64 numpy reference of the DeepSeek-V4.1 full-sequence forward pass.

This is a test oracle, written from `shared/spec/model-v4.1-flash.md` (sections 2.1-2.8 and
3.1) and the math of the transformers `deepseek_v41` port. It deliberately imports nothing
from `deepinfer`: the config object is only read through its attributes, and every schedule
decision (KV source, index source, candidate pool) is recomputed here from those fields.

Deliberate differences from the transformers port's uncached (`use_cache=False`) path: a layer
attends only to the compressed entries of its own KV source
`kv_src(l) = max{s in kv_source_layer_ids, s <= l}` and uses the selection of its own index
source `idx_src(l) = max{s in index_source_layer_ids, s <= l}` (the port's uncached path stacks
every source's entries onto the previous group's).

Numerics: everything runs in float64 except the QAT fake-quantisation, which (like the port)
does its arithmetic in float32 and returns float64.

One sequence at positions 0..T-1; text tokens only (no image spans, so `bias_vl` and the
Engram DEAD-token rule never apply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "reference_forward",
    "reference_token_map",
    "random_weights",
    "EngramLayout",
    "engram_layout",
    "engram_hash_multipliers",
    "engram_hash_ids",
    "yarn_correction_range",
    "rope_inv_freq",
    "apply_rope",
    "hc_mixes",
    "window_mask",
    "compressor_latents",
    "fake_quant_fp8_ue8m0",
    "fake_quant_fp4",
    "round_to_e2m1",
]

F64 = np.float64
F32 = np.float32


# ---------------------------------------------------------------------------------------------
# small numeric helpers
# ---------------------------------------------------------------------------------------------


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warnings for large |x|
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def _rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (weight None: unweighted)."""
    mean_sq = np.mean(x * x, axis=-1, keepdims=True)
    y = x / np.sqrt(mean_sq + eps)
    return y if weight is None else y * weight


def _order_desc(scores: np.ndarray) -> np.ndarray:
    """Indices sorting the last axis by descending score; ties keep the lower index first."""
    return np.argsort(-scores, axis=-1, kind="stable")


# ---------------------------------------------------------------------------------------------
# RoPE (interleaved pairs on the trailing `qk_rope_head_dim` channels)
# ---------------------------------------------------------------------------------------------


def yarn_correction_range(dim: int, base: float, original_seq_len: int, beta_fast: float,
                          beta_slow: float) -> tuple[int, int]:
    """DeepSeek `find_correction_range`: the frequency-index band over which YaRN blends.

    The index at which a frequency makes `r` full rotations over `original_seq_len` positions is
    dim * ln(L / (2 pi r)) / (2 ln base); low uses r = beta_fast (floored), high r = beta_slow
    (ceiled), clipped to [0, dim - 1].
    """

    def index_for(rotations: float) -> float:
        return dim * math.log(original_seq_len / (rotations * 2.0 * math.pi)) / (2.0 * math.log(base))

    low = math.floor(index_for(beta_fast))
    high = math.ceil(index_for(beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(dim: int, base: float, *, yarn: tuple[float, int, float, float] | None = None) -> np.ndarray:
    """The dim/2 rotation frequencies base^(-2i/dim); with `yarn = (factor, original_seq_len,
    beta_fast, beta_slow)` the DeepSeek YaRN blend (no magnitude / mscale factor)."""
    freqs = 1.0 / (float(base) ** (np.arange(0, dim, 2, dtype=F64) / dim))
    if yarn is None:
        return freqs
    factor, original_seq_len, beta_fast, beta_slow = yarn
    low, high = yarn_correction_range(dim, base, original_seq_len, beta_fast, beta_slow)
    if low == high:
        high = high + 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=F64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: original (high) frequency kept, 0: interpolated by `factor`
    return freqs / factor * (1.0 - keep) + freqs * keep


def _layer_inv_freq(cfg: Any, layer: int) -> np.ndarray:
    """Ratio-0 layers: rope_theta, no YaRN. Ratio>0 layers: compress_rope_theta + YaRN."""
    rd = cfg.qk_rope_head_dim
    if cfg.compress_ratios[layer] == 0:
        return rope_inv_freq(rd, cfg.rope_theta)
    return rope_inv_freq(
        rd,
        cfg.compress_rope_theta,
        yarn=(cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow),
    )


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """Rotate channel pairs (2i, 2i+1) of the last 2*len(inv_freq) channels of `x`.

    `x` is [T, ..., d] and `positions` [T]; channels before the rope tail pass through.
    `inverse=True` applies the conjugate rotation (angle -> -angle).
    """
    rd = 2 * inv_freq.shape[0]
    angle = np.asarray(positions, dtype=F64)[:, None] * inv_freq[None, :]  # [T, rd/2]
    angle = angle.reshape(angle.shape[0], *([1] * (x.ndim - 2)), angle.shape[1])
    cos, sin = np.cos(angle), np.sin(angle)
    if inverse:
        sin = -sin
    out = np.array(x, dtype=F64, copy=True)
    tail = x[..., x.shape[-1] - rd:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    out[..., x.shape[-1] - rd::2] = even * cos - odd * sin
    out[..., x.shape[-1] - rd + 1::2] = even * sin + odd * cos
    return out


# ---------------------------------------------------------------------------------------------
# QAT fake quantisation (float32 arithmetic, like the port)
# ---------------------------------------------------------------------------------------------

_FP8_MAX = 448.0
_FP4_MAX = 6.0
_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F32)
# midpoints between consecutive grid values, and whether a value exactly on the midpoint rounds
# up: round-to-nearest-even keeps the code with an even mantissa bit, i.e. ties at 0.25, 1.25,
# 2.5 and 5.0 go down, ties at 0.75, 1.75 and 3.5 go up.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def _pow2_ceil(t: np.ndarray) -> np.ndarray:
    """2^ceil(log2 t) for positive normal float32 `t`, from the IEEE bits (ue8m0 scales)."""
    t = np.ascontiguousarray(t, dtype=F32)
    bits = t.view(np.int32)
    exponent = (bits >> 23) & 0xFF
    has_fraction = (bits & 0x7FFFFF) != 0
    k = exponent - 127 + has_fraction.astype(np.int32)
    return np.exp2(k.astype(F32))


def round_to_e2m1(q: np.ndarray) -> np.ndarray:
    """Round float32 values already clamped to [-6, 6] onto the e2m1 grid (values, float32)."""
    q = np.asarray(q, dtype=F32)
    mag = np.abs(q)
    code = np.zeros(q.shape, dtype=np.int64)
    for mid, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP):
        code += (mag >= F32(mid)) if tie_up else (mag > F32(mid))
    val = _E2M1_GRID[code]
    return np.where(np.signbit(q), -val, val)


def _blocks(x: np.ndarray, block: int) -> np.ndarray | None:
    n = x.shape[-1]
    if n % block:
        return None  # like the port: shapes that cannot be blocked stay unquantised
    return np.asarray(x, dtype=F32).reshape(*x.shape[:-1], n // block, block)


def fake_quant_fp8_ue8m0(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Window-KV fake quant: e4m3 values, one power-of-two scale per `block` channels.

    scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (the division done as a multiply by the float32
    reciprocal, like the port)."""
    b = _blocks(x, block)
    if b is None:
        return np.asarray(x, dtype=F64)
    amax = np.maximum(np.abs(b).max(axis=-1), F32(1e-4))
    scale = _pow2_ceil(amax * F32(1.0 / _FP8_MAX))[..., None]
    q = np.clip(b / scale, F32(-_FP8_MAX), F32(_FP8_MAX))
    q = q.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    return (q * scale).reshape(x.shape).astype(F64)


def fake_quant_fp4(x: np.ndarray, block: int, *, e4m3_scale: bool) -> np.ndarray:
    """FP4 (e2m1) fake quant with one scale per `block` channels.

    e4m3_scale=True (compressed KV, block 16): scale = e4m3(max(amax, 6*2^-9) / 6).
    e4m3_scale=False (indexer keys/queries, block 32): scale = 2^ceil(log2(max(amax, 6*2^-126)/6)).
    """
    b = _blocks(x, block)
    if b is None:
        return np.asarray(x, dtype=F64)
    amax = np.abs(b).max(axis=-1)
    if e4m3_scale:
        scale = (np.maximum(amax, F32(6.0 * 2.0**-9)) / F32(_FP4_MAX))
        scale = scale.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    else:
        scale = _pow2_ceil(np.maximum(amax, F32(6.0 * 2.0**-126)) * F32(1.0 / _FP4_MAX))
    scale = scale[..., None]
    q = np.clip(b / scale, F32(-_FP4_MAX), F32(_FP4_MAX))
    return (round_to_e2m1(q) * scale).reshape(x.shape).astype(F64)


# ---------------------------------------------------------------------------------------------
# mHC (single pass, Sinkhorn-projected residual mixing)
# ---------------------------------------------------------------------------------------------


def hc_mixes(streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, *, hc_eps: float,
             sinkhorn_iters: int, norm_eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """streams [T, hc, D] -> (pre [T, hc], post [T, hc], comb [T, hc(src), hc(dst)])."""
    T, hc, D = streams.shape
    flat = _rms_norm(streams.reshape(T, hc * D), None, norm_eps)
    m = flat @ fn.T  # [T, (2 + hc) * hc]
    pre = _sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * _sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(T, hc, hc)
    comb = _softmax(comb_logits, axis=-1) + hc_eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + hc_eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
    return pre, post, comb


def _hc_collapse(streams: np.ndarray, pre: np.ndarray) -> np.ndarray:
    return np.einsum("tk,tkd->td", pre, streams)


def _hc_expand(y: np.ndarray, streams: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'[k] = post[k] * y + sum_j comb[j, k] * X[j]."""
    return post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, streams)


# ---------------------------------------------------------------------------------------------
# schedule (recomputed from the config fields)
# ---------------------------------------------------------------------------------------------


def _latest_at_or_before(ids, layer: int) -> int | None:
    earlier = [s for s in ids if s <= layer]
    return max(earlier) if earlier else None


def _kv_src(cfg: Any, layer: int) -> int | None:
    if cfg.compress_ratios[layer] == 0:
        return None
    return _latest_at_or_before(cfg.kv_source_layer_ids, layer)


def _idx_src(cfg: Any, layer: int) -> int | None:
    if cfg.compress_ratios[layer] == 0:
        return None
    return _latest_at_or_before(cfg.index_source_layer_ids, layer)


# ---------------------------------------------------------------------------------------------
# attention pieces
# ---------------------------------------------------------------------------------------------


def window_mask(T: int, window: int) -> np.ndarray:
    """[T(query), T(key)] bool: key s visible to query t iff t - window < s <= t."""
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    return (s <= t) & (s > t - window)


def compressor_latents(x: np.ndarray, wkv: np.ndarray, wgate: np.ndarray | None, norm_w: np.ndarray, ratio: int,
                       eps: float) -> np.ndarray:
    """Pre-RoPE compressed latents [T // ratio, hd] of the complete groups.

    ratio 1: norm(x @ wkv^T) per token. ratio 2: per channel, a softmax over the two tokens of
    each aligned pair (2k, 2k+1) of the gate logits weights the kv projections; then norm.
    An incomplete trailing group produces nothing.
    """
    if ratio == 1:
        return _rms_norm(x @ wkv.T, norm_w, eps)
    n_groups = x.shape[0] // ratio
    used = x[: n_groups * ratio]
    kv = (used @ wkv.T).reshape(n_groups, ratio, -1)
    gate = (used @ wgate.T).reshape(n_groups, ratio, -1)
    latent = (kv * _softmax(gate, axis=1)).sum(axis=1)
    return _rms_norm(latent, norm_w, eps)


def _attention_with_sink(q: np.ndarray, keys: np.ndarray, visible: np.ndarray, sink: np.ndarray,
                         scale: float) -> np.ndarray:
    """q [T, H, d]; keys [K, d] (K = V); visible [T, K] -> out [T, H, d].

    The per-head sink adds exp(sink[h]) to each softmax denominator only.
    """
    logits = np.einsum("thd,kd->htk", q, keys) * scale
    logits = np.where(visible[None], logits, -np.inf)
    top = np.maximum(logits.max(axis=-1), sink[:, None])  # [H, T]
    w = np.exp(logits - top[..., None])
    denom = w.sum(axis=-1) + np.exp(sink[:, None] - top)
    w = w / denom[..., None]
    return np.einsum("htk,kd->thd", w, keys)


def _select_candidate_blocks(scores: np.ndarray, visible_len: np.ndarray, n_blocks_keep: int,
                             block: int) -> np.ndarray:
    """Level one of the two-level top-k. scores [T, N] (invisible = -inf) -> bool pool [T, N].

    Block score = max over its `block` positions; the block holding the newest visible entry is
    forced to +inf; keep the best `n_blocks_keep` blocks whose score is finite or +inf.
    """
    T, N = scores.shape
    block_scores = candidate_block_scores(scores, visible_len, block)
    n_blocks = block_scores.shape[1]
    order = _order_desc(block_scores)[:, : min(n_blocks_keep, n_blocks)]
    keep = np.zeros((T, n_blocks), dtype=bool)
    rows = np.arange(T)[:, None]
    keep[rows, order] = block_scores[rows, order] > -np.inf
    return np.repeat(keep, block, axis=1)[:, :N]


def candidate_block_scores(scores: np.ndarray, visible_len: np.ndarray, block: int) -> np.ndarray:
    """[T, n_blocks]: each block's max score, +inf for the block holding the newest visible entry."""
    T, N = scores.shape
    n_blocks = -(-N // block)
    padded = np.full((T, n_blocks * block), -np.inf)
    padded[:, :N] = scores
    block_scores = padded.reshape(T, n_blocks, block).max(axis=-1)
    newest = (visible_len - 1) // block  # -1 (no block) when nothing is visible
    return np.where(np.arange(n_blocks)[None, :] == newest[:, None], np.inf, block_scores)


def router_scores(cfg: Any, W: dict, p: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The router under prefix `p` ("...ffn."): (gate weights [T, E], selection scores = weights +
    bias [T, E])."""
    scores = np.sqrt(_softplus((x @ W[p + "gate.weight"].T) / cfg.gate_temp))
    return scores, scores + W[p + "gate.bias"][None, :]


def _select_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """bool [T, N]: the top-min(k, N) entries of each row, never an entry scored -inf."""
    T, N = scores.shape
    k = min(k, N)
    chosen = np.zeros((T, N), dtype=bool)
    if k == 0:
        return chosen
    order = _order_desc(scores)[:, :k]
    rows = np.arange(T)[:, None]
    chosen[rows, order] = scores[rows, order] > -np.inf
    return chosen


@dataclass
class _SourceKV:
    """What a KV-source layer publishes to its group."""

    ratio: int
    entries: np.ndarray  # [N, hd] rotated (+ fake-quantised) compressed KV
    index_keys: np.ndarray  # [N, idx_hd] rotated (+ fake-quantised) indexer keys


def _indexer_scores(cfg: Any, W: dict, p: str, x: np.ndarray, qr: np.ndarray, positions: np.ndarray,
                    inv_freq: np.ndarray, src: _SourceKV, fake_quant: bool) -> np.ndarray:
    """Index scores [T, N] of this layer's indexer against the source's keys; invisible -> -inf."""
    T = x.shape[0]
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    qi = (qr @ W[p + "attn.indexer.wq_b.weight"].T).reshape(T, Hi, di)
    qi = apply_rope(qi, positions, inv_freq)
    if fake_quant:
        qi = fake_quant_fp4(qi, 32, e4m3_scale=False)
    per_head = np.maximum(np.einsum("thd,nd->thn", qi, src.index_keys), 0.0) * di**-0.5
    head_w = (x @ W[p + "attn.indexer.weights_proj.weight"].T) * Hi**-0.5  # [T, Hi]
    scores = np.einsum("thn,th->tn", per_head, head_w)
    visible_len = (positions + 1) // src.ratio
    visible = np.arange(src.entries.shape[0])[None, :] < visible_len[:, None]
    return np.where(visible, scores, -np.inf)


def _attention_layer(cfg: Any, W: dict, layer: int, x: np.ndarray, positions: np.ndarray, state: dict,
                     fake_quant: bool, trace: dict | None) -> np.ndarray:
    p = f"layers.{layer}."
    T = x.shape[0]
    H, hd = cfg.num_attention_heads, cfg.head_dim
    if trace is not None:
        trace.setdefault("attn_input", {})[layer] = x
    eps = cfg.rms_norm_eps
    ratio = cfg.compress_ratios[layer]
    inv_freq = _layer_inv_freq(cfg, layer)

    # queries: low rank with q_norm, no per-head norm; RoPE on the trailing rope dims
    qr = _rms_norm(x @ W[p + "attn.wq_a.weight"].T, W[p + "attn.q_norm.weight"], eps)
    q = (qr @ W[p + "attn.wq_b.weight"].T).reshape(T, H, hd)
    q = apply_rope(q, positions, inv_freq)

    # this layer's own window KV (K = V, one latent)
    kv = _rms_norm(x @ W[p + "attn.wkv.weight"].T, W[p + "attn.kv_norm.weight"], eps)
    kv = apply_rope(kv, positions, inv_freq)
    if fake_quant:
        kv = fake_quant_fp8_ue8m0(kv, 32)

    keys = kv
    visible = window_mask(T, cfg.sliding_window)

    if ratio > 0:
        # a KV source publishes its compressed entries and indexer keys
        if layer in cfg.kv_source_layer_ids:
            wgate = W.get(p + "attn.compressor.wgate.weight") if ratio > 1 else None
            latent = compressor_latents(x, W[p + "attn.compressor.wkv.weight"], wgate,
                                        W[p + "attn.compressor.norm.weight"], ratio, eps)
            group_pos = ratio * np.arange(latent.shape[0])
            idx_k = _rms_norm(latent @ W[p + "attn.indexer.wk.weight"].T, W[p + "attn.indexer.k_norm.weight"], eps)
            idx_k = apply_rope(idx_k, group_pos, inv_freq)
            entries = apply_rope(latent, group_pos, inv_freq)
            if fake_quant:
                idx_k = fake_quant_fp4(idx_k, 32, e4m3_scale=False)
                entries = fake_quant_fp4(entries, 16, e4m3_scale=True)
            state["kv"][layer] = _SourceKV(ratio=ratio, entries=entries, index_keys=idx_k)
            if trace is not None:
                trace.setdefault("source_kv", {})[layer] = state["kv"][layer]
        kv_src = _kv_src(cfg, layer)
        src = state["kv"][kv_src]
        N = src.entries.shape[0]

        # an index source scores and selects; later layers reuse the selection
        if layer in cfg.index_source_layer_ids:
            scores = _indexer_scores(cfg, W, p, x, qr, positions, inv_freq, src, fake_quant)
            cand_layer = cfg.candidate_source_layer_id
            if layer == cand_layer:
                visible_len = (positions + 1) // ratio
                state["candidates"] = (kv_src, _select_candidate_blocks(
                    scores, visible_len, cfg.candidate_topk_blocks, cfg.candidate_block_size))
            elif 0 <= cand_layer < layer and state["candidates"] is not None:
                cand_src, pool = state["candidates"]
                if cand_src != kv_src:
                    raise ValueError(
                        f"layer {layer}: the candidate pool of layer {cand_layer} is over the entries of "
                        f"KV source {cand_src}, but this layer reads KV source {kv_src}")
                scores = np.where(pool, scores, -np.inf)
            state["selection"][layer] = _select_topk(scores, cfg.index_topk)
            if trace is not None:
                trace.setdefault("index_scores", {})[layer] = scores
                if layer == cand_layer:
                    trace["candidates"] = state["candidates"][1]
        selected = state["selection"][_idx_src(cfg, layer)]
        if trace is not None:
            trace.setdefault("selected", {})[layer] = selected
        if N > 0:
            # window keys and compressed entries, side by side on the key axis
            keys = np.concatenate([kv, src.entries], axis=0)
            visible = np.concatenate([visible, selected], axis=1)

    out = _attention_with_sink(q, keys, visible, W[p + "attn.attn_sink"], hd**-0.5)
    out = apply_rope(out, positions, inv_freq, inverse=True)

    # grouped low-rank output projection
    G, r = cfg.o_groups, cfg.o_lora_rank
    grouped = out.reshape(T, G, H * hd // G)
    wo_a = W[p + "attn.wo_a.weight"].reshape(G, r, H * hd // G)
    mid = np.einsum("tgi,gri->tgr", grouped, wo_a).reshape(T, G * r)
    return mid @ W[p + "attn.wo_b.weight"].T


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def _swiglu_expert(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float,
                   route_w: np.ndarray | None) -> np.ndarray:
    g = x @ w1.T
    u = x @ w3.T
    if limit > 0:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    h = _silu(g) * u
    if route_w is not None:
        h = h * route_w[:, None]
    return h @ w2.T


def _moe(cfg: Any, W: dict, layer: int, x: np.ndarray) -> np.ndarray:
    return moe_ffn(cfg, W, f"layers.{layer}.ffn.", x, cfg.n_routed_experts, cfg.num_experts_per_tok)


def moe_ffn(cfg: Any, W: dict, p: str, x: np.ndarray, n_experts: int, k: int) -> np.ndarray:
    """The MoE FFN under prefix `p` ("...ffn.") with `n_experts` routed experts and top-`k`."""
    scores, biased = router_scores(cfg, W, p, x)
    chosen = _order_desc(biased)[:, :k]  # bias: selection only
    route_w = np.take_along_axis(scores, chosen, axis=1)
    if cfg.norm_topk_prob and k > 1:
        route_w = route_w / (route_w.sum(axis=-1, keepdims=True) + 1e-20)
    route_w = route_w * cfg.routed_scaling_factor
    y = np.zeros_like(x)
    for e in range(n_experts):
        rows, slot = np.nonzero(chosen == e)
        if rows.size == 0:
            continue
        q = f"{p}experts.{e}."
        y[rows] += _swiglu_expert(x[rows], W[q + "w1.weight"], W[q + "w2.weight"], W[q + "w3.weight"],
                                  cfg.swiglu_limit, route_w[rows, slot])
    if cfg.n_shared_experts:
        q = p + "shared_experts."
        y += _swiglu_expert(x, W[q + "w1.weight"], W[q + "w2.weight"], W[q + "w3.weight"], cfg.swiglu_limit, None)
    return y


# ---------------------------------------------------------------------------------------------
# Engram: token map, hash layout, hashing, gated lookup
# ---------------------------------------------------------------------------------------------


def reference_token_map(tokenizer_json_path: str) -> np.ndarray:
    """Compressed Engram token ids [n_tokens] (int64) from a `tokenizer.json` (spec 2.7).

    Each id is decoded alone; its key is the normalised text (NFKC, NFD, strip accents,
    lowercase, whitespace runs -> one space, a lone space protected by a sentinel through
    Strip), or the raw token string when the decoded text contains U+FFFD (partial UTF-8), or
    the unnormalised text when normalisation leaves nothing. Keys get ids in first-seen order.
    """
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])
    n = tok.get_vocab_size(with_added_tokens=True)
    ids_by_key: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for token_id in range(n):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out[token_id] = ids_by_key.setdefault(key, len(ids_by_key))
    return out


@dataclass(frozen=True)
class EngramLayout:
    primes: np.ndarray  # [n_engram_layers, max_ngram - 1, n_heads] int64
    offsets: np.ndarray  # [n_engram_layers, (max_ngram - 1) * n_heads] int64
    totals: tuple[int, ...]  # rows per layer table (sum of that layer's primes)


def engram_layout(cfg: Any) -> EngramLayout:
    """Prime bucket sizes: for each Engram layer in order and each n-gram size 2..max, the next
    `engram_n_heads` primes above engram_vocab_size - 1 not used by any earlier (layer, n)."""
    from sympy import isprime

    used: set[int] = set()
    all_primes, all_offsets, totals = [], [], []
    for _layer in cfg.engram_layer_ids:
        per_layer = []
        for _n in range(cfg.engram_max_ngram_size - 1):
            sizes, candidate = [], cfg.engram_vocab_size - 1
            for _h in range(cfg.engram_n_heads):
                candidate += 1
                while candidate in used or not isprime(candidate):
                    candidate += 1
                used.add(candidate)
                sizes.append(candidate)
            per_layer.append(sizes)
        flat = [q for sizes in per_layer for q in sizes]
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)
        all_primes.append(per_layer)
        all_offsets.append(offsets)
        totals.append(int(sum(flat)))
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    return EngramLayout(
        primes=np.array(all_primes, dtype=np.int64).reshape(len(totals), cfg.engram_max_ngram_size - 1,
                                                            cfg.engram_n_heads),
        offsets=np.array(all_offsets, dtype=np.int64).reshape(len(totals), n_cols),
        totals=tuple(totals),
    )


def engram_hash_multipliers(cfg: Any) -> np.ndarray:
    """[n_engram_layers, max_ngram] odd int64 multipliers, one seeded generator per layer id."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    rows = []
    for layer_id in cfg.engram_layer_ids:
        rng = np.random.default_rng(10007 * layer_id)
        rows.append(rng.integers(0, bound, cfg.engram_max_ngram_size, dtype=np.int64) * 2 + 1)
    return np.array(rows, dtype=np.int64).reshape(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size)


def engram_hash_ids(cfg: Any, token_ids: np.ndarray, token_map: np.ndarray,
                    layout: EngramLayout | None = None) -> np.ndarray:
    """Table row ids [n_engram_layers, T, (max_ngram - 1) * n_heads] (int64, offsets included).

    Position p looks back at compressed ids t_s = map[id_{p-s}], s = 0..max_ngram-1; a look-back
    before position 0 uses the pad id (sticky: once padded, every longer shift is too). Running
    XOR of t_s * mult[s]: after folding shift n the value hashes the (n+1)-gram, reduced modulo
    each head's prime and shifted by that column's offset.
    """
    layout = layout or engram_layout(cfg)
    mults = engram_hash_multipliers(cfg)
    token_map = np.asarray(token_map, dtype=np.int64)
    compressed = token_map[np.asarray(token_ids, dtype=np.int64)]
    pad = token_map[cfg.engram_pad_token_id]
    T = compressed.shape[0]
    n_max = cfg.engram_max_ngram_size
    history = np.full((T, n_max), pad, dtype=np.int64)  # history[p, s] = t_s at position p
    for s in range(min(n_max, T)):
        history[s:, s] = compressed[: T - s]
    out = []
    for li in range(len(cfg.engram_layer_ids)):
        products = history * mults[li][None, :]  # int64, cannot overflow by construction
        rolling = products[:, 0]
        cols = []
        for n in range(1, n_max):
            rolling = np.bitwise_xor(rolling, products[:, n])
            cols.append(rolling[:, None] % layout.primes[li, n - 1][None, :])
        out.append(np.concatenate(cols, axis=1) + layout.offsets[li][None, :])
    return np.stack(out) if out else np.zeros((0, T, 0), dtype=np.int64)


def _engram(cfg: Any, W: dict, layer: int, streams: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
    """Gate one looked-up value into every stream. streams [T, hc, D]; row_ids [T, n_cols]."""
    p = f"layers.{layer}.engram."
    T, hc, D = streams.shape
    eps = cfg.rms_norm_eps
    looked_up = W[p + "embed.weight"][row_ids].reshape(T, -1)  # [T, n_cols * engram_head_dim]
    kv = looked_up @ W[p + "wkv.weight"].T  # [T, (hc + 1) * D]
    key = kv[:, : hc * D].reshape(T, hc, D)
    value = kv[:, hc * D:]
    pair_w = W[p + "q_weight"] * W[p + "k_weight"]  # [hc, D]
    inv_rms = 1.0 / np.sqrt(np.mean(streams**2, axis=-1) + eps) / np.sqrt(np.mean(key**2, axis=-1) + eps)
    dot = np.sum(streams * pair_w[None] * key, axis=-1) * inv_rms * D**-0.5  # [T, hc]
    gate = _sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot))
    return streams + gate[:, :, None] * value[:, None, :]


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


def reference_forward(weights: dict[str, np.ndarray], cfg, token_ids: np.ndarray, *, fake_quant: bool = False,
                      token_map: np.ndarray | None = None) -> np.ndarray:
    """token_ids int [T] (one sequence, positions 0..T-1) -> logits float64 [T, vocab]."""
    return _forward_impl(weights, cfg, token_ids, fake_quant=fake_quant, token_map=token_map)


def _forward_impl(weights: dict[str, np.ndarray], cfg, token_ids: np.ndarray, *, fake_quant: bool = False,
                  token_map: np.ndarray | None = None, trace: dict | None = None) -> np.ndarray:
    """`reference_forward` with an optional `trace` dict that collects internals for self-checks:
    `attn_input[l]` (attn_norm output), `source_kv[s]` (entries + indexer keys of each KV source),
    `index_scores[l]` (after visibility / candidate masking), `candidates` (the pool [T, N]),
    `selected[l]` (the compressed entries layer l attends to, [T, N]), `ffn_input[l]` (ffn_norm
    output, the router's input) and `final_hidden`."""
    W = {k: np.asarray(v, dtype=F64) for k, v in weights.items()}
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D array, got shape {ids.shape}")
    T = ids.shape[0]
    hc, eps = cfg.hc_mult, cfg.rms_norm_eps
    positions = np.arange(T)

    hash_rows = None
    if cfg.engram_layer_ids:
        if token_map is None:
            raise ValueError("this config has Engram layers: pass `token_map` (see reference_token_map)")
        layout = engram_layout(cfg)
        for li, layer in enumerate(cfg.engram_layer_ids):
            rows = W[f"layers.{layer}.engram.embed.weight"].shape[0]
            if rows != layout.totals[li]:
                raise ValueError(
                    f"Engram layer {layer}: table has {rows} rows but the prime layout needs {layout.totals[li]}")
        hash_rows = engram_hash_ids(cfg, ids, token_map, layout)

    mix = dict(hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, norm_eps=eps)
    streams = np.repeat(W["embed.weight"][ids][:, None, :], hc, axis=1)  # [T, hc, D]
    pre = np.zeros((T, hc))
    pre[:, 0] = 1.0  # the first site collapses stream 0
    state: dict = {"kv": {}, "selection": {}, "candidates": None}

    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        if trace is not None:
            trace.setdefault("layer_input_streams", {})[layer] = streams
        if layer in cfg.engram_layer_ids:
            streams = _engram(cfg, W, layer, streams, hash_rows[list(cfg.engram_layer_ids).index(layer)])

        a_pre, a_post, a_comb = hc_mixes(streams, W[p + "hc_attn_fn"], W[p + "hc_attn_base"],
                                         W[p + "hc_attn_scale"], **mix)
        x = _rms_norm(_hc_collapse(streams, pre), W[p + "attn_norm.weight"], eps)
        y = _attention_layer(cfg, W, layer, x, positions, state, fake_quant, trace)
        streams = _hc_expand(y, streams, a_post, a_comb)

        f_pre, f_post, f_comb = hc_mixes(streams, W[p + "hc_ffn_fn"], W[p + "hc_ffn_base"],
                                         W[p + "hc_ffn_scale"], **mix)
        x = _rms_norm(_hc_collapse(streams, a_pre), W[p + "ffn_norm.weight"], eps)
        if trace is not None:
            trace.setdefault("ffn_input", {})[layer] = x
        y = _moe(cfg, W, layer, x)
        streams = _hc_expand(y, streams, f_post, f_comb)
        pre = f_pre

    h = _rms_norm(_hc_collapse(streams, pre), W["norm.weight"], eps)
    if trace is not None:
        trace["final_hidden"] = h
    return h @ W["head.weight"].T


# ---------------------------------------------------------------------------------------------
# random weights for self-tests (official names, float64)
# ---------------------------------------------------------------------------------------------


class WeightDraws:
    """Random draws in the conventions of `random_weights` (one generator, fixed draw order)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def lin(self, out_dim: int, in_dim: int) -> np.ndarray:
        return self.rng.standard_normal((out_dim, in_dim)) * in_dim**-0.5

    def norm(self, n: int) -> np.ndarray:
        return 1.0 + 0.1 * self.rng.standard_normal(n)


def block_core_weights(W: dict, p: str, cfg, draw: WeightDraws) -> None:
    """Norms, mHC mixes and the attention core every block has (backbone layer or draft block)."""
    D, H, hd, hc = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    mix = (2 + hc) * hc
    W[p + "attn_norm.weight"] = draw.norm(D)
    W[p + "ffn_norm.weight"] = draw.norm(D)
    for site in ("attn", "ffn"):
        W[p + f"hc_{site}_fn"] = draw.lin(mix, hc * D)
        W[p + f"hc_{site}_base"] = 0.5 * draw.rng.standard_normal(mix)
        W[p + f"hc_{site}_scale"] = 1.0 + 0.1 * draw.rng.standard_normal(3)
    a = p + "attn."
    W[a + "wq_a.weight"] = draw.lin(cfg.q_lora_rank, D)
    W[a + "q_norm.weight"] = draw.norm(cfg.q_lora_rank)
    W[a + "wq_b.weight"] = draw.lin(H * hd, cfg.q_lora_rank)
    W[a + "wkv.weight"] = draw.lin(hd, D)
    W[a + "kv_norm.weight"] = draw.norm(hd)
    W[a + "wo_a.weight"] = draw.lin(cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups)
    W[a + "wo_b.weight"] = draw.lin(D, cfg.o_groups * cfg.o_lora_rank)
    W[a + "attn_sink"] = draw.rng.standard_normal(H)


def moe_weights(W: dict, f: str, cfg, n_experts: int, draw: WeightDraws) -> None:
    """Router (weight, bias, bias_vl), `n_experts` routed experts and the shared expert under `f`."""
    D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, n_experts
    W[f + "gate.weight"] = draw.lin(E, D)
    W[f + "gate.bias"] = 0.1 * draw.rng.standard_normal(E)
    W[f + "gate.bias_vl"] = 0.1 * draw.rng.standard_normal(E)
    for e in range(E):
        W[f + f"experts.{e}.w1.weight"] = draw.lin(F, D)
        W[f + f"experts.{e}.w3.weight"] = draw.lin(F, D)
        W[f + f"experts.{e}.w2.weight"] = draw.lin(D, F)
    if cfg.n_shared_experts:
        W[f + "shared_experts.w1.weight"] = draw.lin(F, D)
        W[f + "shared_experts.w3.weight"] = draw.lin(F, D)
        W[f + "shared_experts.w2.weight"] = draw.lin(D, F)


def random_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float64 weights under the official names for a (small) config.

    Linear weights ~ N(0, 1/fan_in) so activations stay O(1) and attention / routing are far
    from uniform; norms ~ 1 + 0.1 N(0, 1); non-zero sinks and gate biases; hc scales ~ 1.
    Engram tables have exactly the rows the prime layout needs.
    """
    draw = WeightDraws(np.random.default_rng(seed))
    D, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    W: dict[str, np.ndarray] = {
        "embed.weight": draw.rng.standard_normal((cfg.vocab_size, D)),
        "head.weight": draw.lin(cfg.vocab_size, D),
        "norm.weight": draw.norm(D),
    }
    layout = engram_layout(cfg) if cfg.engram_layer_ids else None
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        ratio = cfg.compress_ratios[layer]
        block_core_weights(W, p, cfg, draw)
        a = p + "attn."
        if ratio > 0 and layer in cfg.kv_source_layer_ids:
            W[a + "compressor.wkv.weight"] = draw.lin(hd, D)
            if ratio > 1:
                W[a + "compressor.wgate.weight"] = draw.lin(hd, D)
            W[a + "compressor.norm.weight"] = draw.norm(hd)
            W[a + "indexer.wk.weight"] = draw.lin(cfg.index_head_dim, hd)
            W[a + "indexer.k_norm.weight"] = draw.norm(cfg.index_head_dim)
        if ratio > 0 and layer in cfg.index_source_layer_ids:
            W[a + "indexer.wq_b.weight"] = draw.lin(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            W[a + "indexer.weights_proj.weight"] = draw.lin(cfg.index_n_heads, D)
        moe_weights(W, p + "ffn.", cfg, cfg.n_routed_experts, draw)
        if layer in cfg.engram_layer_ids:
            li = list(cfg.engram_layer_ids).index(layer)
            g = p + "engram."
            n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            W[g + "embed.weight"] = draw.rng.standard_normal((layout.totals[li], cfg.engram_head_dim))
            W[g + "wkv.weight"] = draw.lin((hc + 1) * D, n_cols * cfg.engram_head_dim)
            W[g + "q_weight"] = draw.norm(hc * D).reshape(hc, D)
            W[g + "k_weight"] = draw.norm(hc * D).reshape(hc, D)
    return W


# ---------------------------------------------------------------------------------------------
# public entry points to single components (thin wrappers for component tests; no extra math)
# ---------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    return _rms_norm(np.asarray(x, dtype=F64), None if weight is None else np.asarray(weight, dtype=F64), eps)


def hc_collapse(streams: np.ndarray, pre: np.ndarray) -> np.ndarray:
    return _hc_collapse(np.asarray(streams, dtype=F64), np.asarray(pre, dtype=F64))


def hc_expand(y: np.ndarray, streams: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    return _hc_expand(*(np.asarray(a, dtype=F64) for a in (y, streams, post, comb)))


def attention_with_sink(q: np.ndarray, keys: np.ndarray, visible: np.ndarray, sink: np.ndarray,
                        scale: float) -> np.ndarray:
    return _attention_with_sink(np.asarray(q, dtype=F64), np.asarray(keys, dtype=F64), np.asarray(visible, bool),
                                np.asarray(sink, dtype=F64), scale)


def indexer_scores(cfg: Any, weights: dict, layer: int, x: np.ndarray, qr: np.ndarray, positions: np.ndarray,
                   entries: np.ndarray, index_keys: np.ndarray, ratio: int, *, fake_quant: bool = False) -> np.ndarray:
    """`_indexer_scores` of `layer` against a source's (entries, index_keys) of compress `ratio`."""
    W = {k: np.asarray(v, dtype=F64) for k, v in weights.items()}
    src = _SourceKV(ratio=ratio, entries=np.asarray(entries, dtype=F64), index_keys=np.asarray(index_keys, dtype=F64))
    return _indexer_scores(cfg, W, f"layers.{layer}.", np.asarray(x, dtype=F64), np.asarray(qr, dtype=F64),
                           np.asarray(positions), _layer_inv_freq(cfg, layer), src, fake_quant)


def select_candidate_blocks(scores: np.ndarray, visible_len: np.ndarray, n_blocks_keep: int, block: int) -> np.ndarray:
    return _select_candidate_blocks(np.asarray(scores, dtype=F64), np.asarray(visible_len), n_blocks_keep, block)


def select_topk(scores: np.ndarray, k: int) -> np.ndarray:
    return _select_topk(np.asarray(scores, dtype=F64), k)


def layer_inv_freq(cfg: Any, layer: int) -> np.ndarray:
    return _layer_inv_freq(cfg, layer)


def swiglu_expert(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float,
                  route_w: np.ndarray | None = None) -> np.ndarray:
    return _swiglu_expert(*(np.asarray(a, dtype=F64) for a in (x, w1, w2, w3)), limit,
                          None if route_w is None else np.asarray(route_w, dtype=F64))


def moe_layer(cfg: Any, weights: dict, layer: int, x: np.ndarray) -> np.ndarray:
    """The MoE FFN of `layer` on [T, D] (text tokens)."""
    W = {k: np.asarray(v, dtype=F64) for k, v in weights.items()}
    return _moe(cfg, W, layer, np.asarray(x, dtype=F64))


def engram_apply(cfg: Any, weights: dict, layer: int, streams: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
    """The Engram update of `layer` on streams [T, hc, D] with table rows [T, n_cols]."""
    W = {k: np.asarray(v, dtype=F64) for k, v in weights.items()}
    return _engram(cfg, W, layer, np.asarray(streams, dtype=F64), np.asarray(row_ids))


def attention_sublayers(cfg: Any, weights: dict, attn_inputs: dict, layers, *, fake_quant: bool = False,
                        trace: dict | None = None) -> dict:
    """Run `_attention_layer` for `layers` (ascending) on the given attn-normed inputs [T, D], sharing
    one publish state as the forward does; returns {layer: attention output [T, D]}."""
    W = {k: np.asarray(v, dtype=F64) for k, v in weights.items()}
    state: dict = {"kv": {}, "selection": {}, "candidates": None}
    out = {}
    for layer in layers:
        x = np.asarray(attn_inputs[layer], dtype=F64)
        out[layer] = _attention_layer(cfg, W, layer, x, np.arange(x.shape[0]), state, fake_quant, trace)
    return out


def forward_trace(weights: dict, cfg, token_ids: np.ndarray, *, fake_quant: bool = False,
                  token_map: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """`reference_forward` plus the internals trace of `_forward_impl`."""
    trace: dict = {}
    logits = _forward_impl(weights, cfg, token_ids, fake_quant=fake_quant, token_map=token_map, trace=trace)
    return logits, trace
