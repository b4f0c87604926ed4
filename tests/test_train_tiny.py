"""The training script (`scripts/train_tiny.py`, outside the installed package): the exact
reduced-vocabulary loss, a few steps on a small slice lower the loss, and a run stopped and
resumed from its orbax checkpoint continues exactly as an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the scripts are not part of the package; import them by path

import baselines  # noqa: E402
import train_data  # noqa: E402
import train_drafter  # noqa: E402
import train_tiny  # noqa: E402


def test_u_loss_equals_full_vocabulary_softmax_with_zero_rows():
    """Logits over U plus `n_rest * exp(0)` give the full softmax NLL when head rows outside U
    are zero, also for a target outside U."""
    rng = np.random.default_rng(0)
    V, D = 300, 16
    used = np.sort(rng.choice(V, 40, replace=False))
    head = np.zeros((V, D), np.float32)
    head[used] = rng.standard_normal((40, D))
    h = rng.standard_normal((2, 5, D)).astype(np.float32)
    targets = rng.choice(used, (2, 5))
    targets[1, 3] = next(t for t in range(V) if t not in used)
    full = jax.nn.log_softmax(jnp.einsum("btd,vd->btv", h, head), axis=-1)
    expected = -np.take_along_axis(np.asarray(full), targets[..., None], -1)[..., 0]
    to_u = np.full(V, -1)
    to_u[used] = np.arange(40)
    got = train_tiny.u_log_softmax_nll(jnp.einsum("btd,vd->btv", h, head[used]), jnp.asarray(to_u[targets]),
                                       V - 40)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


def test_held_out_split_is_by_module_and_deterministic():
    files = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(20)]
    held = [f for f in files if train_data.is_held_out(f)]
    assert 0.02 < len(held) / len(files) < 0.09
    assert held == [f for f in files if train_data.is_held_out(f)]
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert not any("site-packages" in f or "/test/" in f"/{f}" for f in train_data.source_files(root))


def test_count_baselines_are_normalized_distributions():
    """For every context the bigram (and the unigram) probabilities over the vocabulary sum to 1,
    seen and unseen contexts alike."""
    train = np.array([0, 1, 2, 1, 2, 3, 1, 0, 1, 2])
    for v in range(6):
        probs = [np.exp(-np.array(baselines.bigram_nll(train, np.array([v, w]), vocab=6))) for w in range(6)]
        np.testing.assert_allclose(np.sum(probs, axis=0), [1.0, 1.0], rtol=1e-12)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """A few standard-library modules as a tiny corpus (tokenizing all of it takes a minute)."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py", "colorsys.py"):
        shutil.copy(stdlib / name, root / name)
    return root


def _run(out: pathlib.Path, corpus: pathlib.Path, eval_every: int = 0) -> train_tiny.RunConfig:
    return train_tiny.RunConfig(out=str(out), steps=6, batch=2, seq_len=160, lr=3e-3, warmup=1, model="test",
                                eval_every=eval_every, eval_windows=2, max_train_tokens=2000,
                                corpus_root=str(corpus))


@pytest.fixture(scope="module")
def whole(tmp_path_factory, corpus) -> dict:
    """Six uninterrupted steps of the 5-layer test model, with a held-out loss every 3 steps."""
    out = tmp_path_factory.mktemp("whole")
    return {**train_tiny.train(_run(out, corpus, eval_every=3), progress=False), "out": out}


