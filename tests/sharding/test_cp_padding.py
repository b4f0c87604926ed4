"""Context-parallel prefill of chunks whose length is no multiple of 2*cp: the engine step pads
each row (position -1 tokens, which attend to nothing, are seen by nothing and write nothing)
and still splits the queries over cp. cp=3 (6 experts, so they split over 3 devices) and cp=2
with odd chunk lengths: chunked prefill, then one-token decodes, give the one-device full
forward's logits at every position, and each rank really holds its share of the queries."""

import jax
import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.kv_cache import FLOAT, CacheLayout
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner
from deepinfer.sharding import make_mesh
from tests.argmax_check import assert_argmax_agrees


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32", n_routed_experts=6,
                         dspark_n_routed_experts=6)
    return config, init_params(config, seed=3)


def prompt_ids(n, seed=5):
    ids = np.random.default_rng(seed).integers(3, 128000, n)
    ids[0] = 0
    return ids


PROMPT = 153  # > the window (128); one length for both cases, so the full forward compiles once


@pytest.mark.parametrize("cp, chunks", [
    # a bucketed chunk (128 tokens: 132 padded, 44 per rank), then a ragged tail that reads the cache
    (3, [(128, 128), (25, 128)]),
    # an odd row length (151 -> 152, 76 per rank), then two decodes that read the cache
    (2, [(151, 151)]),
])
def test_padded_cp_prefill_then_decode_equal_the_full_forward(model, cp, chunks):
    config, params = model
    ids = prompt_ids(PROMPT)
    layout = CacheLayout(num_slots=2, page_size=64, num_pages=16, max_pages_per_slot=8, storage=FLOAT)
    runner = ModelRunner(params, config, layout, mesh=make_mesh(f"cp={cp}", devices=jax.devices()[:cp]))
    table = np.full((2, 8), -1, np.int32)
    table[1, :4] = [3, 9, 1, 12]
    out, start = [], 0
    for n, tokens in chunks:
        work = [ChunkWork(1, ids[start:start + n], start, ids[:start])]
        out.append(runner.run(work, table, rows=1, tokens=tokens, all_logits=True)[0, :n])
        start += n
    while start < len(ids):
        out.append(runner.run([ChunkWork(1, ids[start:start + 1], start, ids[:start])], table, rows=2, tokens=1))
        start += 1
    # the queries really split: every rank holds ceil(T / 2cp) * 2 of a T-token row
    assert runner.mesh_step.queries_per_rank == {t: -(-t // (2 * cp)) * 2 for _, t in chunks}
    ours, full = np.concatenate(out), np.asarray(forward(params, config, ids))
    rel = np.abs(ours - full).max() / np.abs(full).max()
    print(f"\ncp={cp} chunks {chunks}: padded CP prefill + decode vs full forward: max rel diff {rel:.2e}")
    assert rel <= 1e-5
    assert_argmax_agrees(ours, full, 1e-5 * np.abs(full).max())


def test_drafter_experts_that_do_not_split_are_named(model):
    """A drafter of 8 experts (the preset's own count) over cp=3 is a clear error naming the
    drafter's weights (the layers' 6 experts would split)."""
    config, _ = model
    import dataclasses

    config = dataclasses.replace(config, dspark_n_routed_experts=8)
    layout = CacheLayout(num_slots=2, page_size=64, num_pages=16, max_pages_per_slot=8, storage=FLOAT)
    with pytest.raises(ValueError, match=r"8 routed experts \(\['mtp'\]\[0\]\['ffn'\]\['experts'\].*3 devices"):
        ModelRunner(init_params(config, seed=3), config, layout, mesh=make_mesh("cp=3", devices=jax.devices()[:3]))
