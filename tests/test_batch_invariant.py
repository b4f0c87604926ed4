"""`ops.batch_invariant`: products in fixed tiles give a row the same bits whatever the batch, and
the same values as the plain product; loops keep their form, their bodies transformed (mHC's
Sinkhorn loop gives a token the same bits in any number of rows); the invariant step's window
(`model.invariant_attention`) holds the engine step's window keys, and its logits do not depend on
the chunking or the rows of the step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import init_params, load_config
from deepinfer.model.attention import window_mask
from deepinfer.model.invariant_attention import window_by_offset
from deepinfer.model.kv_cache import PACKED, CacheLayout
from deepinfer.ops.batch_invariant import XLA_CPU_OPTIONS, TileShape, batch_invariant
from deepinfer.pallas_kernels.registry import KernelConfig
from deepinfer.serve.engine.runner import ChunkWork, ModelRunner, token_bucket


def _jit(fn):
    return jax.jit(batch_invariant(fn), compiler_options=XLA_CPU_OPTIONS)


@pytest.mark.parametrize("k,n", [(256, 512), (1024, 384)])
def test_a_row_of_a_product_is_the_same_bits_for_any_number_of_rows(k, n):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((300, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    product = _jit(lambda x, w: jnp.einsum("...i,oi->...o", x, w))
    first = {m: np.asarray(product(x[:m], w))[0] for m in (1, 2, 3, 16, 17, 100, 300)}
    assert all(np.array_equal(v, first[1]) for v in first.values()), [m for m, v in first.items()
                                                                        if not np.array_equal(v, first[1])]
    moved = np.asarray(product(jnp.concatenate([x[1:40], x[:1]]), w))[-1]  # the row last instead of first
    np.testing.assert_array_equal(moved, first[1])
    np.testing.assert_allclose(np.asarray(product(x, w)), np.asarray(x @ w.T), rtol=1e-5, atol=1e-4)


def test_batched_products_are_the_same_bits_for_any_batch():
    """Attention-like products with batch dimensions (per query): the batch is tiled too."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((200, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((200, 128, 64)), jnp.float32)
    scores = _jit(lambda q, k: jnp.einsum("bhd,bsd->bhs", q, k))
    first = {b: np.asarray(scores(q[:b], k[:b]))[0] for b in (1, 3, 16, 17, 200)}
    assert all(np.array_equal(v, first[1]) for v in first.values())
    np.testing.assert_allclose(np.asarray(scores(q, k)), np.einsum("bhd,bsd->bhs", q, k), rtol=1e-5, atol=1e-4)