@pytest.mark.slow
def test_loss_falls_and_resume_continues_exactly(tmp_path, corpus, whole):
    losses = whole["losses"]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.5, losses
    records = [json.loads(line) for line in (whole["out"] / "metrics.jsonl").read_text().splitlines()]
    held = [r["heldout_loss"] for r in records if "heldout_loss" in r]  # heapq.py is held out
    assert len(held) == 2 and all(np.isfinite(held)) and held[1] < held[0], held

    split = tmp_path / "split"
    first = train_tiny.train(_run(split, corpus), stop_after=3, progress=False)
    assert first["state"]["step"] == 3
    second = train_tiny.train(_run(split, corpus), progress=False)  # restores step 3 from disk
    assert second["state"]["step"] == 6
    np.testing.assert_allclose(first["losses"] + second["losses"], losses, rtol=1e-6)
    a, b = whole["state"]["params"], second["state"]["params"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_dspark_terms_match_explicit_full_vocabulary_distributions():
    """TV, CE and the acceptance target over U plus the zero-logit tail equal the same terms
    computed on explicit full-vocabulary distributions."""
    rng = np.random.default_rng(2)
    V, U = 50, 12
    d, t = rng.standard_normal((2, 3, U)), rng.standard_normal((2, 3, U))
    truth = rng.integers(0, U, (2, 3))
    conf = rng.uniform(0.1, 0.9, (2, 3))
    got = train_drafter.dspark_terms(jnp.asarray(d), jnp.asarray(t), jnp.asarray(truth), jnp.asarray(conf), V - U)
    pad = np.zeros((2, 3, V - U))
    pd = np.asarray(jax.nn.softmax(np.concatenate([d, pad], -1)))
    pt = np.asarray(jax.nn.softmax(np.concatenate([t, pad], -1)))
    tv = 0.5 * np.abs(pd - pt).sum(-1)
    np.testing.assert_allclose(np.asarray(got["tv"]), tv, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got["ce"]), -np.log(np.take_along_axis(pd, truth[..., None], -1)[..., 0]),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got["accept"]), 1 - tv, rtol=1e-5)


@pytest.fixture(scope="module")
def drafted(whole) -> dict:
    """Five drafter-phase steps on the frozen target of `whole`, written beside it (the run that
    `scripts/ship_tiny.py` packs): the result, the run, and the target's params before it."""
    run = dataclasses.replace(_run(whole["out"], pathlib.Path(whole["setup"]["meta"]["key"]["root"])),
                              phase="drafter", steps=5, anchors=4, warmup=1)
    before = jax.tree.map(np.asarray, whole["state"]["params"])
    result = train_drafter.train_drafter(run, progress=False,
                                         target_setup=(whole["setup"], whole["state"]["params"]))
    return {"result": result, "run": run, "before": before}


@pytest.mark.slow
def test_drafter_phase_loss_falls_on_the_frozen_target(whole, drafted):
    run, before, result = drafted["run"], drafted["before"], drafted["result"]
    losses = result["losses"]
    assert len(losses) == 5 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0], losses
    after = {k: result["target"][k] for k in before}  # the target stays frozen
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, np.asarray(b))

    fitted = train_drafter.sts_phase(dataclasses.replace(run, eval_windows=2),
                                     target_setup=(whole["setup"], whole["state"]["params"]))
    N = whole["setup"]["config"].dspark_block_size
    assert len(fitted["temperatures"]) == N and fitted["blocks"] == 2 * run.anchors
    assert np.isfinite(fitted["ece_before"]).all() and fitted["ece_after"][0] <= fitted["ece_before"][0]
    assert json.loads((whole["out"] / "sts.json").read_text()) == fitted


