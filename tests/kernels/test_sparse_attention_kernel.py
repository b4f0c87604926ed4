"""The Pallas sparse-attention kernel against the jnp reference (Pallas interpret mode on CPU),
and its CUDA lowering (cross-lowered from this CPU host)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.pallas_kernels.lowering import MOSAIC_GPU_TARGET, TRITON_TARGET, custom_call_targets, lower_for_cuda
from deepinfer.pallas_kernels.reference.sparse_attention import sparse_attention as reference
from deepinfer.pallas_kernels.sparse_attention import sparse_attention_pallas
from tests.kernels.mode import INTERPRET, KERNEL_BACKEND, ON_DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

H = 4


def make_case(seed: int, *, B: int, T: int, D: int, S: int, R: int, K: int, mask: str = "window",
              empty_frac: float = 0.3, dtype=jnp.float32):
    """Random inputs. `mask="window"`: a causal sliding window over S keys whose last T are the
    queries; `mask="self"`: each query sees only its own key; `mask="none"`: sees nothing."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D))
    kv = rng.standard_normal((B, S, D))
    ckv = rng.standard_normal((B, R, D))
    key_pos = np.arange(S)
    q_pos = S - T + np.arange(T)
    if mask == "window":
        m = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - 48)
        m = np.broadcast_to(m, (B, T, S)) & (rng.random((B, T, S)) < 0.9)  # ragged holes
    elif mask == "self":
        m = np.broadcast_to(key_pos[None, :] == q_pos[:, None], (B, T, S))
    else:
        m = np.zeros((B, T, S), bool)
    topk = rng.integers(0, max(R, 1), (B, T, K)) if R else np.full((B, T, K), -1)
    topk = np.where(rng.random((B, T, K)) < empty_frac, -1, topk)  # -1 slots anywhere
    sink = rng.standard_normal(H) * 2
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(q), cast(kv), jnp.asarray(m), cast(ckv), jnp.asarray(topk, jnp.int32),
            jnp.asarray(sink, jnp.float32), D ** -0.5)


def check(args, tol=2e-5):
    got = sparse_attention_pallas(*args[:-1], args[-1], interpret=INTERPRET)
    want = reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err <= tol, err
    return err


@pytest.mark.parametrize("D", [128, 512])
@pytest.mark.parametrize("K", [0, 5, 32])
@pytest.mark.parametrize("T,S", [(1, 130), (64, 64)], ids=["decode", "prefill"])
def test_matches_reference(T, S, K, D):
    check(make_case(K + D + T, B=2, T=T, D=D, S=S, R=37, K=K))


@pytest.mark.parametrize("T,S", [(1, 130), (64, 64)], ids=["decode", "prefill"])
def test_window_empty_except_self(T, S):
    check(make_case(1, B=2, T=T, D=128, S=S, R=21, K=5, mask="self"))


def test_no_keys_at_all_gives_zero():
    """No admitted window key and only -1 slots: the sink takes all the mass, output 0."""
    args = make_case(2, B=1, T=3, D=128, S=20, R=9, K=5, mask="none", empty_frac=1.0)
    got = sparse_attention_pallas(*args[:-1], args[-1], interpret=INTERPRET)
    assert float(jnp.max(jnp.abs(got))) == 0.0
    check(args)


@pytest.mark.parametrize("K", [5, 32])
def test_no_compressed_rows(K):
    """R = 0 (before the first compressed entry exists): the slots are all -1."""
    check(make_case(3, B=2, T=5, D=128, S=17, R=0, K=K))


def test_every_slot_selected():
    args = make_case(4, B=1, T=4, D=128, S=33, R=40, K=32, empty_frac=0.0)
    check(args)


def test_bf16_inputs():
    check(make_case(5, B=2, T=8, D=128, S=40, R=30, K=32, dtype=jnp.bfloat16), tol=3e-2)


