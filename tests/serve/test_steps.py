"""Engine steps against the full-sequence forward: chunked prefill followed by one-token decode
steps must give the forward's logits at every position (model-v4.1-flash.md §7.1)."""

import dataclasses

import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.kv_cache import FLOAT, PACKED, CacheLayout
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, token_bucket

PROMPT_LEN = 301  # odd, not a multiple of 128, longer than the window (128) and the candidate pool (64)
PAGE = 64


def _ids(n=PROMPT_LEN, seed=11):
    ids = np.random.default_rng(seed).integers(3, 128000, n)
    ids[0] = 0
    return ids


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=3)


def run_chunked(config, params, ids, chunks, storage=FLOAT, slot=1, floor=0, decoder_flags=None):
    """Prefill `chunks` (token counts) with all-position logits, then decode the rest one token at
    a time; returns logits for every position [len(ids), vocab] and the runner."""
    layout = CacheLayout(num_slots=3, page_size=PAGE, num_pages=24, max_pages_per_slot=8, storage=storage)
    runner = ModelRunner(params, config, layout)
    table = np.full((3, 8), -1, np.int32)
    table[slot, :6] = [5, 17, 2, 11, 20, 8]  # scattered physical pages
    out, start = [], 0
    for i, n in enumerate(chunks):
        work = [ChunkWork(slot, ids[start:start + n], start, ids[:start], floor)]
        decoder = True if decoder_flags is None else decoder_flags[i]
        logits = runner.run(work, table, rows=1, tokens=token_bucket(n), all_logits=True, decoder=decoder)
        if decoder:
            out.append(logits[0, :n])
        start += n
    while start < len(ids):
        work = [ChunkWork(slot, ids[start:start + 1], start, ids[:start], floor)]
        out.append(runner.run(work, table, rows=3, tokens=1))
        start += 1
    return np.concatenate(out), runner


@pytest.mark.parametrize("chunks", [[128, 128, 21], [256, 39], [128, 173]])
def test_chunked_prefill_and_decode_equal_the_full_forward(model, chunks):
    config, params = model
    ids = _ids()
    full = np.asarray(forward(params, config, ids))
    ours, _ = run_chunked(config, params, ids, chunks)
    assert ours.shape == full.shape
    rel = np.abs(ours - full).max() / np.abs(full).max()
    assert rel <= 1e-4, rel
    np.testing.assert_array_equal(ours.argmax(-1), full.argmax(-1))


def test_packed_cache_with_fake_quant_tracks_the_full_forward(model):
    """QAT on, FP8/FP4 packed cache. fp32 rounding differs between the step programs and the
    full forward, and a value on an FP8/FP4 rounding midpoint can flip to the neighbouring grid
    point; in this random tiny model a flip moves later logits a lot (the full forward at two
    sequence lengths already differs by ~0.1 on shared rows), so bound the typical error."""
    config, params = model
    config = dataclasses.replace(config, fake_quant=True)
    ids = _ids(200, seed=4)
    full = np.asarray(forward(params, config, ids))
    ours, _ = run_chunked(config, params, ids, [128, 60], storage=PACKED)
    rel = np.abs(ours - full).max(-1) / np.abs(full).max()
    assert np.median(rel) <= 1e-2, np.median(rel)
    assert (ours.argmax(-1) == full.argmax(-1)).mean() >= 0.9


def test_compact_prefill_equals_full_for_prompts_within_keep(model):
    """A prompt no longer than `keep` has replay floor 0: compact is the full path."""
    config, params = model
    ids = _ids(139, seed=5)
    full = np.asarray(forward(params, config, ids))
    ours, _ = run_chunked(config, params, ids, [128, 1], floor=0)
    assert np.abs(ours - full).max() / np.abs(full).max() <= 1e-4


def test_compact_prefill_keeps_the_global_kv_of_every_prompt_token(model):
    """Chunks below the replay floor skip the decoder layers but still write the decoder
    source's compressed KV: the global cache equals the full-fidelity run's."""
    config, params = model
    ids = _ids(300, seed=6)
    keep = 140
    floor = len(ids) - keep  # 160: chunk [0, 128) is below it, [128, 256) and [256, 300) are not
    _, compact = run_chunked(config, params, ids, [128, 128, 44], floor=floor, decoder_flags=[False, True, True])
    _, full = run_chunked(config, params, ids, [128, 128, 44])
    pages = [5, 17, 2, 11, 20]
    for src, (a, b) in enumerate(zip(compact.runner_cache_entries(), full.runner_cache_entries())):
        np.testing.assert_allclose(a[pages], b[pages], rtol=1e-5, atol=1e-5, err_msg=f"source {src}")
