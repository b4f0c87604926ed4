"""The training script (`scripts/train_tiny.py`, outside the installed package): the exact
reduced-vocabulary loss, a few steps on a small slice lower the loss, and a run stopped and
resumed from its orbax checkpoint continues exactly as an uninterrupted one."""

from __future__ import annotations

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

import train_data  # noqa: E402
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


@pytest.mark.slow
def test_loss_falls_and_resume_continues_exactly(tmp_path, corpus):
    whole = train_tiny.train(_run(tmp_path / "whole", corpus, eval_every=3), progress=False)
    losses = whole["losses"]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.5, losses
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
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
