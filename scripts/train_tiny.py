"""Train the tiny DeepSeek-V4.1 target on the standard-library corpus (`train_data.py`):
seeded, resumable (orbax checkpoints every few minutes, same data order after a restart),
with a progress bar showing loss and tokens/s.

The model is the project's own (`deepinfer.model.forward.backbone` / `final_hidden`), every
V4.1 mechanism on, QAT fake-quant on: the activation roundings of the release (`config.fake_quant`)
and, with `--weight-qat` (default on), the FP8 / MXFP4 rounding the checkpoint writer applies
to the stored weights, all with straight-through gradients (`deepinfer.ops.quant`).

Vocabulary: the corpus uses a few tens of thousands of the 129,280 ids (set U). Training keeps
embedding and head rows for U only; the head rows outside U are zero in the exported model, so
their logits are exactly 0 and the full softmax denominator is `sum_U exp(l) + N_rest * exp(0)`,
which `u_loss` computes without the other rows. Embedding rows outside U keep their seeded init.

Run: `python scripts/train_tiny.py --out RUN_DIR [--steps N ...]`; rerunning the same command
resumes from the last checkpoint in RUN_DIR/ckpt (SIGTERM saves one before exiting). Then
`--phase drafter` trains the DSpark drafter on the finished target and `--phase sts` (with the
drafter's settings) fits its confidence temperatures (`train_drafter.py`).

Shipping (not done here): `export_params` / `train_drafter.export_drafter` give full-vocabulary
dense params; `deepinfer.model.checkpoint.write_checkpoint` stores them in the official format,
rounding FP8/FP4 tensors exactly as the weight QAT did (tests/test_train_tiny.py checks it bit for
bit) and the rest to bf16/f32. Only U rows of embed/head/Markov head and the layers differ from
the seeded init, which is what a compact shipped file needs to store.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_data  # noqa: E402  (the sibling script, also when imported from tests)

from deepinfer.ops import quant  # noqa: E402
from deepinfer.model.config import TINY_V41, ModelConfig  # noqa: E402
from deepinfer.model.engram_hash import hasher_for  # noqa: E402
from deepinfer.model.forward import backbone, final_hidden  # noqa: E402
from deepinfer.model.params import FP4, FP8, FP8_ROWS, init_params, param_specs, tree_get  # noqa: E402

# name -> overrides of tiny-v4.1. "tiny": its widths and layer schedule, kept after measuring
# tokens/s on 2 cores (the 129k-row vocabulary and the 512-token attention dominate; wider layers
# would cut the tokens seen in the budget). "test": a 5-layer schedule that still has every
# mechanism (ratio-2 source + reuse, ratio-1 candidate source, reindex in the candidate pool,
# Engram), for fast tests.
MODELS = {
    "tiny": {},
    "test": dict(num_hidden_layers=5, num_nextn_predict_layers=1, compress_ratios=(0, 2, 2, 1, 1, 0),
                 kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3,
                 engram_layer_ids=(1,), engram_num_embeddings=(12458,), dspark_target_layer_ids=(3, 4)),
}


def model_config(model: str = "tiny") -> ModelConfig:
    """The trained model's config: tiny-v4.1 (every mechanism on) with `MODELS[model]`."""
    if model not in MODELS:
        raise ValueError(f"unknown --model {model!r}; choose one of {sorted(MODELS)}")
    return dataclasses.replace(TINY_V41, name=f"tiny-v4.1-py-{model}", **MODELS[model])


# ---- parameters ------------------------------------------------------------------------


def init_train_params(config: ModelConfig, used_ids: np.ndarray, seed: int) -> dict:
    """Trainable float32 params of the target: `init_params` without the drafter blocks, with
    `embed` / `head` reduced to the rows of `used_ids`, and a training-friendly scaling:
    the output projections shrink (`shrink_output_projections`)."""
    full = init_params(config, seed)
    full.pop("mtp", None)
    params = jax.tree.map(lambda a: a, full)
    params["embed"] = full["embed"][jnp.asarray(used_ids)]
    params["head"] = full["head"][jnp.asarray(used_ids)]
    shrink_output_projections(params["layers"])
    return params


