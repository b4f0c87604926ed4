"""The flip-aware QAT comparison of tests/qat_sites.py on small programs: it finds every kind of
site, it absorbs a genuine rounding flip (an input one ulp across an FP8/FP4 rounding boundary),
and it still fails on a wrong quantizer, a wrong scale or an input that is really different."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.ops import quant
from tests import qat_sites

ROWS, WIDTH = 64, 64


def _inputs(seed=0):
    return np.random.default_rng(seed).standard_normal((ROWS, WIDTH)).astype(np.float32)


def _every_site(x):
    """One site of each kind, fake-quant and packed."""
    codes, scales = quant.pack_fp4_kv(x)
    return (quant.fake_quant_fp8(x, 32) + quant.fake_quant_fp4(x, 16, e4m3_scales=True)
            + quant.fake_quant_fp4(x, 32, e4m3_scales=False) + quant.unpack_fp8_blocks(*quant.pack_fp8_blocks(x))
            + quant.unpack_fp4_kv(codes, scales))


def _near_boundaries(seed=1):
    """Rows whose element 1 lies exactly on an FP8 rounding midpoint (scale 1: amax in
    (224, 448]), so the next float32 up rounds to the other neighbour."""
    x = np.random.default_rng(seed).uniform(-100, 100, (ROWS, 32)).astype(np.float32)
    x[:, 0] = 300.0  # amax 300: scale 2^ceil(log2(300/448)) = 1
    x[:, 1] = 68.0 + 8.0 * (np.arange(ROWS) % 8)  # midpoints of the e4m3 grid (steps of 8 in [64, 128))
    return x


def test_record_finds_every_kind_of_site_and_matches_the_reference_quantizers():
    _, sites = qat_sites.record(_every_site, jnp.asarray(_inputs()))
    kinds = {(k.fmt, k.block, k.e4m3_scales) for k in sites.x}
    assert kinds == {("fp8", 32, False), ("fp4", 16, True), ("fp4", 32, False)}
    assert sites.calls == 5 and len(sites.x[qat_sites.Kind("fp4", 16, True, WIDTH)]) == 2 * ROWS
    sites.check_quantizers()


def test_check_quantizers_catches_a_wrong_scale():
    _, sites = qat_sites.record(lambda x: quant.fake_quant_fp8(x, 32), jnp.asarray(_inputs()))
    kind = next(iter(sites.q))
    sites.q[kind][5] *= 2  # one row quantized with twice its scale
    with pytest.raises(AssertionError, match="1 of 64 rows differ"):
        sites.check_quantizers()


def test_replay_absorbs_a_one_ulp_flip():
    x = _near_boundaries()
    up = np.nextafter(x, np.float32(np.inf))  # "the other machine": every value one ulp higher
    fq = jax.jit(lambda a: quant.fake_quant_fp8(a, 32))
    assert np.any(np.asarray(fq(x)) != np.asarray(fq(up)))  # the flips are real
    want, sites = qat_sites.record(fq, jnp.asarray(x))
    replayer = qat_sites.Replayer(sites)
    got = replayer("fq8", fq, jnp.asarray(up))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert replayer.found.flipped_rows > 0
    replayer.found.check(max_flipped=1.0)


def test_replay_rejects_a_wrong_quantizer_or_a_different_input():
    x = jnp.asarray(_inputs())
    _, sites = qat_sites.record(lambda a: quant.fake_quant_fp4(a, 16, e4m3_scales=True), x)
    # another quantizer on the same input: its rows have no recorded twin
    wrong = qat_sites.Replayer(sites)
    wrong("fp4-ue8m0", lambda a: quant.fake_quant_fp4(a, 16, e4m3_scales=False), x)
    with pytest.raises(AssertionError, match="no row matched"):
        wrong.found.check()
    # a sign flip in part of the input (a bug upstream): those rows stay unmatched
    flipped = qat_sites.Replayer(sites)
    flipped("fp4", lambda a: quant.fake_quant_fp4(a.at[:8].multiply(-1), 16, e4m3_scales=True), x)
    with pytest.raises(AssertionError, match="8 of 64 rows match no recorded row"):
        flipped.found.check()


def test_adopting_rejects_reference_rows_without_a_twin():
    from tests.reference import v41_reference as R

    x = _inputs()
    _, sites = qat_sites.record(lambda a: quant.fake_quant_fp8(a, 32), jnp.asarray(x))
    with qat_sites.adopting(sites) as close:
        got = R.fake_quant_fp8_ue8m0(x.astype(np.float64) * (1 + 1e-7), 32)
    close.check()
    np.testing.assert_array_equal(got, sites.q[next(iter(sites.q))])
    with qat_sites.adopting(sites) as far:
        R.fake_quant_fp8_ue8m0(x.astype(np.float64) * 1.01, 32)  # 1 % off: not a rounding difference
    with pytest.raises(AssertionError, match="no row matched"):
        far.check()
