"""The fused mHC mix + Sinkhorn kernel against the jnp reference (Pallas interpret mode on CPU),
the model's `hc_mixes` against an independent float64 numpy mHC, and the kernel's CUDA lowering."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model.mhc import hc_mixes
from deepinfer.pallas_kernels.lowering import TRITON_TARGET, custom_call_targets, lower_for_cuda
from deepinfer.pallas_kernels.mhc import mhc_mixes_pallas
from deepinfer.pallas_kernels.reference.mhc import mhc_mixes as reference
from tests.kernels.mode import INTERPRET
from tests.reference import v41_reference as reference_f64

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

EPS = dict(norm_eps=1e-6, hc_eps=1e-6)


def make_case(seed: int, lead: tuple[int, ...], hc: int, d: int, dtype=jnp.float32, fn_scale: float = 0.05):
    rng = np.random.default_rng(seed)
    m = 2 * hc + hc * hc
    streams = jnp.asarray(rng.standard_normal((*lead, hc, d)) * 3, dtype)
    fn = jnp.asarray(rng.standard_normal((m, hc * d)) * fn_scale, jnp.float32)
    base = jnp.asarray(rng.standard_normal(m), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32)
    return streams, fn, base, scale


def max_errors(got, want):
    assert [g.shape for g in got] == [w.shape for w in want]
    return [float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want)]


@pytest.mark.parametrize("lead,hc,d", [((2, 5), 4, 128), ((1, 37), 4, 96), ((3,), 2, 64), ((1, 1), 4, 512)],
                         ids=["batch-prefill", "ragged-width", "hc2", "decode-1tok"])
@pytest.mark.parametrize("iters", [1, 20])
def test_matches_reference(lead, hc, d, iters):
    args = make_case(hc * d + iters, lead, hc, d)
    got = mhc_mixes_pallas(*args, sinkhorn_iters=iters, interpret=INTERPRET, **EPS)
    want = reference(*args, sinkhorn_iters=iters, **EPS)
    assert max(max_errors(got, want)) <= 1e-5


def test_sharp_logits_and_bf16_streams():
    """Large comb logits (softmax near one-hot) and bf16 streams, as in the model."""
    args = make_case(11, (2, 9), 4, 128, dtype=jnp.bfloat16, fn_scale=1.0)
    got = mhc_mixes_pallas(*args, sinkhorn_iters=20, interpret=INTERPRET, **EPS)
    want = reference(*args, sinkhorn_iters=20, **EPS)
    assert max(max_errors(got, want)) <= 1e-4


def test_comb_is_doubly_stochastic():
    args = make_case(12, (4,), 4, 128)
    _, _, comb = mhc_mixes_pallas(*args, sinkhorn_iters=20, interpret=INTERPRET, **EPS)
    np.testing.assert_allclose(np.asarray(comb.sum(-2)), 1.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(comb.sum(-1)), 1.0, atol=1e-3)


@pytest.mark.parametrize("iters", [1, 20])
def test_model_hc_mixes_match_float64_numpy(iters):
    """The model's `hc_mixes` (on CPU the registry's jnp reference; the kernel above is checked
    against that) equals the independent float64 numpy mHC of tests/reference/ within fp32
    rounding (measured 3e-7; a transposed `comb` is off by 0.6)."""
    streams, fn, base, scale = make_case(13, (2, 7), 4, 128)
    got = hc_mixes(streams, fn, base, scale, sinkhorn_iters=iters, **EPS)
    flat = np.asarray(streams, np.float64).reshape(14, 4, 128)
    want = reference_f64.hc_mixes(flat, np.asarray(fn, np.float64), np.asarray(base, np.float64),
                                  np.asarray(scale, np.float64), sinkhorn_iters=iters, **EPS)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        g = np.asarray(g, np.float64)
        assert g.shape[:2] == (2, 7) and g.size == w.size, name
        np.testing.assert_allclose(g.reshape(w.shape), w, rtol=0, atol=2e-6, err_msg=name)


def test_lowers_for_cuda_as_triton_custom_call():
    args = make_case(14, (4, 33), 4, 512, dtype=jnp.bfloat16)
    text = lower_for_cuda(lambda *a: mhc_mixes_pallas(*a, sinkhorn_iters=20, **EPS), *args)
    assert custom_call_targets(text) == [TRITON_TARGET]
    assert "mhc_mixes" in text
