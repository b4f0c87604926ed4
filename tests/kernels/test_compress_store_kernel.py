"""`compress_store`: the reference is the engine step's own path (bit-equal to today's
`model.step._source_step`), and the Pallas kernels equal the reference byte for byte (Pallas
interpret mode on CPU); both kernels cross-lower for CUDA as Triton custom calls writing the pools
in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer.model.kv_cache import FLOAT, PACKED
from deepinfer.model.layers import rope_inv_freq
from deepinfer.pallas_kernels import registry
from deepinfer.pallas_kernels.compress_store import compress_store_pallas, e4m3_round
from deepinfer.pallas_kernels.lowering import TRITON_TARGET, custom_call_targets, lower_for_cuda
from deepinfer.pallas_kernels.reference.compress_store import compress_store as reference
from tests.kernels.mode import INTERPRET, KERNEL_BACKEND, ON_DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

PAGE_SIZE = 16  # tokens per page


def _bits(a) -> np.ndarray:
    """The raw bytes of an array, so -0.0 != +0.0 and NaN == NaN compare as stored."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def assert_same(got, want, what: str = ""):
    """Bit-equal in interpret mode. Compiled on a GPU the kernel sums RMSNorm squares in another
    order than XLA, so a few FP4 codes / last bits may differ: at most 1% of the stored words."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), what
    for i, (g, w) in enumerate(zip(got_l, want_l)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape, g.dtype, w.dtype)
        differ = _bits(g) != _bits(w)
        if INTERPRET:
            assert not differ.any(), f"{what} leaf {i}: {int(differ.sum())} of {differ.size} words differ"
        else:
            assert differ.mean() <= 0.01, f"{what} leaf {i}: {differ.mean():.2%} of the words differ"


def make_case(seed: int, rows, *, T: int, ratio: int, storage: str = PACKED, dtype=jnp.float32, D: int = 128,
              Dk: int = 64, rope_dim: int = 32, P: int = 12, S: int = 6, fake_quant: bool = True,
              small_channels: bool = False):
    """Inputs of one call. `rows`: per row (start position, valid length, slot, page table); a
    length of 0 is an all-padding row. The pools start with random bytes so untouched rows are
    checked too, and the pending state is random."""
    rng = np.random.default_rng(seed)
    B = len(rows)
    n_pages = max(len(r[3]) for r in rows)
    positions = np.full((B, T), -1, np.int32)
    last_index = np.zeros(B, np.int32)
    table = np.full((B, n_pages), -1, np.int32)
    for b, (start, length, _, pages) in enumerate(rows):
        positions[b, :length] = start + np.arange(length)
        last_index[b] = max(length - 1, 0)
        table[b, :len(pages)] = pages
    slots = np.array([r[2] for r in rows], np.int32)
    kv_dtype = jnp.float32 if ratio == 2 else dtype
    kv = jnp.asarray(rng.standard_normal((B, T, D)) * 2, kv_dtype)
    gate = jnp.asarray(rng.standard_normal((B, T, D)) * 3, jnp.float32) if ratio == 2 else None
    pending = jnp.asarray(rng.standard_normal((S, 2, D)) * 2, jnp.float32) if ratio == 2 else None
    per_page = PAGE_SIZE // ratio

    def pool(width, block, scale_dtype):
        if storage == FLOAT:
            return (jnp.asarray(rng.standard_normal((P, per_page, width)), dtype),)
        codes = jnp.asarray(rng.integers(0, 256, (P, per_page, width // 2)), jnp.uint8)
        scale_bits = rng.integers(1, 120, (P, per_page, width // block)).astype(np.uint8)
        return codes, jnp.asarray(scale_bits.view(scale_dtype))

    norm = rng.uniform(0.5, 1.5, D)
    if small_channels:  # blocks whose e4m3 scale is subnormal (below 2^-6), or at its floor 2^-9
        norm[:32] = 1e-2
        norm[32:48] = 1e-4
    params = dict(ratio=ratio, norm=jnp.asarray(norm, dtype),
                  wk=jnp.asarray(rng.standard_normal((Dk, D)) / np.sqrt(D), dtype),
                  k_norm=jnp.asarray(rng.uniform(0.5, 1.5, Dk), dtype),
                  inv_freq=rope_inv_freq(rope_dim, 10000.0, None), eps=1e-6, dtype=dtype, storage=storage,
                  fake_quant=fake_quant)
    args = (kv, gate, jnp.asarray(positions), jnp.asarray(positions >= 0), jnp.asarray(table),
            pool(D, 16, ml_dtypes.float8_e4m3fn), pool(Dk, 32, ml_dtypes.float8_e8m0fnu), pending,
            jnp.asarray(slots), jnp.asarray(last_index))
    return args, params


# XLA:CPU hands some fusions (e.g. a reduction with an exp) to YNNPACK, whose exp differs from
# XLA's own in the last bit, and it picks them by fusion pattern: the reference's softmax gets
# one, the interpreted kernel's loop body does not. Kernel-vs-reference comparisons on CPU
# therefore compile both sides with XLA's own code only (GPUs have no YNNPACK).
_ONE_MATH = {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else None


def compiled(fn, *args, one_math: bool = True):
    """`jax.jit(fn)` compiled for `args`, without YNNPACK fusions on CPU (see `_ONE_MATH`)."""
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options=_ONE_MATH) if one_math and _ONE_MATH else lowered.compile()


def call(fn, *args):
    return compiled(fn, *args)(*args)


def run_both(args, params):
    want = call(functools.partial(reference, **params), *args)
    got = call(functools.partial(compress_store_pallas, **params, interpret=INTERPRET), *args)
    return got, want


def rows_written(before, after) -> int:
    """How many pool rows a call changed (so a test cannot pass by writing nothing)."""
    changed = np.zeros(before[0].shape[:2], bool)
    for b, a in zip(before, after):
        changed |= (_bits(b) != _bits(a)).reshape(*b.shape[:2], -1).any(-1)
    return int(changed.sum())


# A mix: even and odd starts, an all-padding row, the last page of the pool (11), and runs that
# cross into a missing page (-1) and into a page id past the pool (14): those writes drop.
MIXED_ROWS = [(0, 9, 1, [3, 11]), (5, 6, 4, [10, 7]), (14, 5, 0, [5, -1]), (0, 0, 2, [1, 2]),
              (13, 9, 5, [11, 14])]
# rows each call writes: ratio 2 the odd positions with a page, ratio 1 every valid token with one
MIXED_WRITES = {2: 4 + 3 + 1 + 0 + 2, 1: 9 + 6 + 2 + 0 + 3}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("storage", [PACKED, FLOAT])
@pytest.mark.parametrize("ratio", [2, 1])
def test_matches_reference(ratio, storage, dtype):
    args, params = make_case(ratio * 10 + (storage == FLOAT), MIXED_ROWS, T=9, ratio=ratio, storage=storage,
                             dtype=dtype)
    got, want = run_both(args, params)
    assert_same(got, want, f"ratio {ratio} {storage}")
    n = rows_written(args[5], want[0])
    assert n == MIXED_WRITES[ratio], n
    assert rows_written(args[6], want[1]) == n
    if ratio == 2:
        before, after = np.asarray(args[7]), np.asarray(want[2])
        changed = [not np.array_equal(before[s], after[s]) for s in range(before.shape[0])]
        # slots 1, 4, 0 end on an even position (8, 10, 18): they hold it; slot 5 ends on 21,
        # slot 2 is the padding row's, slot 3 is unused
        assert changed == [True, True, False, False, True, False], changed


def test_release_widths_bf16():
    """The release's widths (head 512, index 128, rope 64) in bf16, decode-shaped (T=1)."""
    rows = [(11, 1, 0, [4]), (6, 1, 1, [2]), (0, 1, 2, [9]), (31, 1, 3, [7, 8])]
    for ratio in (2, 1):
        args, params = make_case(5 + ratio, rows, T=1, ratio=ratio, dtype=jnp.bfloat16, D=512, Dk=128, rope_dim=64)
        got, want = run_both(args, params)
        assert_same(got, want, f"ratio {ratio}")
        assert rows_written(args[5], want[0]) == (2 if ratio == 2 else 4)