def test_ship_packs_the_run_and_the_pack_rebuilds_its_checkpoint(whole, drafted, tmp_path):
    """`scripts/ship_tiny.py`: the pack of the finished run (target, and the drafter of `drafted`)
    rebuilds the checkpoint `write_checkpoint` makes of the exported params, bit for bit."""
    import ship_tiny

    from deepinfer.model.checkpoint import write_checkpoint
    from deepinfer.model.compact_weights import write_checkpoint_from_pack
    from deepinfer.model.config import config_from_dict

    corpus = pathlib.Path(whole["setup"]["meta"]["key"]["root"])
    run = _run(whole["out"], corpus, eval_every=3)
    drun = drafted["run"]
    (whole["out"] / "run.json").write_text(json.dumps(dataclasses.asdict(run)))  # (what main() writes)
    (whole["out"] / "run-drafter.json").write_text(json.dumps(dataclasses.asdict(drun)))
    info = ship_tiny.main(["--out", str(whole["out"]), "--dest", str(tmp_path / "weights"), "--name", "t"])
    assert info["drafter"].startswith("trained") and info["bytes"] == (tmp_path / "weights" / "t.npz").stat().st_size
    s = whole["setup"]
    config = config_from_dict(info["config"], name=s["config"].name)
    assert config == s["config"]
    write_checkpoint_from_pack(tmp_path / "weights" / "t.npz", config, 0, tmp_path / "rebuilt", info["sha256"])
    state, _ = train_drafter.drafter_state(drun, config, s["used"])
    params = train_tiny.export_params(whole["state"]["params"], config, s["used"], 0)
    params["mtp"] = train_drafter.export_drafter(state["params"], config, s["used"], 0)
    write_checkpoint(params, config, tmp_path / "direct")
    for path in sorted((tmp_path / "direct").iterdir()):
        assert path.read_bytes() == (tmp_path / "rebuilt" / path.name).read_bytes(), path.name


@pytest.mark.slow
def test_exported_model_scores_what_training_scored_and_the_checkpoint_stores_its_rounding(whole, tmp_path):
    """The full-vocabulary export (U rows trained, other head rows zero) gives the training
    loss through the ordinary forward, and the official checkpoint stores exactly the FP8/FP4
    values the weight QAT trained with."""
    from deepinfer.model.checkpoint import load_checkpoint, write_checkpoint
    from deepinfer.model.forward import forward
    from deepinfer.model.params import FP4, FP8, FP8_ROWS, param_specs, tree_get

    s, params = whole["setup"], whole["state"]["params"]
    config, used = s["config"], s["used"]
    batch = s["batches"].get(0)
    u_nll = float(train_tiny.u_loss(params, config, batch["inputs"], batch["hash_ids"], batch["targets"]))
    exported = train_tiny.export_params(params, config, used, 0)
    seen = train_tiny.weight_qat(exported, config)
    ids = np.asarray(used)[batch["inputs"]]
    logits = forward(seen, config, ids, hash_ids=batch["hash_ids"])
    truth = np.asarray(used)[batch["targets"]]
    full_nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), truth[..., None], -1).mean()
    np.testing.assert_allclose(full_nll, u_nll, rtol=1e-4)  # fp32 sums over 129k vs 23k logits

    write_checkpoint(exported, config, tmp_path / "ckpt")
    _, loaded = load_checkpoint(tmp_path / "ckpt", dequantize=True, dtype="float32")
    quantized = [sp for sp in param_specs(config, include_mtp=False) if sp.storage in (FP8, FP8_ROWS, FP4)]
    assert quantized
    for spec in quantized:
        np.testing.assert_array_equal(np.asarray(tree_get(loaded, spec.path)), np.asarray(tree_get(seen, spec.path)),
                                      err_msg=spec.name)


def test_sts_fixes_an_overconfident_head_and_keeps_a_calibrated_one():
    """Confidences that are sharpened versions of the true acceptance rates (logits x 3) get
    temperatures near 3 and a much lower ECE; calibrated ones keep T near 1."""
    rng = np.random.default_rng(3)
    rates = rng.uniform(0.05, 0.95, (4000, 5))
    logit = np.log(rates / (1 - rates))
    over = train_drafter.fit_sts(3 * logit, rates)
    assert all(2.5 < t < 3.5 for t in over["temperatures"]), over
    assert all(a < 0.2 * b for a, b in zip(over["ece_after"], over["ece_before"])), over
    calibrated = train_drafter.fit_sts(logit, rates)
    assert all(0.85 < t < 1.15 for t in calibrated["temperatures"]), calibrated