def shrink_output_projections(blocks: list) -> None:
    """Scale each block's sublayer output projections (attention `wo_b`, experts' `w2`) by
    1/sqrt(2 * blocks), in place: the residual stream then grows gently through the blocks."""
    shrink = 1.0 / math.sqrt(2 * len(blocks))
    for bp in blocks:
        bp["attn"]["wo_b"] = bp["attn"]["wo_b"] * shrink
        for name in ("experts", "shared_experts"):
            if name in bp["ffn"]:
                bp["ffn"][name]["w2"] = bp["ffn"][name]["w2"] * shrink


def export_params(params: dict, config: ModelConfig, used_ids: np.ndarray, seed: int) -> dict:
    """Full-vocabulary dense params (what `write_checkpoint` quantizes): U rows from training,
    other embedding rows at their seeded init, other head rows zero. The drafter is not included."""
    full = init_params(config, seed)
    full.pop("mtp", None)
    out = dict(params)
    ids = jnp.asarray(used_ids)
    out["embed"] = full["embed"].at[ids].set(params["embed"])
    out["head"] = jnp.zeros_like(full["head"]).at[ids].set(params["head"])
    return out


def weight_qat(params: dict, config: ModelConfig, specs=None) -> dict:
    """The params as the checkpoint will store them (FP8 2-D blocks, FP8 rows, MXFP4 experts),
    with straight-through gradients. `specs`: the tensors to round (default: the target's)."""
    out = jax.tree.map(lambda a: a, params)
    for spec in param_specs(config, include_mtp=False) if specs is None else specs:
        if spec.storage not in (FP8, FP8_ROWS, FP4):
            continue
        *parents, last = spec.path
        node = tree_get(out, tuple(parents))
        w = node[last]
        if spec.storage == FP8:
            node[last] = quant.fake_quant_weight_fp8(w, config.weight_block_size)
        elif spec.storage == FP8_ROWS:
            node[last] = quant.fake_quant_fp8(w, block=32)
        else:
            node[last] = quant.fake_quant_fp4(w, block=32, e4m3_scales=False)
    return out


# ---- loss ------------------------------------------------------------------------------


def u_log_softmax_nll(logits_u: jax.Array, targets_u: jax.Array, n_rest: int) -> jax.Array:
    """Per-token NLL of the full-vocabulary softmax whose logits outside U are exactly 0:
    `logZ = log(sum_U exp(l) + n_rest)`; `targets_u` index into U (-1: a token outside U, logit 0)."""
    logits_u = logits_u.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits_u, axis=-1)
    log_z = jnp.logaddexp(lse, jnp.log(jnp.float32(n_rest))) if n_rest else lse
    picked = jnp.take_along_axis(logits_u, jnp.maximum(targets_u, 0)[..., None], axis=-1)[..., 0]
    return log_z - jnp.where(targets_u >= 0, picked, 0.0)


def u_loss(params: dict, config: ModelConfig, inputs_u: jax.Array, hash_ids: jax.Array | None,
           targets_u: jax.Array, *, use_weight_qat: bool = True) -> jax.Array:
    """Mean next-token NLL over `[B, T]` (inputs as indices into U)."""
    p = weight_qat(params, config) if use_weight_qat else params
    streams, pre, _ = backbone(p, config, inputs_u, hash_ids)
    h = final_hidden(p, config, streams, pre)
    logits = jnp.einsum("btd,vd->btv", h, p["head"].astype(h.dtype))
    n_rest = config.vocab_size - p["head"].shape[0]
    return jnp.mean(u_log_softmax_nll(logits, targets_u, n_rest))


