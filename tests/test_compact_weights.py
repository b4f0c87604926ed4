"""Compact weights (`model/compact_weights.py`): a pack of a model trained on a vocabulary subset
rebuilds its official checkpoint bit for bit, and an altered pack is refused."""

import os

import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.checkpoint import write_checkpoint
from deepinfer.model.compact_weights import PackError, pack_arrays, save_pack, write_checkpoint_from_pack


def _trained_like(config, used):
    """What `scripts/train_tiny.py` exports: every layer changed, U's rows of the embeddings and
    heads changed, the other embedding rows at the seed-0 init and the other head rows zero."""
    base, other = init_params(config, 0), init_params(config, 1)
    params = dict(other)
    params["embed"] = base["embed"].at[used].set(other["embed"][used])
    params["head"] = np.zeros_like(base["head"])
    params["head"][used] = np.asarray(other["head"])[used]
    markov = params["mtp"][-1]["markov_head"]
    base_markov = base["mtp"][-1]["markov_head"]
    markov["embed"] = base_markov["embed"].at[used].set(markov["embed"][used])
    head = np.zeros_like(base_markov["head"])
    head[used] = np.asarray(markov["head"])[used]
    markov["head"] = head
    return params


def test_a_pack_rebuilds_the_checkpoint_bit_for_bit(tmp_path):
    config = load_config("tiny-v4.1")
    used = np.sort(np.random.default_rng(0).choice(config.vocab_size, 3000, replace=False))
    params = _trained_like(config, used)
    write_checkpoint(params, config, tmp_path / "direct")
    sha = save_pack(pack_arrays(params, config, used), tmp_path / "pack.npz")
    write_checkpoint_from_pack(tmp_path / "pack.npz", config, 0, tmp_path / "rebuilt", sha)
    names = sorted(os.listdir(tmp_path / "direct"))
    assert names == sorted(os.listdir(tmp_path / "rebuilt")) and any(n.endswith(".safetensors") for n in names)
    for name in names:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "rebuilt" / name).read_bytes(), name
    # 3,000 of 129,280 rows: the pack is a fraction of the checkpoint
    total = sum((tmp_path / "direct" / n).stat().st_size for n in names)
    assert (tmp_path / "pack.npz").stat().st_size < 0.6 * total

    altered = bytearray((tmp_path / "pack.npz").read_bytes())
    altered[len(altered) // 2] ^= 1
    (tmp_path / "bad.npz").write_bytes(bytes(altered))
    with pytest.raises(PackError, match="sha256"):
        write_checkpoint_from_pack(tmp_path / "bad.npz", config, 0, tmp_path / "never", sha)
    with pytest.raises(PackError, match="cannot read"):
        write_checkpoint_from_pack(tmp_path / "missing.npz", config, 0, tmp_path / "never", sha)
