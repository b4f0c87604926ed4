"""A plain float64 numpy reference of the DeepSeek-V4.1 DSpark drafter (the checkpoint's `mtp.*` blocks).

Test oracle beside `v41_reference.py` (the backbone oracle, whose helpers it reuses). It imports
nothing from `deepinfer`: the config object is only read through its attributes.

What it computes (vLLM 0.33 `models/deepseek_v41/nvidia/dspark.py` and its DSpark speculator):

1. Target features. The backbone runs on the processed tokens 0..p-1; for each target layer id l
   in `dspark_target_layer_ids`, `aux_l` is the residual-stream state ENTERING layer l averaged
   over the hc streams ([p, D]). `main_x = rms_norm(concat(aux) @ mtp.0.main_proj^T, mtp.0.main_norm)`.
2. Context KV of draft block i: its own window-KV projection of `main_x` (wkv, kv_norm), RoPE at
   0..p-1 with the block's frequencies (`compress_ratios[L + i] == 0`: rope_theta, no YaRN), FP8
   fake quant when on. Only the last `sliding_window` positions [max(0, p - W), p) are attended.
3. Draft block: tokens [anchor] + [noise] * (N - 1) at positions p..p+N-1 run through the draft
   blocks, each exactly a window-only backbone layer (mHC sites, attention, MoE with
   `dspark_n_routed_experts` / `dspark_num_experts_per_tok`) except that attention is
   NON-CAUSAL: every block query sees the visible context rows and all N block rows.
4. `head_hidden = hc_collapse(streams, pre)` after the last block; `base_logits =
   rms_norm(head_hidden, mtp.{last}.norm) @ head.weight^T` (the shared backbone head).
5. Greedy sequential Markov head: prev = anchor; for j: m_j = markov_head.embed[prev],
   logits_j = base_logits[j] + m_j @ markov_head.head^T, token_j = argmax, confidence_j =
   sigmoid([head_hidden[j], m_j] @ confidence_head.proj^T), prev = token_j. Position j predicts
   the token at position p + j + 1.

Numerics: float64 except the FP8 fake quantisation (float32 arithmetic, like the backbone oracle).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .v41_reference import (
    _attention_with_sink,
    _forward_impl,
    _hc_collapse,
    _hc_expand,
    _layer_inv_freq,
    _rms_norm,
    _sigmoid,
    WeightDraws,
    apply_rope,
    block_core_weights,
    fake_quant_fp8_ue8m0,
    hc_mixes,
    moe_ffn,
    moe_weights,
)

__all__ = [
    "random_dspark_weights",
    "dspark_context",
    "draft_block_reference",
    "reference_draft",
    "dspark_moe",
]

F64 = np.float64


def _f64(weights: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=F64) for k, v in weights.items()}


def _last_prefix(cfg: Any) -> str:
    return f"mtp.{cfg.num_nextn_predict_layers - 1}."


# ---------------------------------------------------------------------------------------------
# random weights (official names, float64)
# ---------------------------------------------------------------------------------------------


def random_dspark_weights(cfg: Any, seed: int = 1) -> dict[str, np.ndarray]:
    """Random float64 `mtp.*` weights for a (small) config, same conventions as `random_weights`:
    linear weights ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N(0, 1), non-zero sinks and gate biases,
    hc scales ~ 1. Merge with the backbone's `random_weights` (the drafter uses `embed.weight` and
    `head.weight` from there)."""
    draw = WeightDraws(np.random.default_rng(seed))
    D, r = cfg.hidden_size, cfg.dspark_markov_rank
    W: dict[str, np.ndarray] = {
        "mtp.0.main_proj.weight": draw.lin(D, len(cfg.dspark_target_layer_ids) * D),
        "mtp.0.main_norm.weight": draw.norm(D),
    }
    for i in range(cfg.num_nextn_predict_layers):
        block_core_weights(W, f"mtp.{i}.", cfg, draw)
        moe_weights(W, f"mtp.{i}.ffn.", cfg, cfg.dspark_n_routed_experts, draw)
    last = _last_prefix(cfg)
    W[last + "norm.weight"] = draw.norm(D)
    W[last + "markov_head.embed.weight"] = draw.rng.standard_normal((cfg.vocab_size, r))
    W[last + "markov_head.head.weight"] = draw.rng.standard_normal((cfg.vocab_size, r)) * r**-0.5
    W[last + "confidence_head.proj.weight"] = draw.lin(1, D + r)
    return W


# ---------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------


def dspark_moe(cfg: Any, W: dict, prefix: str, x: np.ndarray, n_experts: int, k: int) -> np.ndarray:
    """The backbone's MoE (`moe_ffn`: sqrt-softplus router, selection-only bias, clamped SwiGLU,
    shared expert) for the FFN under `prefix` with `n_experts` routed experts and top-`k`."""
    assert W[prefix + "gate.weight"].shape[0] == n_experts, (W[prefix + "gate.weight"].shape, n_experts)
    return moe_ffn(cfg, W, prefix, x, n_experts, k)


def _draft_attention(cfg: Any, W: dict, prefix: str, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
                     ctx_keys: np.ndarray, ctx_visible: np.ndarray, fake_quant: bool) -> np.ndarray:
    """Non-causal block attention. x [N, D]; ctx_keys [n_ctx, hd] (roped, quantised);
    ctx_visible [n_ctx] bool -> [N, D]."""
    p = prefix + "attn."
    N = x.shape[0]
    H, hd = cfg.num_attention_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    qr = _rms_norm(x @ W[p + "wq_a.weight"].T, W[p + "q_norm.weight"], eps)
    q = apply_rope((qr @ W[p + "wq_b.weight"].T).reshape(N, H, hd), positions, inv_freq)
    kv = apply_rope(_rms_norm(x @ W[p + "wkv.weight"].T, W[p + "kv_norm.weight"], eps), positions, inv_freq)
    if fake_quant:
        kv = fake_quant_fp8_ue8m0(kv, 32)
    keys = np.concatenate([ctx_keys, kv], axis=0)
    visible = np.concatenate([np.broadcast_to(ctx_visible[None, :], (N, ctx_keys.shape[0])),
                              np.ones((N, N), dtype=bool)], axis=1)
    out = _attention_with_sink(q, keys, visible, W[p + "attn_sink"], hd**-0.5)
    out = apply_rope(out, positions, inv_freq, inverse=True)
    G, r = cfg.o_groups, cfg.o_lora_rank
    grouped = out.reshape(N, G, H * hd // G)
    wo_a = W[p + "wo_a.weight"].reshape(G, r, H * hd // G)
    mid = np.einsum("tgi,gri->tgr", grouped, wo_a).reshape(N, G * r)
    return mid @ W[p + "wo_b.weight"].T


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def dspark_context(weights: dict, cfg: Any, token_ids: np.ndarray, *, fake_quant: bool = False,
                   token_map: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Steps 1-2: (main_x [p, D], [context KV of each draft block, [p, hd], roped (+ FP8)]) for
    ALL positions 0..p-1 (the window is applied by `draft_block_reference`)."""
    W = _f64(weights)
    ids = np.asarray(token_ids, dtype=np.int64)
    trace: dict = {}
    _forward_impl(W, cfg, ids, fake_quant=fake_quant, token_map=token_map, trace=trace)
    streams_in = trace["layer_input_streams"]
    aux = []
    for layer in cfg.dspark_target_layer_ids:
        if layer not in streams_in:
            raise ValueError(f"dspark target layer {layer} is not a backbone layer (0..{cfg.num_hidden_layers - 1})")
        aux.append(streams_in[layer].mean(axis=1))  # [p, D]
    eps = cfg.rms_norm_eps
    main_x = _rms_norm(np.concatenate(aux, axis=-1) @ W["mtp.0.main_proj.weight"].T, W["mtp.0.main_norm.weight"], eps)
    positions = np.arange(ids.shape[0])
    L = cfg.num_hidden_layers
    ctx = []
    for i in range(cfg.num_nextn_predict_layers):
        a = f"mtp.{i}.attn."
        kv = _rms_norm(main_x @ W[a + "wkv.weight"].T, W[a + "kv_norm.weight"], eps)
        kv = apply_rope(kv, positions, _layer_inv_freq(cfg, L + i))
        if fake_quant:
            kv = fake_quant_fp8_ue8m0(kv, 32)
        ctx.append(kv)
    return main_x, ctx


