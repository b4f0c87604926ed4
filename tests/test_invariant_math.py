"""`ops.invariant_math`: transcendental functions whose result depends on the input alone, as
accurate as XLA's own, and the same bits in any array shape (XLA CPU's `exp`, `rsqrt`,
`logistic`, `log1p`, `tanh` change in the last bit with where an element falls in the array)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.ops import invariant_math as im
from deepinfer.ops.batch_invariant import XLA_CPU_OPTIONS

RNG = np.random.default_rng(0)
CASES = {  # function, float64 reference, inputs, ulp bound
    "exp": (np.exp, np.concatenate([RNG.uniform(-87, 88.7, 100_000), RNG.standard_normal(10_000)]), 2),
    "log": (np.log, np.concatenate([np.exp(RNG.uniform(-87, 88, 100_000)), RNG.uniform(0.5, 2, 10_000)]), 3),
    "log1p": (np.log1p, np.concatenate([RNG.uniform(-0.999, 10, 100_000), RNG.standard_normal(10_000) * 1e-3,
                                        np.exp(RNG.uniform(-30, 0, 10_000))]), 3),
    "logistic": (lambda x: 1 / (1 + np.exp(-x)), RNG.uniform(-80, 80, 100_000), 3),
    "rsqrt": (lambda x: 1 / np.sqrt(x), np.exp(RNG.uniform(-80, 80, 100_000)), 2),
    "tanh": (np.tanh, np.concatenate([RNG.uniform(-10, 10, 100_000), RNG.standard_normal(10_000) * 0.1]), 5),
}
LIBRARY = {"exp": jnp.exp, "log": jnp.log, "log1p": jnp.log1p, "logistic": jax.nn.sigmoid, "rsqrt": jax.lax.rsqrt,
           "tanh": jnp.tanh}


@pytest.mark.parametrize("name", sorted(CASES))
def test_accurate_to_a_few_ulp_against_float64(name):
    reference, x, bound = CASES[name]
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(getattr(im, name))(x)).astype(np.float64)
    want = reference(x.astype(np.float64))
    normal = np.abs(want) >= np.finfo(np.float32).tiny  # (XLA CPU flushes subnormals)
    ulp = np.spacing(want[normal].astype(np.float32)).astype(np.float64)
    worst = np.max(np.abs(got[normal] - want[normal]) / np.abs(ulp))
    assert worst <= bound, f"{name}: {worst:.2f} ulp"


@pytest.mark.parametrize("name", sorted(CASES))
def test_special_values_as_the_library_functions(name):
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 88.7, 88.8, -103.9, -104.1, -87.5, 1e-30, 50.0],
                 np.float32)
    ours, theirs = np.asarray(getattr(im, name)(x)), np.asarray(LIBRARY[name](x))
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)), (x, ours, theirs)
    finite = ~np.isnan(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=3e-7, atol=0)


def test_bfloat16_goes_through_float32_and_other_dtypes_are_refused():
    x = jnp.asarray([0.5, -2.0], jnp.bfloat16)
    assert im.exp(x).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(im.exp(x), np.float32),
                                  np.asarray(im.exp(x.astype(jnp.float32)).astype(jnp.bfloat16), np.float32))
    with pytest.raises(NotImplementedError, match="invariant exp: int32"):
        im.exp(jnp.asarray([1, 2], jnp.int32))


SHAPED = {  # as the model uses them: after a row max, inside a norm, on small per-token groups
    "exp": lambda h: im.exp(h - jnp.max(h, -1, keepdims=True)),
    "logistic": lambda h: im.logistic(h * 2 + 1),
    "log1p": lambda h: im.log1p(im.exp(-jnp.abs(h))) + jnp.maximum(h, 0),
    "log": lambda h: im.log(jnp.abs(h) + 1e-3),
    "rsqrt": lambda h: im.rsqrt(jnp.abs(h) + 0.5),
    "rms_norm": lambda h: h * im.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6),
    "tanh": im.tanh,
}


@pytest.mark.parametrize("width", [3, 4, 8, 24])
def test_a_row_is_the_same_bits_in_any_number_of_rows(width):
    base = RNG.standard_normal((300, width)).astype(np.float32)
    for name, fn in SHAPED.items():
        program = jax.jit(fn, compiler_options=XLA_CPU_OPTIONS)
        whole = np.asarray(program(base))
        differ = [n for n in (*range(1, 34), 64, 100, 257) if not np.array_equal(np.asarray(program(base[:n])),
                                                                                  whole[:n])]
        assert not differ, f"{name} on [n, {width}] differs for n in {differ}"
