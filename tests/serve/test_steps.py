"""Engine steps against the full-sequence forward: chunked prefill followed by one-token decode
steps must give the forward's logits at every position (model-v4.1-flash.md §7.1), and drafting
from the DSpark drafter's rings they fill must equal the drafter run on the whole sequence."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.drafter import _draft_after_jit, draft_after, draft_from_cache
from deepinfer.model.forward import engram_hash_ids
from deepinfer.model.kv_cache import FLOAT, PACKED, CacheLayout, init_cache, slot_bytes
from deepinfer.model.step import forward_step
from deepinfer.serve.engine import runner as runner_module
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, token_bucket
from tests import qat_sites
from tests.argmax_check import assert_argmax_agrees
from tests.choice_margins import near_tie_finder

PROMPT_LEN = 301  # odd, not a multiple of 128, longer than the window (128) and the candidate pool (64)
PAGE = 64
NEAR_TIE = 1e-5  # a choice decided by less than this (relative) may go either way; the noise is ~2.5e-6
TOLERANCE = 2e-5  # of the logit scale, before the first near-tie (measured: 2.5e-6)


def _ids(n=PROMPT_LEN, seed=11):
    ids = np.random.default_rng(seed).integers(3, 128000, n)
    ids[0] = 0
    return ids


@pytest.fixture(scope="module")
def model():
    config = load_config("tiny-v4.1-short", fake_quant=False, dtype="float32")
    return config, init_params(config, seed=3)


@pytest.fixture(scope="module")
def near_tie(model):
    """`near_tie(ids)`: the first position at which the forward makes a choice (indexer top-k,
    candidate blocks, routers) by less than NEAR_TIE, from the float64 reference
    (tests/choice_margins.py): a step may choose otherwise there, by rounding alone, and move
    every later logit; positions before it are compared at TOLERANCE."""
    return near_tie_finder(*model, NEAR_TIE)


def _assert_equal_before_near_tie(ours, full, upto: int) -> None:
    assert ours.shape == full.shape
    scale = np.abs(full).max()
    rel = np.abs(ours[:upto] - full[:upto]).max() / scale
    assert rel <= TOLERANCE, f"rel {rel:.2e} over positions < {upto}"
    assert_argmax_agrees(ours[:upto], full[:upto], TOLERANCE * scale)


def run_chunked(config, params, ids, chunks, storage=FLOAT, slot=1, floor=0, decoder_flags=None, *,
                draft_rings=0, runner=None, pages=(5, 17, 2, 11, 20, 8)):
    """Prefill `chunks` (token counts) with all-position logits, then decode the rest one token at
    a time; returns logits for every position [len(ids), vocab] and the runner (a new one unless
    given; `draft_rings`: keep the DSpark drafter's context)."""
    if runner is None:
        layout = CacheLayout(num_slots=3, page_size=PAGE, num_pages=24, max_pages_per_slot=8, storage=storage,
                             draft_rings=draft_rings)
        runner = ModelRunner(params, config, layout)
    table = np.full((3, 8), -1, np.int32)
    table[slot, :len(pages)] = pages  # scattered physical pages
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
def test_chunked_prefill_and_decode_equal_the_full_forward(model, near_tie, chunks):
    config, params = model
    ids = _ids()
    full = np.asarray(forward(params, config, ids))
    ours, _ = run_chunked(config, params, ids, chunks)
    _assert_equal_before_near_tie(ours, full, near_tie(ids))


@pytest.fixture
def replaying(monkeypatch):
    """`replaying(sites)`: the runner's steps and drafts adopt the quantization decisions recorded
    in `sites` (tests/qat_sites.py); returns the `Replayer`, whose `found` sums up the sites."""

    def install(sites):
        replayer = qat_sites.Replayer(sites)

        def step(params, config, layout, cache, batch, all_logits=False, decoder=True, kernels=None):
            return replayer(("step", config, layout, all_logits, decoder, kernels),
                            lambda p, c, b: forward_step(p, config, layout, c, b, all_logits, decoder, kernels),
                            params, cache, batch)

        def draft(params, config, layout, cache, slots, anchor, anchor_pos, floor=None, kernels=None):
            return replayer(("draft", config, layout, floor is None, kernels),
                            lambda p, c, s, a, ap, f: draft_from_cache(p, config, layout, c, s, a, ap, f, kernels),
                            params, cache, slots, anchor, anchor_pos, floor)

        monkeypatch.setattr(runner_module, "forward_step", step)
        monkeypatch.setattr(runner_module, "draft_from_cache", draft)
        return replayer

    return install


@pytest.mark.parametrize("seed", [4, 5])
def test_packed_cache_with_fake_quant_equals_the_full_forward(model, replaying, seed):
    """QAT on, FP8/FP4 packed cache. The step programs round fp32 differently from the full
    forward, so a value within ulps of an FP8/FP4 rounding boundary can land on the other grid
    point and move later logits a lot; the steps adopt the full forward's quantization decisions
    where their site inputs are within 1e-3 of its own (tests/qat_sites.py; padding rows have no
    twin and keep theirs) and then give the forward's logits as tightly as with fake-quant off."""
    config, params = model
    config = dataclasses.replace(config, fake_quant=True)
    ids = _ids(200, seed=seed)
    full, sites = qat_sites.record_forward(params, config, ids)
    replayer = replaying(sites)
    ours, _ = run_chunked(config, params, ids, [128, 60], storage=PACKED)
    replayer.found.check(unmatched=None)
    rel = np.abs(ours - full).max() / np.abs(full).max()
    assert rel <= 1e-4, rel
    assert_argmax_agrees(ours, full, 1e-4 * np.abs(full).max())


def test_compact_prefill_equals_full_for_prompts_within_keep(model, near_tie):
    """A prompt no longer than `keep` has replay floor 0: compact is the full path."""
    config, params = model
    ids = _ids(139, seed=5)
    full = np.asarray(forward(params, config, ids))
    ours, _ = run_chunked(config, params, ids, [128, 1], floor=0)
    _assert_equal_before_near_tie(ours, full, near_tie(ids))


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


# ---- the DSpark drafter's rings --------------------------------------------------------------


def _drafts_close(ours, ref, tol):
    rel = np.abs(ours["logits"] - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert rel <= tol, rel
    np.testing.assert_array_equal(ours["tokens"], ref["tokens"])
    np.testing.assert_allclose(ours["confidence"], ref["confidence"], atol=tol)


def _whole_sequence_drafts(config, params, ids, anchor):
    return {k: np.asarray(v) for k, v in draft_after(params, config, ids[None], anchor).items()}


@pytest.mark.parametrize("chunks", [[128, 60], [188]])
def test_drafts_from_the_cache_equal_the_whole_sequence_drafter(model, chunks):
    """Prompt 188 + 13 decode steps (longer than the 128-token window): the rings hold the last
    128 context rows of every draft block, written by prefill chunks and by decode steps."""
    config, params = model
    ids = _ids(201, seed=21)
    _, runner = run_chunked(config, params, ids, chunks, draft_rings=config.num_nextn_predict_layers)
    anchor = np.array([4242])
    ours = runner.draft([1], anchor, [len(ids)])
    assert ours["tokens"].shape == (1, config.dspark_block_size)
    _drafts_close(ours, _whole_sequence_drafts(config, params, ids, anchor), 1e-4)


def test_drafts_for_several_sequences_and_a_short_prompt(model):
    """Two sequences in different slots, one shorter than the window (rings partly empty)."""
    config, params = model
    long_ids, short_ids = _ids(150, seed=22), _ids(37, seed=23)
    _, runner = run_chunked(config, params, long_ids, [128, 20], slot=0, pages=[1, 3, 4],
                            draft_rings=config.num_nextn_predict_layers)
    run_chunked(config, params, short_ids, [37], slot=2, pages=[6], runner=runner)
    anchors = np.array([17, 99])
    ours = runner.draft([0, 2], anchors, [150, 37])
    for row, ids in enumerate((long_ids, short_ids)):
        _drafts_close({k: v[row:row + 1] for k, v in ours.items()},
                      _whole_sequence_drafts(config, params, ids, anchors[row:row + 1]), 1e-4)


def test_compact_prefill_fills_the_draft_rings_from_the_kept_tail(model):
    """Compact prefill (keep 140 >= window): a chunk below the replay floor writes no draft rows
    and the kept tail writes the whole window. Compact changes the decoder layers' values near the
    floor by design, so compare with compact in one chunk (every row's decoder pass in the same
    program), not with the full-fidelity drafter."""
    config, params = model
    ids = _ids(300, seed=24)
    floor = len(ids) - 140
    anchor = np.array([7])
    drafts = []
    for chunks, flags in (([128, 128, 44], [False, True, True]), ([300], [True])):
        _, runner = run_chunked(config, params, ids, chunks, floor=floor, decoder_flags=flags,
                                draft_rings=config.num_nextn_predict_layers)
        drafts.append(runner.draft([1], anchor, [len(ids)], floors=[floor]))
    _drafts_close(drafts[0], drafts[1], 1e-4)


@pytest.mark.parametrize("seed", [25, 26])
def test_packed_draft_rings_with_fake_quant(model, replaying, seed):
    """QAT on: the rings are FP8 + UE8M0 like the layers' (lossless on the fake-quant grid); the
    steps and the drafts adopt the whole-sequence drafter's quantization decisions (see above)."""
    config, params = model
    config = dataclasses.replace(config, fake_quant=True)
    ids, anchor = _ids(150, seed=seed), np.array([11])
    hash_ids = engram_hash_ids(config, ids[None])
    ref, sites = qat_sites.record(lambda p, i, h, a: _draft_after_jit(p, config, i, h, a), params,
                                  jnp.asarray(ids[None], jnp.int32), jnp.asarray(hash_ids, jnp.int32),
                                  jnp.asarray(anchor, jnp.int32), key=("draft_after", config))
    replayer = replaying(sites)
    _, runner = run_chunked(config, params, ids, [128, 12], storage=PACKED, draft_rings=config.num_nextn_predict_layers)
    ours = runner.draft([1], anchor, [len(ids)])
    replayer.found.check(unmatched=None)
    _drafts_close(ours, {k: np.asarray(v) for k, v in ref.items()}, 1e-4)


def test_layout_counts_the_draft_rings(model):
    config, _ = model
    plain = CacheLayout(num_slots=2, page_size=PAGE, num_pages=4, max_pages_per_slot=2, storage=PACKED)
    drafted = dataclasses.replace(plain, draft_rings=3)
    real = load_config("deepseek-v4.1-flash")
    per_ring = real.sliding_window * (real.head_dim + real.head_dim // 32)  # FP8 values + UE8M0 scales
    assert slot_bytes(real, drafted) - slot_bytes(real, plain) == 3 * per_ring
    cache = init_cache(config, dataclasses.replace(drafted, storage=FLOAT))
    assert cache.window[0].shape[0] == config.num_hidden_layers + 3
    with pytest.raises(ValueError, match="draft_rings"):
        init_cache(config, dataclasses.replace(plain, draft_rings=2, storage=FLOAT))


def test_draft_rings_need_the_drafter_params(model):
    config, params = model
    layout = CacheLayout(num_slots=2, page_size=PAGE, num_pages=4, max_pages_per_slot=2, storage=FLOAT, draft_rings=3)
    with pytest.raises(ValueError, match=r"no DSpark drafter \(`mtp\.\*`"):
        ModelRunner({k: v for k, v in params.items() if k != "mtp"}, config, layout)