# ---- data order --------------------------------------------------------------------------


class Batches:
    """Deterministic batches: the train tokens cut into `seq_len + 1` windows (stride seq_len);
    batch `step` takes the next `batch` windows of a per-epoch permutation seeded by (seed, epoch).
    Depends only on the step, so a resumed run sees exactly the batches it would have seen."""

    def __init__(self, tokens: np.ndarray, used_ids: np.ndarray, config: ModelConfig, seq_len: int, batch: int,
                 seed: int):
        self.tokens, self.seq_len, self.batch, self.seed = tokens, seq_len, batch, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one window of {seq_len + 1}")
        self.to_u = np.full((config.vocab_size,), -1, np.int32)
        self.to_u[used_ids] = np.arange(len(used_ids), dtype=np.int32)
        self.hasher = hasher_for(config) if config.engram_layer_ids else None
        self._perm: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._perm[epoch]

    def window_ids(self, step: int) -> np.ndarray:
        g = step * self.batch + np.arange(self.batch)
        return np.array([self._permutation(int(i // self.n_windows))[i % self.n_windows] for i in g])

    def get(self, step: int) -> dict[str, np.ndarray]:
        starts = self.window_ids(step) * self.seq_len
        ids = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in starts]).astype(np.int32)
        return make_batch(ids, self.to_u, self.hasher)


def make_batch(ids: np.ndarray, to_u: np.ndarray, hasher) -> dict[str, np.ndarray]:
    """Real token ids `[B, T+1]` -> model inputs (U indices), Engram hash ids, targets (U or -1)."""
    inputs = ids[:, :-1]
    u_in = to_u[inputs]
    if (u_in < 0).any():
        raise ValueError("an input token is outside the trained vocabulary U")
    out = {"inputs": u_in, "targets": to_u[ids[:, 1:]]}
    if hasher is not None:
        out["hash_ids"] = hasher.hash_ids_batch(inputs)
    return out


# ---- training ----------------------------------------------------------------------------


def make_optimizer(steps: int, lr: float, warmup: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), max(steps, 2),
                                                  end_value=lr * 0.1)
    decay_mask = lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


@functools.lru_cache(maxsize=4)
def make_train_step(config: ModelConfig, steps: int, lr: float, warmup: int, use_weight_qat: bool):
    """The jitted update (cached: a resumed run in the same process reuses the compiled step)."""
    optimizer = make_optimizer(steps, lr, warmup)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(u_loss)(params, config, batch["inputs"], batch.get("hash_ids"),
                                                 batch["targets"], use_weight_qat=use_weight_qat)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=4)
def make_eval(config: ModelConfig, use_weight_qat: bool):
    def ev(params, batch):
        return u_loss(params, config, batch["inputs"], batch.get("hash_ids"), batch["targets"],
                      use_weight_qat=use_weight_qat)

    return jax.jit(ev)


@dataclasses.dataclass
class RunConfig:
    out: str
    steps: int = 3000
    batch: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    warmup: int = 100
    seed: int = 0
    model: str = "tiny"
    weight_qat: bool = True
    ckpt_minutes: float = 10.0
    eval_every: int = 250
    eval_windows: int = 16
    max_train_tokens: int = 0  # > 0: use only the first N train tokens (tests)
    corpus_root: str = ""  # a directory of .py files instead of the standard library (tests)
    phase: str = "target"  # target | drafter | sts (train_drafter.py; need the finished earlier phase)
    anchors: int = 16  # drafter phase: draft blocks per sequence and step


def checkpoint_manager(run: RunConfig, name: str = "ckpt") -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    return ocp.CheckpointManager(pathlib.Path(run.out).resolve() / name, options=options)


def restore_latest(mngr: ocp.CheckpointManager, state: dict) -> dict:
    """The latest checkpoint of `mngr` shaped like `state`, or `state` itself when there is none."""
    if mngr.latest_step() is None:
        return state
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
    restored["step"] = int(restored["step"])
    return restored


