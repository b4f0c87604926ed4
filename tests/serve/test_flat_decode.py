"""Decode cost nearly flat in context (issue 13, item 2): a decode step at a long context, its
pages scattered over the pool, reads only the selected entries and candidate keys and still
equals the step that reads every page; and the host work a decode row costs does not grow
with its context."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.kv_cache import PACKED, CacheLayout, init_cache
from deepinfer.model.step import StepBatch, forward_step
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine
from deepinfer.serve.engine.request import Request
from deepinfer.serve.engine.sampler import SampleOutput

CONTEXT = (2900, 2211)  # two rows, several thousand tokens, different lengths
PAGE = 128


def _random_pool(rng, array: jax.Array) -> jax.Array:
    """Valid random packed rows: any FP4/FP8 codes, finite power-of-two scales."""
    if array.dtype == jnp.float8_e8m0fnu:
        return jnp.asarray(rng.integers(118, 130, array.shape, dtype=np.uint8)).view(jnp.float8_e8m0fnu)
    if array.dtype == jnp.float8_e4m3fn:
        return jnp.asarray(2.0 ** rng.integers(-6, 3, array.shape), jnp.float8_e4m3fn)
    return jnp.asarray(rng.integers(0, 256, array.shape, dtype=np.uint8)).view(array.dtype)


def test_long_context_decode_reads_selected_rows_and_equals_reading_every_page():
    config = load_config("tiny-v4.1-short")  # fake-quant on: FP8/FP4 packed rows, as served
    params = init_params(config, seed=5)
    pages = -(-max(CONTEXT) // PAGE) + 1
    layout = CacheLayout(num_slots=2, page_size=PAGE, num_pages=2 * pages + 6, max_pages_per_slot=pages,
                         storage=PACKED)
    rng = np.random.default_rng(7)
    cache = init_cache(config, layout)
    W = config.sliding_window
    window_pos = np.full((2, W), -1, np.int32)
    for b, n in enumerate(CONTEXT):  # the ring holds positions n-W .. n-1 at p % W
        p = np.arange(n - W, n)
        window_pos[b, p % W] = p
    cache = dataclasses.replace(
        cache, window=tuple(_random_pool(rng, a) for a in cache.window), window_pos=jnp.asarray(window_pos),
        entries=tuple(tuple(_random_pool(rng, a) for a in src) for src in cache.entries),
        index_keys=tuple(tuple(_random_pool(rng, a) for a in src) for src in cache.index_keys),
        pending=tuple(jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for p in cache.pending))
    order = rng.permutation(layout.num_pages)  # each sequence's pages scattered over the pool
    table = np.full((2, pages), -1, np.int32)
    for b, n in enumerate(CONTEXT):
        used = -(-(n + 1) // PAGE)
        table[b, :used] = order[b * pages:b * pages + used]
    assert (np.abs(np.diff(table[0, :10])) != 1).any()
    hash_ids = np.stack([np.zeros((1, len(config.engram_layer_ids), config.n_hash_columns), np.int32)] * 2)
    batch = StepBatch(jnp.asarray([[17], [923]], jnp.int32), jnp.asarray([[n] for n in CONTEXT], jnp.int32),
                      jnp.asarray([0, 1], jnp.int32), jnp.asarray(table), jnp.asarray(hash_ids),
                      jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))

    def step(read_all):
        copy = jax.tree.map(jnp.copy, cache)  # the step donates its cache
        return forward_step(params, config, layout, copy, batch, read_all=read_all)

    sparse_cache, sparse, _ = step(False)
    full_cache, full, _ = step(True)
    assert np.isfinite(np.asarray(full)).all()
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(full), rtol=1e-5, atol=1e-5 * np.abs(full).max())
    for got, want in zip(jax.tree.leaves(sparse_cache), jax.tree.leaves(full_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    # the step with other cache contents gives other logits: the comparison can fail
    other = dataclasses.replace(cache, entries=tuple(tuple(_random_pool(rng, a) for a in src) for src in cache.entries))
    _, moved, _ = forward_step(params, config, layout, other, batch)
    assert np.abs(np.asarray(moved) - np.asarray(full)).max() > 1e-3 * np.abs(full).max()


def test_request_ids_slice_prompt_and_output():
    request = Request("r", None, [5, 6, 7], SamplingParams(), None, None, 0, output_ids=[8, 9])
    assert request.ids(0, 5).tolist() == request.all_ids
    assert request.ids(2, 4).tolist() == [7, 8]
    assert request.ids(-3, 1).tolist() == [5]
    assert request.ids(4, 9).tolist() == [9]
    assert request.ids(3, 3).tolist() == []


@pytest.mark.parametrize("lengths", [(9, 700)])
def test_decode_rows_carry_constant_host_work_whatever_the_context(lengths, monkeypatch):
    """Every ChunkWork the engine builds carries its chunk and the Engram look-back (N-1 tokens),
    never the sequence's history: a decode row at 700 tokens costs the host what one at 9 does."""
    from deepinfer.model.tokenizer import load_tokenizer

    config = load_config("tiny-v4.1-short")
    params = init_params(config, seed=1)
    budget = CacheBudget(num_slots=2, max_model_len=768, page_size=64)
    engine = LLMEngine(params, config, load_tokenizer(), EngineConfig(budget=budget, prefill_chunk=256,
                                                                      prefill_mode="full"))
    seen = []

    class Fetched:  # a deferred step's results (`runner.PendingSamples`), here at once
        def __init__(self, out):
            self.out = out

        def fetch(self):
            return self.out

    def fake_run(work, page_table, *, rows, tokens, all_logits=False, decoder=True, sample=None, defer=False):
        seen.extend((w, tokens) for w in work)
        if sample is None:  # the model is not the point here
            return None if not decoder else np.zeros((len(work), config.vocab_size), np.float32)
        out = SampleOutput(tokens=np.full(len(work), 5, np.int32))
        return Fetched(out) if defer else out

    monkeypatch.setattr(engine.runner, "run", fake_run)
    rng = np.random.default_rng(3)
    prompts = {f"r{n}": rng.integers(3, 1000, n).tolist() for n in lengths}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    lookback = config.engram_max_ngram_size - 1
    decodes = [w for w, tokens in seen if tokens == 1]
    assert {w.start for w in decodes} >= {n for n in lengths}  # both sequences decoded
    for w, _ in seen:
        assert len(w.history) == min(lookback, w.start)
    for n, ids in zip(lengths, prompts.values()):
        first = [w for w in decodes if w.start == n]  # feeds the first sampled token
        assert len(first) == 1
        np.testing.assert_array_equal(first[0].history, ids[-lookback:])