@pytest.mark.parametrize("T", [1, 4, 13])
def test_chunk_lengths_and_start_parity(T):
    """Odd and even chunk lengths, rows starting at odd and even positions (decode T=1 too)."""
    rows = [(3, T, 0, [0, 1, 2]), (10, T, 1, [6, 7, 8]), (1, max(T - 2, 1), 2, [9, 10, 11])]
    args, params = make_case(100 + T, rows, T=T, ratio=2)
    got, want = run_both(args, params)
    assert_same(got, want, f"T={T}")


def test_float_storage_without_fake_quant():
    args, params = make_case(7, MIXED_ROWS, T=9, ratio=2, storage=FLOAT, fake_quant=False)
    got, want = run_both(args, params)
    assert_same(got, want)


def test_subnormal_entry_scales():
    """Channels with a tiny norm weight give blocks whose e4m3 scale is subnormal."""
    args, params = make_case(8, MIXED_ROWS, T=9, ratio=2, small_channels=True)
    got, want = run_both(args, params)
    assert_same(got, want)
    scales = np.asarray(want[0][1]).astype(np.float32)
    written = scales[_bits(args[5][1]) != _bits(want[0][1])]
    assert ((written > 2.0 ** -9) & (written < 2.0 ** -6)).any() and (written == 2.0 ** -9).any()


