"""Phase 2 of `train_tiny.py` (`--phase drafter`): the DSpark drafter (`mtp.*`) trained on the
frozen trained target's own distributions with the DSpark loss (engine-features.md §2.2):
`0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV)`, each position k weighted by exp(-(k-1)/4).

The drafter runs through the project's own functions (`drafter.context_input`, `context_kv`,
`draft_hidden`), many blocks per sequence at once: anchors at deterministic random positions p,
the anchor token at p and noise after it; position j predicts token p+j+1, the Markov head
biased by the PREVIOUS ground-truth token (teacher forcing), the target's distribution at
position p+j is the teacher. As in the target phase only vocabulary rows U are kept: the shared
embedding/head are the target's U rows, the Markov head's rows outside U are zero in the
exported model, so both distributions carry the same exact `n_rest * exp(0)` tail.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import train_tiny as tt
from deepinfer.model import qat
from deepinfer.model.config import ModelConfig
from deepinfer.model.drafter import context_input, context_kv, draft_hidden
from deepinfer.model.forward import backbone, final_hidden
from deepinfer.model.layers import gather_rows, linear, rms_norm
from deepinfer.model.params import dspark_specs, init_params

CE_ALPHA, TV_ALPHA, CONF_ALPHA, DECAY_GAMMA = 0.1, 0.9, 1.0, 4.0  # DeepSpec dspark loss config


def init_drafter_params(config: ModelConfig, used_ids: np.ndarray, seed: int) -> list:
    """Trainable `mtp` blocks: seeded init, Markov rows for U only (head rows zero, so the bias
    starts at 0), output projections shrunk as in the target."""
    mtp = init_params(config, seed)["mtp"]
    ids = jnp.asarray(used_ids)
    markov = mtp[-1]["markov_head"]
    markov["embed"] = markov["embed"][ids]
    markov["head"] = jnp.zeros((len(used_ids), config.dspark_markov_rank), markov["head"].dtype)
    tt.shrink_output_projections(mtp)
    return mtp


def export_drafter(mtp: list, config: ModelConfig, used_ids: np.ndarray, seed: int) -> list:
    """Full-vocabulary `mtp` blocks: Markov embedding rows outside U at their seeded init, head rows zero."""
    full = init_params(config, seed)["mtp"][-1]["markov_head"]
    ids = jnp.asarray(used_ids)
    out = jax.tree.map(lambda a: a, mtp)
    out[-1]["markov_head"] = {"embed": full["embed"].at[ids].set(mtp[-1]["markov_head"]["embed"]),
                              "head": jnp.zeros_like(full["head"]).at[ids].set(mtp[-1]["markov_head"]["head"])}
    return out


def _log_probs(logits_u: jax.Array, n_rest: int) -> tuple[jax.Array, jax.Array]:
    """(log p over U, log p of each of the n_rest tokens with logit 0)."""
    lse = jax.nn.logsumexp(logits_u, axis=-1, keepdims=True)
    log_z = jnp.logaddexp(lse, jnp.log(jnp.float32(n_rest))) if n_rest else lse
    return logits_u - log_z, -log_z[..., 0]


def dspark_terms(draft_logits: jax.Array, target_logits: jax.Array, truth: jax.Array, confidence: jax.Array,
                 n_rest: int) -> dict[str, jax.Array]:
    """Per-position DSpark terms `[..., N]`: CE of the ground truth, total variation to the
    target, BCE of the confidence against the analytic acceptance `1 - TV` (no gradient)."""
    lp_d, rest_d = _log_probs(draft_logits.astype(jnp.float32), n_rest)
    lp_t, rest_t = _log_probs(jax.lax.stop_gradient(target_logits.astype(jnp.float32)), n_rest)
    tv = 0.5 * (jnp.sum(jnp.abs(jnp.exp(lp_d) - jnp.exp(lp_t)), axis=-1)
                + n_rest * jnp.abs(jnp.exp(rest_d) - jnp.exp(rest_t)))
    ce = -jnp.take_along_axis(lp_d, truth[..., None], axis=-1)[..., 0]
    accept = jax.lax.stop_gradient(jnp.clip(1.0 - tv, 0.0, 1.0))
    c = jnp.clip(confidence, 1e-6, 1 - 1e-6)
    bce = -(accept * jnp.log(c) + (1 - accept) * jnp.log1p(-c))
    return {"ce": ce, "tv": tv, "bce": bce, "accept": accept}


def dspark_loss(terms: dict[str, jax.Array]) -> jax.Array:
    N = terms["ce"].shape[-1]
    w = jnp.exp(-jnp.arange(N, dtype=jnp.float32) / DECAY_GAMMA)
    per = CE_ALPHA * terms["ce"] + TV_ALPHA * terms["tv"] + CONF_ALPHA * terms["bce"]
    return jnp.mean(jnp.sum(per * w, axis=-1) / jnp.sum(w))


def anchor_positions(step: int, seed: int, batch: int, anchors: int, seq_len: int, block: int) -> np.ndarray:
    """Deterministic anchors `[B, A]` in [1, T - N] (each block's N targets lie inside the window)."""
    rng = np.random.default_rng([seed, 7, step])
    return np.sort(rng.integers(1, seq_len - block + 1, (batch, anchors)), axis=1).astype(np.int32)


def drafter_forward(mtp: list, target: dict, config: ModelConfig, inputs_u: jax.Array, hash_ids, anchors: jax.Array,
                    noise_u: int, use_weight_qat: bool):
    """(draft logits over U `[B*A, N, U]`, confidence logits (pre-sigmoid) `[B*A, N]`, target logits `[B*A, N, U]`,
    ground truth / previous tokens `[B*A, N]` as U indices) for anchors `[B, A]`."""
    B, T = inputs_u.shape
    A, N, W = anchors.shape[1], config.dspark_block_size, config.sliding_window
    tq = tt.weight_qat(target, config) if use_weight_qat else target
    dq = tt.weight_qat({"mtp": mtp}, config, dspark_specs(config))["mtp"] if use_weight_qat else mtp
    streams, pre, means = backbone(tq, config, inputs_u, hash_ids, capture=config.dspark_target_layer_ids)
    t_logits = jnp.einsum("btd,vd->btv", final_hidden(tq, config, streams, pre), tq["head"])
    means = [jax.lax.stop_gradient(m) for m in means]
    params = {"mtp": dq, "embed": jnp.concatenate([tq["embed"], target["noise_row"][None]]), "head": tq["head"]}
    main_x = context_input(params, config, means)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx_idx = anchors[..., None] - W + jnp.arange(W, dtype=jnp.int32)  # [B, A, W]
    ctx_pos = jnp.where(ctx_idx >= 0, ctx_idx, -1).reshape(B * A, W)
    gather = jnp.maximum(ctx_idx, 0).reshape(B, A * W)
    ctx = []
    for i in range(len(dq)):
        kv = qat.window_kv(context_kv(params, config, i, main_x, positions), config)  # [B, T, hd]
        ctx.append(jnp.take_along_axis(kv, gather[..., None], axis=1).reshape(B * A, W, -1))
    anchor_tok = jnp.take_along_axis(inputs_u, anchors, axis=1).reshape(B * A)
    cfg = dataclasses.replace(config, dspark_noise_token_id=noise_u)
    hidden = draft_hidden(params, cfg, ctx, ctx_pos, anchor_tok, anchors.reshape(B * A))  # [B*A, N, D]
    last = dq[-1]
    base = linear(rms_norm(hidden, last["norm"], config.rms_norm_eps), tq["head"]).astype(jnp.float32)
    offsets = anchors[..., None] + jnp.arange(N, dtype=jnp.int32)  # positions p..p+N-1: predict the next token
    prev = jnp.take_along_axis(inputs_u, offsets.reshape(B, A * N), axis=1).reshape(B * A, N)
    m = gather_rows(last["markov_head"]["embed"], prev, jnp.float32)  # [B*A, N, r]
    logits = base + linear(m, last["markov_head"]["head"])
    proj = last["confidence_head"]["proj"]
    conf_logit = linear(jnp.concatenate([hidden.astype(jnp.float32), m], axis=-1), proj)[..., 0]
    t_sel = jnp.take_along_axis(t_logits, offsets.reshape(B, A * N)[..., None], axis=1).reshape(B * A, N, -1)
    return logits, conf_logit, t_sel, offsets


def drafter_loss(mtp, target, config, batch, noise_u: int, use_weight_qat: bool):
    logits, conf_logit, t_logits, offsets = drafter_forward(mtp, target, config, batch["inputs"],
                                                            batch.get("hash_ids"), batch["anchors"], noise_u,
                                                            use_weight_qat)
    B = batch["inputs"].shape[0]
    truth = jnp.take_along_axis(batch["targets"], offsets.reshape(B, -1), axis=1).reshape(conf_logit.shape)
    n_rest = config.vocab_size - target["head"].shape[0]
    terms = dspark_terms(logits, t_logits, jnp.maximum(truth, 0), jax.nn.sigmoid(conf_logit), n_rest)
    return dspark_loss(terms), {**terms, "conf_logit": conf_logit}


@functools.lru_cache(maxsize=4)
def make_drafter_step(config: ModelConfig, steps: int, lr: float, warmup: int, use_weight_qat: bool, noise_u: int):
    optimizer = tt.make_optimizer(steps, lr, warmup)

    def step(mtp, opt_state, batch, target):
        (loss, _), grads = jax.value_and_grad(drafter_loss, has_aux=True)(mtp, target, config, batch, noise_u,
                                                                          use_weight_qat)
        updates, opt_state = optimizer.update(grads, opt_state, mtp)
        return optax.apply_updates(mtp, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def target_run(run: tt.RunConfig) -> tt.RunConfig:
    """The target phase's settings, saved in RUN_DIR/run.json by `train_tiny.main`."""
    saved = pathlib.Path(run.out) / "run.json"
    if not saved.is_file():
        raise SystemExit(f"{saved} is missing: train the target (phase target) in {run.out} first")
    return tt.RunConfig(**json.loads(saved.read_text()))


def load_target(run: tt.RunConfig) -> tuple[dict, dict]:
    """(target setup dict, trained target params); refuses an unfinished target."""
    trun = target_run(run) if run.phase == "drafter" else run
    s = tt.setup(trun)
    if s["state"]["step"] < trun.steps:
        raise SystemExit(f"the target in {run.out} is at step {s['state']['step']} of {trun.steps}: "
                         "finish phase target first (rerun its command to resume)")
    return s, s["state"]["params"]


def drafter_state(run: tt.RunConfig, config: ModelConfig, used: np.ndarray):
    """(the drafter's initial or latest checkpointed state, its checkpoint manager)."""
    optimizer = tt.make_optimizer(run.steps, run.lr, run.warmup)
    mtp = init_drafter_params(config, used, run.seed)
    mngr = tt.checkpoint_manager(run, "ckpt-drafter")
    return tt.restore_latest(mngr, {"params": mtp, "opt_state": optimizer.init(mtp), "step": 0}), mngr


def train_drafter(run: tt.RunConfig, *, stop_after: int | None = None, progress: bool = True,
                  target_setup: tuple[dict, dict] | None = None) -> dict:
    """Phase drafter: train `mtp.*` on the frozen target of `run.out` (checkpoints in
    RUN_DIR/ckpt-drafter, metrics in metrics-drafter.jsonl)."""
    s, target = target_setup or load_target(run)
    config, used = s["config"], s["used"]
    noise = config.dspark_noise_token_id
    noise_u = int(s["batches"].to_u[noise]) if s["batches"].to_u[noise] >= 0 else len(used)
    # the noise token's row of the exported embedding (its seeded init when it is outside U)
    target = {**target, "noise_row": init_params(config, run.seed)["embed"][noise]}
    tokens = s["batches"].tokens
    batches = tt.Batches(tokens, used, config, run.seq_len, run.batch, run.seed + 1)
    state, mngr = drafter_state(run, config, used)
    jitted = make_drafter_step(config, run.steps, run.lr, run.warmup, run.weight_qat, noise_u)

    def get_batch(step: int) -> dict:
        b = batches.get(step)
        b["anchors"] = anchor_positions(step, run.seed, run.batch, run.anchors, run.seq_len, config.dspark_block_size)
        return b

    out = tt.run_loop(run, state, mngr, lambda p, o, b: jitted(p, o, b, target), get_batch, "metrics-drafter.jsonl",
                      stop_after=stop_after, progress=progress)
    return {**out, "noise_u": noise_u, "target": target, "setup": s}


# ---- Sequential Temperature Scaling of the confidence head ---------------------------------


def cumulative_ece(pred: np.ndarray, label: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error of predictions in [0, 1] against (soft) labels, equal-width bins."""
    pred, label = np.asarray(pred, np.float64).ravel(), np.asarray(label, np.float64).ravel()
    which = np.minimum((pred * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            err += sel.sum() / pred.size * abs(pred[sel].mean() - label[sel].mean())
    return err


def fit_sts(conf_logits: np.ndarray, accept: np.ndarray, grid: np.ndarray | None = None) -> dict:
    """Sequential Temperature Scaling (engine-features.md §2.2): left to right, position k's
    temperature is the grid value minimising the ECE of the cumulative product
    `prod_{i<=k} sigmoid(z_i / T_i)` against the cumulative acceptance `prod_{i<=k} accept_i`
    (analytic rates, soft labels), earlier temperatures fixed. `conf_logits`, `accept`: `[n, N]`.
    Returns the temperatures and the per-position ECE before and after."""
    z, a = np.asarray(conf_logits, np.float64), np.asarray(accept, np.float64)
    grid = np.exp(np.linspace(np.log(0.25), np.log(8.0), 61)) if grid is None else np.asarray(grid)
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    labels = np.cumprod(a, axis=1)
    temps, before, after = [], [], []
    prefix = np.ones(z.shape[0])
    raw_prefix = np.ones(z.shape[0])
    for k in range(z.shape[1]):
        raw_prefix = raw_prefix * sig(z[:, k])
        before.append(cumulative_ece(raw_prefix, labels[:, k]))
        errs = [cumulative_ece(prefix * sig(z[:, k] / t), labels[:, k]) for t in grid]
        best = int(np.argmin(errs))
        temps.append(float(grid[best]))
        after.append(float(errs[best]))
        prefix = prefix * sig(z[:, k] / grid[best])
    return {"temperatures": temps, "ece_before": before, "ece_after": after}


def sts_phase(run: tt.RunConfig, *, target_setup: tuple[dict, dict] | None = None) -> dict:
    """`--phase sts`: run the trained drafter on the fixed held-out windows (`run.anchors` blocks
    each, scored like the exported model: tokens outside U at their seeded rows), fit STS on the
    analytic acceptance rates, write RUN_DIR/sts.json."""
    s, target = target_setup or load_target(run)
    config, used = s["config"], s["used"]
    state, _ = drafter_state(run, config, used)
    if state["step"] < run.steps:
        raise SystemExit(f"the drafter in {run.out} is at step {state['step']} of {run.steps}: finish phase drafter")
    held = tt.HeldOut(run, s)
    ext = held.params(target)
    n_extra = ext["embed"].shape[0] - len(used)
    init = init_params(config, run.seed)
    noise = config.dspark_noise_token_id
    noise_u = int(held.to_u[noise]) if held.to_u[noise] >= 0 else ext["embed"].shape[0]
    ext["noise_row"] = init["embed"][noise]
    mtp = jax.tree.map(lambda a: a, state["params"])
    markov = mtp[-1]["markov_head"]
    extra_ids = jnp.asarray(held.extra_ids)
    markov["embed"] = jnp.concatenate([markov["embed"], init["mtp"][-1]["markov_head"]["embed"][extra_ids]])
    markov["head"] = jnp.concatenate([markov["head"], jnp.zeros((n_extra, markov["head"].shape[1]))])
    fn = jax.jit(lambda m, t, b: drafter_loss(m, t, config, b, noise_u, run.weight_qat)[1])
    logits, accept = [], []
    for i, b in enumerate(held.batches):
        b = dict(b, anchors=anchor_positions(i, run.seed + 99, b["inputs"].shape[0], run.anchors, run.seq_len,
                                             config.dspark_block_size))
        terms = fn(mtp, ext, b)
        logits.append(np.asarray(terms["conf_logit"]))
        accept.append(np.asarray(terms["accept"]))
    fitted = fit_sts(np.concatenate(logits), np.concatenate(accept))
    fitted["blocks"] = int(sum(len(x) for x in logits))
    (pathlib.Path(run.out) / "sts.json").write_text(json.dumps(fitted, indent=1))
    return fitted