def setup(run: RunConfig):
    """Corpus, config, U, batches, initial (or restored) state. Returns a dict of everything."""
    meta = train_data.build_corpus(run.out, run.corpus_root or None)
    config = model_config(run.model)
    used = train_data.load_used_ids(run.out)
    tokens = train_data.load_split(run.out, "train")
    if run.max_train_tokens:
        tokens = tokens[: run.max_train_tokens]
    batches = Batches(tokens, used, config, run.seq_len, run.batch, run.seed)
    optimizer = make_optimizer(run.steps, run.lr, run.warmup)
    params = init_train_params(config, used, run.seed)
    state = {"params": params, "opt_state": optimizer.init(params), "step": 0}
    mngr = checkpoint_manager(run)
    state = restore_latest(mngr, state)
    return dict(meta=meta, config=config, used=used, batches=batches, optimizer=optimizer, state=state, mngr=mngr)


class HeldOut:
    """Fixed held-out windows (evenly spaced) scored exactly as the exported full-vocabulary
    model scores them: tokens outside U get their seeded embedding rows and zero head rows
    (appended after U, so `u_loss`'s `n_rest` shrinks accordingly)."""

    def __init__(self, run: RunConfig, s: dict):
        held = train_data.load_split(run.out, "heldout")
        n = (len(held) - 1) // run.seq_len
        picks = np.linspace(0, n - 1, num=min(run.eval_windows, n)).astype(int) * run.seq_len
        ids = np.stack([np.asarray(held[p: p + run.seq_len + 1]) for p in picks]).astype(np.int32)
        b = s["batches"]
        self.extra_ids = np.setdiff1d(np.unique(ids), s["used"]).astype(np.int32)
        self.to_u = b.to_u.copy()
        self.to_u[self.extra_ids] = len(s["used"]) + np.arange(len(self.extra_ids), dtype=np.int32)
        self.extra_embed = init_params(s["config"], run.seed)["embed"][jnp.asarray(self.extra_ids)]
        self.batches = [make_batch(ids[i: i + run.batch], self.to_u, b.hasher)
                        for i in range(0, len(ids), run.batch)]

    def params(self, params: dict) -> dict:
        out = dict(params)
        out["embed"] = jnp.concatenate([params["embed"], self.extra_embed])
        out["head"] = jnp.concatenate([params["head"], jnp.zeros_like(self.extra_embed)])
        return out