def test_pair_split_across_steps_equals_one_chunk():
    """A ratio-2 pair whose first token ends one step (held in `pending`) and whose second starts
    the next gives the same pools as the whole run in one chunk, for the reference and the kernel."""
    rows = [(0, 10, 1, [2, 5])]
    args, params = make_case(9, rows, T=10, ratio=2)
    kv, gate, positions, valid, table, entries, keys, pending, slots, last = args

    def chunk(lo, hi):
        pos = positions[:, lo:hi]
        return (kv[:, lo:hi], gate[:, lo:hi], pos, valid[:, lo:hi], table)

    for impl in (functools.partial(reference, **params),
                 functools.partial(compress_store_pallas, **params, interpret=INTERPRET)):
        fn = functools.partial(call, impl)
        whole = fn(*chunk(0, 10), entries, keys, pending, slots, jnp.asarray([9], jnp.int32))
        e1, k1, p1 = fn(*chunk(0, 5), entries, keys, pending, slots, jnp.asarray([4], jnp.int32))
        np.testing.assert_array_equal(np.asarray(p1)[1], np.stack([kv[0, 4], gate[0, 4]]))  # token 4 waits
        split = fn(*chunk(5, 10), e1, k1, p1, slots, jnp.asarray([4], jnp.int32))
        assert_same(split[:2], whole[:2], "split vs whole")
    assert rows_written(entries, whole[0]) == 5