def test_tile_columns_when_asked():
    """`TileShape(n=...)` also blocks the columns: a product whose column count follows the batch."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((300, 256)), jnp.float32)
    product = jax.jit(batch_invariant(lambda w, x: jnp.einsum("oi,ti->ot", w, x), TileShape(n=32)),
                      compiler_options=XLA_CPU_OPTIONS)
    first = {m: np.asarray(product(w, x[:m]))[:, 0] for m in (1, 7, 33, 300)}
    assert all(np.array_equal(v, first[1]) for v in first.values())
    with pytest.raises(ValueError, match="TileShape"):
        TileShape(m=0)


def test_scans_and_nested_calls_are_evaluated_exactly():
    xs = jnp.arange(12.0).reshape(4, 3)

    def f(c, xs):
        c, ys = jax.lax.scan(lambda c, x: (c * 2 + x, jnp.sin(c) + x), c, xs, reverse=True)
        return jax.jit(lambda a: jax.lax.fori_loop(0, 3, lambda i, a: a * 1.5 + i, a))(c), ys

    for a, b in zip(jax.tree.leaves(f(jnp.ones(3), xs)), jax.tree.leaves(batch_invariant(f)(jnp.ones(3), xs))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the loops stay loops (an unrolled 20-pass Sinkhorn per mHC site made the invariant step
    # program twice as slow to compile)
    primitives = {e.primitive.name for e in jax.make_jaxpr(batch_invariant(f))(jnp.ones(3), xs).jaxpr.eqns}
    assert "scan" in primitives


def test_mhc_sinkhorn_loop_gives_a_token_the_same_bits_in_any_number_of_rows():
    """The site's mixes (norm, projection, sigmoid gates, softmax, 19 Sinkhorn passes in a loop)
    of the first tokens, computed among 1 to 64 tokens, in one or two leading dimensions."""
    from deepinfer.pallas_kernels.reference.mhc import mhc_mixes

    rng = np.random.default_rng(0)
    hc, d = 4, 64
    fn = jnp.asarray(rng.normal(size=(2 * hc + hc * hc, hc * d)).astype(np.float32) * 0.05)
    base = jnp.asarray(rng.normal(size=(2 * hc + hc * hc,)).astype(np.float32))
    scale = jnp.asarray([1.0, 0.7, 1.3], jnp.float32)
    mixes = jax.jit(batch_invariant(lambda s: mhc_mixes(s, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6,
                                                        sinkhorn_iters=20)), compiler_options=XLA_CPU_OPTIONS)
    streams = rng.normal(size=(64, hc, d)).astype(np.float32)
    widest = [np.asarray(m).reshape(64, -1) for m in mixes(jnp.asarray(streams))]
    for shape in [(1,), (1, 1), (2,), (3,), (4, 1), (5,), (8,), (2, 9)]:
        n = int(np.prod(shape))
        for got, want in zip(mixes(jnp.asarray(streams[:n].reshape(*shape, hc, d))), widest):
            np.testing.assert_array_equal(np.asarray(got).reshape(n, -1), want[:n], err_msg=str(shape))


def test_short_float_sums_add_in_index_order_and_long_ones_stay_reductions():
    """Sums of at most 32 elements are the additions x_0 + x_1 + ... in index order (over any
    axes), checked against that order in numpy; longer sums and integer sums are XLA's own."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 3, 4, 6)).astype(np.float32) * 1e3
    got = np.asarray(jax.jit(batch_invariant(lambda a: jnp.sum(a, axis=(1, 3))))(x))
    flat = np.transpose(x, (0, 2, 1, 3)).reshape(5, 4, 18)
    want = flat[..., 0]
    for i in range(1, 18):
        want = (want + flat[..., i]).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    long = rng.standard_normal((4, 100)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(batch_invariant(lambda a: jnp.sum(a, -1)))(long)), long.sum(-1),
                               rtol=1e-5)
    ints = jnp.asarray(rng.integers(0, 9, (3, 4)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(batch_invariant(lambda a: jnp.sum(a, 0))(ints)), np.asarray(ints).sum(0))


def test_window_by_offset_holds_the_keys_the_window_mask_admits():
    W, T = 8, 5
    rng = np.random.default_rng(3)
    ring_pos = np.array([[8, 9, 10, 3, 4, 5, 6, 7], [-1] * 8])  # row 0: positions 3..10; row 1: empty ring
    positions = np.array([[11, 12, 13, 14, 15], [0, 1, 2, -1, -1]])
    key_pos = np.concatenate([ring_pos, positions], axis=1)
    keys = rng.standard_normal((2, W + T, 4)).astype(np.float32)
    picked, picked_pos = window_by_offset(jnp.asarray(keys), jnp.asarray(key_pos), jnp.asarray(positions), W)
    mask = np.asarray(window_mask(jnp.asarray(positions), jnp.asarray(key_pos), W)) & (positions >= 0)[:, :, None]
    for b in range(2):
        for t in range(T):
            want = sorted(key_pos[b, mask[b, t]].tolist(), reverse=True)
            got = [int(p) for p in np.asarray(picked_pos[b, t]) if p >= 0]
            assert got == want, (b, t, got, want)
            for o, p in enumerate(np.asarray(picked_pos[b, t])):
                if p >= 0:
                    np.testing.assert_array_equal(np.asarray(picked[b, t, o]), keys[b, list(key_pos[b]).index(p)])


@pytest.fixture(scope="module")
def tiny():
    config = load_config("tiny-v4.1-short")
    return config, init_params(config, seed=3)


def _logits(config, params, chunks, kernels, rows=None, decode_rows=3, step_tokens=1):
    """All-position logits of a 305-token sequence prefilled in `chunks` (with `rows` rows), the
    rest in steps of `decode_rows` rows of `step_tokens` tokens (1: decode steps; more: steps
    shaped as DSpark's verify steps)."""
    ids = np.random.default_rng(11).integers(3, 128000, 305)
    layout = CacheLayout(num_slots=3, page_size=64, num_pages=24, max_pages_per_slot=8, storage=PACKED)
    runner = ModelRunner(params, config, layout, kernels=kernels)
    table = np.full((3, 8), -1, np.int32)
    table[1, :6] = (5, 17, 2, 11, 20, 8)
    out, start = [], 0
    for n in chunks:
        work = [ChunkWork(1, ids[start:start + n], start, ids[:start], 0)]
        out.append(runner.run(work, table, rows=rows or 1, tokens=token_bucket(n), all_logits=True)[0, :n])
        start += n
    while start < len(ids):
        n = min(step_tokens, len(ids) - start)
        work = [ChunkWork(1, ids[start:start + n], start, ids[:start], 0)]
        if step_tokens == 1:
            out.append(runner.run(work, table, rows=decode_rows, tokens=1))
        else:
            out.append(runner.run(work, table, rows=decode_rows, tokens=step_tokens, all_logits=True)[0, :n])
        start += n
    return np.concatenate(out)


def test_invariant_step_logits_do_not_depend_on_chunking_or_rows(tiny):
    """Fake-quant on (the release's numerics), FP8/FP4 packed cache."""
    config, params = tiny
    kernels = KernelConfig(batch_invariant=True)
    reference = _logits(config, params, [128, 128, 45], kernels)
    np.testing.assert_array_equal(_logits(config, params, [256, 45], kernels, rows=2), reference)


def test_decode_and_verify_steps_give_the_prefill_chunk_bits(tiny):
    """A token's logits are the same bits whether a prefill chunk, a decode step (1, 2 or 8
    rows) or a verify-shaped step (4 rows of 6 tokens, the last one partly filled) computes it:
    what DSpark in deterministic mode rests on. Before `ops.invariant_math`, the short sums in
    order and the tokens-first products, positions 296-304 differed by up to 7e-6; a step of one
    row and one token by up to 4.5e-6 until it got a padding row (`model.step`)."""
    config, params = tiny
    kernels = KernelConfig(batch_invariant=True)
    prefill = _logits(config, params, [128, 128, 49], kernels)
    for rows, tokens in ((1, 1), (2, 1), (8, 1), (4, 6)):
        got = _logits(config, params, [128, 128, 40], kernels, decode_rows=rows, step_tokens=tokens)
        np.testing.assert_array_equal(got, prefill, err_msg=f"{rows} rows x {tokens} tokens")


def test_a_single_token_step_writes_only_its_own_slot(tiny):
    """The padding row of a one-row, one-token invariant step points past the rank's slots: every
    write of it is dropped, so the other slots' rings, positions and compressor state and the
    other sequences' pages stay as they were (the last slot, where a clamped write would land,
    included)."""
    config, params = tiny
    layout = CacheLayout(num_slots=3, page_size=64, num_pages=24, max_pages_per_slot=8, storage=PACKED)
    runner = ModelRunner(params, config, layout, kernels=KernelConfig(batch_invariant=True))
    table = np.full((3, 8), -1, np.int32)
    table[:, :3] = ((0, 1, 3), (5, 17, 2), (7, 9, 11))
    ids = np.random.default_rng(12).integers(3, 128000, 130)
    for slot in range(3):  # 129 tokens each: the ratio-2 compressors hold one back
        for start, n in ((0, 128), (128, 1)):
            runner.run([ChunkWork(slot, ids[start:start + n], start, ids[:start], 0)], table, rows=1,
                       tokens=token_bucket(n), all_logits=True)
    before = jax.tree.map(np.asarray, runner.cache)
    runner.run([ChunkWork(1, ids[129:130], 129, ids[:129], 0)], table, rows=1, tokens=1)
    after = jax.tree.map(np.asarray, runner.cache)
    for old, new in zip(before.window, after.window):  # [rings, slots, ...]
        np.testing.assert_array_equal(np.delete(new, 1, axis=1), np.delete(old, 1, axis=1))
        assert (new[:, 1] != old[:, 1]).any()
    for old, new in ((before.window_pos, after.window_pos), *zip(before.pending, after.pending)):  # [slots, ...]
        np.testing.assert_array_equal(np.delete(new, 1, axis=0), np.delete(old, 1, axis=0))
    others = [p for p in range(layout.num_pages) if p not in table[1]]
    for old, new in zip(jax.tree.leaves((before.entries, before.index_keys)),
                        jax.tree.leaves((after.entries, after.index_keys))):  # [pages, ...]
        np.testing.assert_array_equal(new[others], old[others])


def test_no_product_of_the_invariant_step_has_columns_that_follow_the_batch(tiny, monkeypatch):
    """The tiles cut a product's rows (lhs), never its columns: a product whose rhs holds the
    tokens (`einsum` may order a weight first) would be a matrix-vector product for one token
    and a matrix product for more. Traced only: each product's column count at four step shapes."""
    import math

    import deepinfer.ops.batch_invariant as bi
    from deepinfer.model.step import step_body

    config, params = tiny
    kernels = KernelConfig(batch_invariant=True)
    columns, plain = [], bi.invariant_dot_general

    def recording(lhs, rhs, *, dimension_numbers, **kw):
        (_, rc), (_, rb) = dimension_numbers
        columns.append(math.prod(rhs.shape[d] for d in range(rhs.ndim) if d not in rc and d not in rb))
        return plain(lhs, rhs, dimension_numbers=dimension_numbers, **kw)

    monkeypatch.setattr(bi, "invariant_dot_general", recording)
    layout = CacheLayout(num_slots=3, page_size=64, num_pages=24, max_pages_per_slot=8, storage=PACKED)
    runner = ModelRunner(params, config, layout, kernels=kernels)
    table = np.full((3, 8), -1, np.int32)
    table[1, :6] = (5, 17, 2, 11, 20, 8)
    ids = np.arange(3, 400)
    seen = {}
    for rows, tokens in ((1, 1), (2, 1), (1, 3), (3, 5)):
        columns.clear()
        batch = runner._batch([ChunkWork(1, ids[296:296 + tokens], 296, ids[:296], 0)], table, rows, tokens)[0]
        batch = jax.tree.map(jnp.asarray, batch)
        jax.make_jaxpr(lambda p, c, b: step_body(p, c, b, config=config, layout=layout, all_logits=True,
                                                 kernels=kernels))(runner.params, runner.cache, batch)
        seen[(rows, tokens)] = list(columns)
    assert len(seen[(1, 1)]) > 50
    for shape, counts in seen.items():
        assert counts == seen[(1, 1)], shape