def draft_block_reference(weights: dict, cfg: Any, context_kv_window: Sequence[np.ndarray],
                          context_positions: np.ndarray, anchor: int, p: int, *, fake_quant: bool = False,
                          block_token_ids: np.ndarray | None = None) -> dict:
    """Steps 3-5 given, per draft block, context rows [n_ctx, hd] (already roped and, when
    fake_quant, FP8-quantised) at `context_positions` [n_ctx].

    A context row is attended iff its position lies in [max(0, p - W), p), W = sliding_window, so
    passing all p rows or just the window gives the same result. The block is
    [anchor] + [dspark_noise_token_id] * (N - 1) at positions p..p+N-1 unless `block_token_ids`
    [N] overrides it (for self-tests; the Markov chain still starts from `anchor`).

    Returns {"head_hidden" [N, D], "base_logits" [N, vocab], "logits" [N, vocab],
    "tokens" [N] int64, "confidence" [N]}.
    """
    W = _f64(weights)
    n_draft, N = cfg.num_nextn_predict_layers, cfg.dspark_block_size
    hc, eps, L = cfg.hc_mult, cfg.rms_norm_eps, cfg.num_hidden_layers
    if len(context_kv_window) != n_draft:
        raise ValueError(f"need context rows for each of the {n_draft} draft blocks, got {len(context_kv_window)}")
    ctx_pos = np.asarray(context_positions, dtype=np.int64).reshape(-1)
    ctx_visible = (ctx_pos >= max(0, p - cfg.sliding_window)) & (ctx_pos < p)

    if block_token_ids is None:
        block_ids = np.array([anchor] + [cfg.dspark_noise_token_id] * (N - 1), dtype=np.int64)
    else:
        block_ids = np.asarray(block_token_ids, dtype=np.int64)
        if block_ids.shape != (N,):
            raise ValueError(f"block_token_ids must have shape ({N},), got {block_ids.shape}")
    positions = p + np.arange(N)

    mix = dict(hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, norm_eps=eps)
    streams = np.repeat(W["embed.weight"][block_ids][:, None, :], hc, axis=1)  # [N, hc, D]
    pre = np.zeros((N, hc))
    pre[:, 0] = 1.0
    for i in range(n_draft):
        pf = f"mtp.{i}."
        ctx = np.asarray(context_kv_window[i], dtype=F64).reshape(ctx_pos.shape[0], cfg.head_dim)
        a_pre, a_post, a_comb = hc_mixes(streams, W[pf + "hc_attn_fn"], W[pf + "hc_attn_base"],
                                         W[pf + "hc_attn_scale"], **mix)
        x = _rms_norm(_hc_collapse(streams, pre), W[pf + "attn_norm.weight"], eps)
        y = _draft_attention(cfg, W, pf, x, positions, _layer_inv_freq(cfg, L + i), ctx, ctx_visible, fake_quant)
        streams = _hc_expand(y, streams, a_post, a_comb)

        f_pre, f_post, f_comb = hc_mixes(streams, W[pf + "hc_ffn_fn"], W[pf + "hc_ffn_base"],
                                         W[pf + "hc_ffn_scale"], **mix)
        x = _rms_norm(_hc_collapse(streams, a_pre), W[pf + "ffn_norm.weight"], eps)
        y = dspark_moe(cfg, W, pf + "ffn.", x, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        streams = _hc_expand(y, streams, f_post, f_comb)
        pre = f_pre

    last = _last_prefix(cfg)
    head_hidden = _hc_collapse(streams, pre)  # [N, D], before any norm
    base_logits = _rms_norm(head_hidden, W[last + "norm.weight"], eps) @ W["head.weight"].T

    m_embed = W[last + "markov_head.embed.weight"]
    m_head = W[last + "markov_head.head.weight"]
    conf_w = W[last + "confidence_head.proj.weight"]  # [1, D + r]
    logits = np.empty_like(base_logits)
    tokens = np.empty(N, dtype=np.int64)
    confidence = np.empty(N, dtype=F64)
    prev = int(anchor)
    for j in range(N):
        m = m_embed[prev]  # [r]
        logits[j] = base_logits[j] + m_head @ m
        tokens[j] = int(np.argmax(logits[j]))
        confidence[j] = float(_sigmoid(np.concatenate([head_hidden[j], m]) @ conf_w[0]))
        prev = int(tokens[j])
    return {"head_hidden": head_hidden, "base_logits": base_logits, "logits": logits, "tokens": tokens,
            "confidence": confidence}


def reference_draft(weights: dict, cfg: Any, token_ids: np.ndarray, anchor: int, *, fake_quant: bool = False,
                    token_map: np.ndarray | None = None) -> dict:
    """One greedy DSpark draft. `token_ids` [p]: the tokens the target has processed (positions
    0..p-1); `anchor`: the token at position p (just sampled from the target). `weights` holds the
    backbone and the `mtp.*` tensors.

    Returns {"main_x" [p, D], "context_kv" (per block [p, hd], roped + fake-quantised),
    "head_hidden" [N, D], "base_logits" [N, vocab], "logits" [N, vocab], "tokens" [N] int64
    (tokens[j] drafts position p + j + 1), "confidence" [N]}.
    """
    main_x, ctx = dspark_context(weights, cfg, token_ids, fake_quant=fake_quant, token_map=token_map)
    p = main_x.shape[0]
    lo = max(0, p - cfg.sliding_window)
    block = draft_block_reference(weights, cfg, [c[lo:] for c in ctx], np.arange(lo, p), anchor, p,
                                  fake_quant=fake_quant)
    return {"main_x": main_x, "context_kv": ctx, **block}