def test_interpret_kernel_runs_in_the_model():
    """The tiny model's full forward with the interpreted kernel equals the reference forward.

    Without QAT fake-quantization: with it, fp32 rounding differences of ~1e-6 in the attention
    output flip FP8/FP4 rounding and indexer choices in later layers (0.3% logit changes), which
    says nothing about the kernel."""
    from deepinfer.model import init_params, load_config
    from deepinfer.model.forward import engram_hash_ids, forward_jit
    from deepinfer.pallas_kernels.registry import KernelConfig

    config = load_config("tiny-v4.1", fake_quant=False)
    params = init_params(config)
    ids = np.array([[0, 15, 300, 72, 9, 4000, 12, 88, 5, 61, 2, 999, 31]], np.int32)
    hash_ids = jnp.asarray(engram_hash_ids(config, ids), jnp.int32)
    ref = forward_jit(params, config, jnp.asarray(ids), hash_ids, None)
    got = forward_jit(params, config, jnp.asarray(ids), hash_ids,
                      KernelConfig(ops=(("sparse_attention", KERNEL_BACKEND),)))
    assert float(jnp.max(jnp.abs(got - ref))) <= 1e-4


# ---- CUDA lowering -------------------------------------------------------------------------


@pytest.mark.parametrize("T,D", [(1, 512), (64, 128)], ids=["decode-512", "prefill-128"])
def test_lowers_for_cuda_as_triton_custom_call(T, D):
    args = make_case(6, B=2, T=T, D=D, S=130, R=37, K=32, dtype=jnp.bfloat16)
    text = lower_for_cuda(lambda *a: sparse_attention_pallas(*a, scale=args[-1]), *args[:-1])
    assert custom_call_targets(text) == [TRITON_TARGET]
    assert "sparse_attention" in text  # the kernel name travels in the backend config


def test_mosaic_gpu_cannot_express_the_gather():
    """Why the kernel lowers through Triton: on jax 0.12.0.1 a Mosaic GPU kernel (plgpu.kernel)
    lowers a scalar-indexed row read but rejects the vector-indexed read the gather needs. When
    this starts passing lowering, a Mosaic GPU port becomes possible."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def gather(idx_ref, rows_ref, o_ref):
        o_ref[...] = rows_ref[idx_ref[...], :]

    def one_row(idx_ref, rows_ref, o_ref):
        o_ref[0, :] = rows_ref[idx_ref[0], :]

    idx = jnp.arange(128, dtype=jnp.int32)
    rows = jnp.ones((256, 128), jnp.float32)
    out = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    text = lower_for_cuda(lambda i, r: plgpu.kernel(one_row, out_type=out)(i, r), idx, rows)
    assert custom_call_targets(text) == [MOSAIC_GPU_TARGET]
    with pytest.raises(NotImplementedError, match="int_indexer_shape non-empty"):
        lower_for_cuda(lambda i, r: plgpu.kernel(gather, out_type=out)(i, r), idx, rows)


@pytest.mark.skipif(ON_DEVICE, reason="with a GPU present, lowering finds its device")
def test_cross_lowering_needs_an_abstract_gpu_device():
    """jax 0.12.0.1 behaviour that `lower_for_cuda` works around (see pallas_kernels/lowering.py)."""
    args = make_case(7, B=1, T=1, D=128, S=20, R=9, K=16)
    f = jax.jit(lambda *a: sparse_attention_pallas(*a, scale=args[-1]))
    with pytest.raises(RuntimeError, match="No supported GPU devices found"):
        f.trace(*args[:-1]).lower(lowering_platforms=("cuda",))


@pytest.mark.skipif(not ON_DEVICE, reason="needs the CUDA GPU")
def test_registry_picks_the_kernel_on_this_gpu():
    from deepinfer.pallas_kernels.registry import describe

    rows = {op: impl for op, impl, _ in describe()}
    assert rows["sparse_attention"] == "gpu_triton" and rows["mhc_mixes"] == "gpu_triton"