def save(mngr: ocp.CheckpointManager, state: dict) -> None:
    mngr.save(state["step"], args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()


def train(run: RunConfig, *, stop_after: int | None = None, progress: bool = True) -> dict:
    """Train the target until `run.steps` (or `stop_after` more steps). Returns the final state
    and this call's losses."""
    s = setup(run)
    step_fn = make_train_step(s["config"], run.steps, run.lr, run.warmup, run.weight_qat)
    eval_fn = make_eval(s["config"], run.weight_qat)
    held = HeldOut(run, s) if run.eval_every else None

    def evaluate(params) -> dict:
        eval_params = held.params(params)
        return {"heldout_loss": float(np.mean([float(eval_fn(eval_params, b)) for b in held.batches]))}

    out = run_loop(run, s["state"], s["mngr"], step_fn, s["batches"].get, "metrics.jsonl",
                   evaluate if held is not None else None, stop_after=stop_after, progress=progress)
    return {**out, "setup": s}


def run_loop(run: RunConfig, state: dict, mngr: ocp.CheckpointManager, step_fn, get_batch, metrics_name: str,
             evaluate=None, *, stop_after: int | None = None, progress: bool = True) -> dict:
    """The training loop both phases share: `step_fn(params, opt_state, batch) -> (params,
    opt_state, loss)` on `get_batch(step)`, a progress bar, one JSON line of metrics per step,
    `evaluate(params) -> dict` every `run.eval_every` steps, a checkpoint every
    `run.ckpt_minutes` and at the end (also after SIGTERM, when `progress`)."""
    from tqdm import tqdm

    metrics = open(pathlib.Path(run.out) / metrics_name, "a")
    stop = {"now": False}
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True)) if progress else None
    end = run.steps if stop_after is None else min(run.steps, state["step"] + stop_after)
    tokens_per_step = run.batch * run.seq_len
    losses: list[float] = []
    last_ckpt, rate = time.monotonic(), None
    bar = tqdm(total=run.steps, initial=state["step"], disable=not progress, mininterval=5, smoothing=0.05)
    params, opt_state = state["params"], state["opt_state"]
    try:
        while state["step"] < end and not stop["now"]:
            t0, c0 = time.monotonic(), time.process_time()
            batch = get_batch(state["step"])
            params, opt_state, loss = step_fn(params, opt_state, batch)
            loss = float(loss)
            state["step"] += 1
            dt = time.monotonic() - t0
            if losses:  # the first step of a process includes compiling the step
                rate = tokens_per_step / dt if rate is None else 0.9 * rate + 0.1 * tokens_per_step / dt
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s="-" if rate is None else f"{rate:.0f}", refresh=False)
            bar.update(1)
            record = {"step": state["step"], "loss": loss, "tok_s": round(tokens_per_step / dt, 1),
                      "cpu_s": round(time.process_time() - c0, 2), "wall_s": round(dt, 2), "time": time.time()}
            if evaluate is not None and run.eval_every and state["step"] % run.eval_every == 0:
                record.update(evaluate(params))
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if time.monotonic() - last_ckpt > 60 * run.ckpt_minutes:
                state["params"], state["opt_state"] = params, opt_state
                save(mngr, state)
                last_ckpt = time.monotonic()
        state["params"], state["opt_state"] = params, opt_state
        save(mngr, state)
    finally:
        bar.close()
        metrics.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return {"state": state, "losses": losses}


def parse_args(argv=None) -> RunConfig:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = RunConfig(out="")
    ap.add_argument("--out", required=True, help="run directory (data, checkpoints, metrics)")
    for field in dataclasses.fields(RunConfig):
        if field.name == "out":
            continue
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            ap.add_argument(f"--{field.name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=default)
        else:
            ap.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default)
    return RunConfig(**vars(ap.parse_args(argv)))


def main(argv=None) -> None:
    run = parse_args(argv)
    if run.phase not in ("target", "drafter", "sts"):
        raise SystemExit(f"--phase must be target, drafter or sts, got {run.phase!r}")
    out = pathlib.Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / ("run.json" if run.phase == "target" else "run-drafter.json")
    if saved.is_file():  # a resumed run must keep the settings that fix its data order and schedule
        before = json.loads(saved.read_text())
        fixed = ("steps", "batch", "seq_len", "lr", "warmup", "seed", "model", "weight_qat", "max_train_tokens",
                 "corpus_root", "anchors")
        diff = {k: (before.get(k, getattr(run, k)), getattr(run, k)) for k in fixed
                if before.get(k, getattr(run, k)) != getattr(run, k)}
        if diff:
            raise SystemExit(f"{saved}: settings differ from the run being resumed (saved, given): {diff}")
    if run.phase != "sts":
        saved.write_text(json.dumps(dataclasses.asdict(run), indent=1))
    if run.phase == "sts":  # the drafter's settings (steps, seed, ...) with its held-out fit
        import train_drafter

        print(json.dumps(train_drafter.sts_phase(run)))
        return
    if run.phase == "drafter":
        import train_drafter

        result = train_drafter.train_drafter(run)
    else:
        result = train(run)
    last = result["losses"][-1] if result["losses"] else None
    print(json.dumps({"phase": run.phase, "step": result["state"]["step"], "last_loss": last}))


if __name__ == "__main__":
    main()