def test_e4m3_round_is_xla_convert():
    """The bit-level e4m3 rounding (no fp8 convert on sm_80) against the convert of ml_dtypes and
    XLA:CPU: every e4m3 value, every midpoint and its neighbours, overflow (NaN), inf/NaN and
    random scales."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 2.0 ** -9)])
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    x = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf),
                        [448, 463.99, 464, 1e6, np.inf, np.nan], rng.uniform(2.0 ** -9, 500, 20000),
                        np.exp2(rng.uniform(-9, 9, 20000))]).astype(np.float32)
    value, byte = jax.jit(e4m3_round)(jnp.asarray(x))
    want = x.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(byte), _bits(want))
    np.testing.assert_array_equal(_bits(value), _bits(want.astype(np.float32)))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(byte), _bits(jnp.asarray(x).astype(jnp.float8_e4m3fn)))


def test_registered():
    assert set(registry.available("compress_store")) == {registry.REFERENCE, registry.GPU_TRITON, registry.INTERPRET}
    assert registry.get_kernel("compress_store") is reference or ON_DEVICE


# ---- the reference is today's engine step ---------------------------------------------------


def todays_source_step(p, config, layout, layer, x, batch, valid, st):
    """`model.step._source_step` as it is before the registry op, verbatim (frozen here as the
    oracle, so this test keeps its meaning once the step calls the op)."""
    from deepinfer.model import compressor, qat
    from deepinfer.model.kv_cache import decode, encode, pending_sources
    from deepinfer.model.layers import apply_rope, compress_inv_freq, linear, rms_norm
    from deepinfer.model.params import compute_dtype
    from deepinfer.model.paged import gather_pages as _gather_pages

    def _write_rows(pool, rows, *index):
        for i, (array, values) in enumerate(zip(pool, rows)):
            pool[i] = array.at[index].set(values.astype(array.dtype), mode="drop")

    ratio = config.compress_ratios[layer]
    src = config.kv_source_layer_ids.index(layer)
    positions = batch.positions
    if ratio == 1:
        kv, _ = compressor.project(p["compressor"], x, 1)
        latent = rms_norm(kv, p["compressor"]["norm"], config.rms_norm_eps)
        emit, entry_idx, entry_pos = valid, positions, positions
    else:
        k = pending_sources(config).index(layer)
        kv, gate = compressor.project(p["compressor"], x, ratio)
        held = st.pending[k][batch.slots]  # [B, 2, hd]
        prev_kv = jnp.concatenate([held[:, None, 0], kv[:, :-1]], axis=1)
        prev_gate = jnp.concatenate([held[:, None, 1], gate[:, :-1]], axis=1)
        pair_kv = jnp.stack([prev_kv, kv], axis=2)
        weights = jax.nn.softmax(jnp.stack([prev_gate, gate], axis=2), axis=2)
        latent = rms_norm(jnp.sum(pair_kv * weights, axis=2).astype(x.dtype), p["compressor"]["norm"],
                          config.rms_norm_eps)
        emit = valid & (positions % 2 == 1)
        entry_idx, entry_pos = positions // 2, positions - 1
        rows = jnp.arange(kv.shape[0])
        last_pos = positions[rows, batch.last_index]
        newest = jnp.stack([kv[rows, batch.last_index], gate[rows, batch.last_index]], axis=1)
        st.pending[k] = st.pending[k].at[batch.slots].set(
            jnp.where((last_pos % 2 == 0)[:, None, None], newest, held))
    inv_freq = compress_inv_freq(config)
    entries = apply_rope(latent, entry_pos, inv_freq)
    keys = apply_rope(rms_norm(linear(latent, p["indexer"]["wk"]), p["indexer"]["k_norm"], config.rms_norm_eps),
                      entry_pos, inv_freq)
    if layout.storage == FLOAT:  # store exactly what the attention uses
        entries, keys = qat.compressed_kv(entries, config), qat.index_vector(keys, config)
    per_page = layout.page_size // ratio
    logical = jnp.clip(entry_idx // per_page, 0, batch.page_table.shape[1] - 1)
    page = batch.page_table[jnp.arange(kv.shape[0])[:, None], logical]
    page = jnp.where(emit & (page >= 0), page, layout.num_pages)  # out of range: dropped
    offset = entry_idx % per_page
    _write_rows(st.entries[src], encode("entry", entries, layout.storage), page, offset)
    _write_rows(st.index_keys[src], encode("index", keys, layout.storage), page, offset)
    dtype = compute_dtype(config)
    st.shared["entries", layer] = decode("entry", _gather_pages(st.entries[src], batch.page_table), dtype)
    st.shared["index_keys", layer] = decode("index", _gather_pages(st.index_keys[src], batch.page_table), dtype)


@functools.cache
def _tiny(dtype: str):
    from deepinfer.model import init_params, load_config

    config = load_config("tiny-v4.1", dtype=dtype)
    return config, init_params(config)


@pytest.mark.slow
@pytest.mark.parametrize("storage,dtype", [(PACKED, "float32"), (FLOAT, "float32"), (PACKED, "bfloat16")])
def test_reference_equals_todays_source_step(storage, dtype):
    """The inline `_source_step` of before the registry op (frozen above) and today's step through
    the op (reference, and the interpreted kernels), over two consecutive steps on one cache (`model.step._State`): pools, pending state and the
    published entries and keys agree bit for bit, at a ratio-2 source (layer 2) and the ratio-1
    source (layer 5)."""
    from deepinfer.model.kv_cache import CacheLayout, init_cache
    from deepinfer.model.params import compute_dtype
    from deepinfer.model.step import StepBatch, _source_step, _State
    from deepinfer.pallas_kernels.registry import KernelConfig

    config, params = _tiny(dtype)
    layout = CacheLayout(num_slots=4, page_size=PAGE_SIZE, num_pages=8, max_pages_per_slot=3, storage=storage)
    rng = np.random.default_rng(11)
    B, T = 3, 7
    table = jnp.asarray([[7, 2, 5], [0, 3, -1], [6, 1, 4]], jnp.int32)
    slots = jnp.asarray([2, 0, 3], jnp.int32)

    def batch_at(starts, lengths):
        pos = np.full((B, T), -1, np.int32)
        for b, (s, n) in enumerate(zip(starts, lengths)):
            pos[b, :n] = s + np.arange(n)
        return StepBatch(tokens=jnp.zeros((B, T), jnp.int32), positions=jnp.asarray(pos), slots=slots,
                         page_table=table, hash_ids=None, last_index=jnp.asarray(np.maximum(lengths, 1) - 1, jnp.int32),
                         floor=jnp.zeros(B, jnp.int32))

    def run(step_fn, cache, x, batch):
        st = _State(cache)
        for layer in (2, 5):
            step_fn(params["layers"][layer]["attn"], config, layout, layer, x, batch, batch.positions >= 0, st)
        return st.cache(), published(st.shared)

    kernels = KernelConfig(ops=(("compress_store", KERNEL_BACKEND),))
    assert registry.resolve("compress_store", kernels)[0].backend == KERNEL_BACKEND
    interpret = functools.partial(_source_step, kernels=kernels)
    # (step function, compiled with XLA's own CPU math only): the reference must equal today's
    # step as compiled by default; the kernel is compared under `_ONE_MATH` (see there)
    variants = {"today": (todays_source_step, False), "reference": (_source_step, False),
                "today_one_math": (todays_source_step, True), "interpret": (interpret, True)}
    results = {name: init_cache(config, layout) for name in variants}
    steps = [(np.array([0, 3, 0]), np.array([7, 4, 0])), (np.array([7, 7, 0]), np.array([3, 7, 5]))]
    for i, (starts, lengths) in enumerate(steps):
        x = jnp.asarray(rng.standard_normal((B, T, config.hidden_size)), compute_dtype(config))
        batch = batch_at(starts, lengths)
        if i == 0:  # both steps have the same shapes: compile once
            steps_fn = {name: compiled(functools.partial(run, fn), results[name], x, batch, one_math=one_math)
                        for name, (fn, one_math) in variants.items()}
        outs = {name: steps_fn[name](results[name], x, batch) for name in variants}
        for name, base, check in (("reference", "today", _assert_bit_equal),
                                  ("interpret", "today_one_math", assert_same)):
            check(outs[name][0], outs[base][0], f"step {i} {name} cache")
            check(outs[name][1], outs[base][1], f"step {i} {name} shared")
        results = {name: out[0] for name, out in outs.items()}
    written = sum(int((np.asarray(a) != np.asarray(b)).any()) for a, b in
                  zip(jax.tree.leaves(results["today"]), jax.tree.leaves(init_cache(config, layout))))
    assert written >= 3  # entries, keys and pending all changed


def published(shared: dict) -> dict:
    """What the sources published, as decoded arrays: today's step publishes its pages
    (`model.paged.PagedSource`), read here whole, as the frozen step published them."""
    out = {}
    for key, value in shared.items():
        if key[0] == "source":
            out["entries", key[1]], out["index_keys", key[1]] = value.all_entries, value.all_keys
        else:
            out[key] = value
    return out


def _assert_bit_equal(got, want, what=""):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, i)
        assert np.array_equal(_bits(g), _bits(w)), f"{what} leaf {i}"


# ---- CUDA lowering -------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [PACKED, FLOAT])
@pytest.mark.parametrize("ratio", [2, 1])
def test_lowers_for_cuda_as_triton_custom_calls(ratio, storage):
    """Both kernels lower to Triton custom calls that alias the pools (in-place paged writes) and
    divide with the IEEE `div.rn.f32` (inline PTX), at the release widths in bf16."""
    args, params = make_case(12, MIXED_ROWS, T=9, ratio=ratio, storage=storage, dtype=jnp.bfloat16, D=512, Dk=128,
                             rope_dim=64)
    text = lower_for_cuda(lambda *a: compress_store_pallas(*a, **params), *args)
    assert custom_call_targets(text) == [TRITON_TARGET]
    assert "compress_store_entries" in text and "compress_store_keys" in text
    pools = 2 * (1 if storage == FLOAT else 2)
    assert text.count("stablehlo.output_operand_alias<") == pools
    assert "div.rn.f32" in text
