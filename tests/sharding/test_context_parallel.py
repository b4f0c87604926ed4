"""Tests of the zigzag context-parallel split, its per-rank attention work model, and the CP
prefill `forward_cp` against the single-device `forward` (run with -s for the measured diffs).

About the tolerances: CP changes fp32 summation order (attention over a gathered key axis, other
matmul shapes), ~5e-6 of the logit scale. The indexer's top-k, its candidate blocks and the MoE
routers are discrete choices: where two candidates are closer than that noise, the choice can
go either way and moves every later logit of the row (five of six random tiny-v4.1-short
prompts of 301 tokens hold a choice decided by less than 1e-5 of its scale, one by 1e-7; none of
them flipped here, which another machine does not promise). So the fake-quant-off V4.1 checks
compare each row only before its first near-tie, found by the float64 reference
(tests/choice_margins.py), the same on every machine; the V4 check (another reference) does not
yet. With QAT fake-quant every FP8/FP4 rounding midpoint is
also such a choice; that check makes the CP run adopt the single-device run's quantization
decisions (tests/qat_sites.py) and then holds it to the fake-quant-off tolerance.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.model import forward, init_params, load_config
from deepinfer.model.attention import window_mask
from deepinfer.model.indexer import dense_selection
from deepinfer.sharding.context_parallel import (
    PAD,
    attention_work,
    balance_report,
    contiguous_blocks,
    zigzag_blocks,
)
from deepinfer.sharding.cp_forward import cp_inputs, cp_layout, forward_cp, forward_cp_program, unzigzag
from deepinfer.sharding.mesh import make_mesh
from tests import qat_sites
from tests.choice_margins import near_tie_finder
from tests.argmax_check import assert_argmax_agrees

N16K = 16 * 1024
# A choice whose two candidates are closer than this (relative to their scores' scale) may go
# either way between two fp32 computations (their scores differ by ~1e-6 of the scale).
NEAR_TIE = 1e-5


@pytest.mark.parametrize("num_tokens,cp", [(N16K, 2), (N16K, 4), (4096, 8), (1000, 3), (7, 4), (0, 2)])
def test_zigzag_partitions_every_position_once(num_tokens, cp):
    ranks = zigzag_blocks(num_tokens, cp)
    assert len(ranks) == cp
    assert len({len(r) for r in ranks}) == 1
    assert len(ranks[0]) % 2 == 0
    allpos = np.concatenate(ranks)
    assert len(allpos) % (2 * cp) == 0 and len(allpos) - num_tokens < 2 * cp
    real = np.sort(allpos[allpos != PAD])
    np.testing.assert_array_equal(real, np.arange(num_tokens))
    assert np.all(allpos[allpos < 0] == PAD)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_rank_holds_blocks_r_and_mirror(cp):
    num_tokens = 64 * 2 * cp
    block = num_tokens // (2 * cp)
    for r, pos in enumerate(zigzag_blocks(num_tokens, cp)):
        np.testing.assert_array_equal(pos[:block], np.arange(r * block, (r + 1) * block))
        m = 2 * cp - 1 - r
        np.testing.assert_array_equal(pos[block:], np.arange(m * block, (m + 1) * block))


def test_contiguous_partitions():
    ranks = contiguous_blocks(1001, 4)
    assert {len(r) for r in ranks} == {251}
    allpos = np.concatenate(ranks)
    np.testing.assert_array_equal(allpos[allpos != PAD], np.arange(1001))


def test_work_model_small_cases():
    assert attention_work([0, 1, 2], dense_causal=True) == 1 + 2 + 3
    assert attention_work([PAD, PAD], dense_causal=True) == 0
    # p = 199, ratio 1: window 128 + min(200, 512) + indexer 200
    assert attention_work([199]) == 128 + 200 + 200
    # p = 999, ratio 2: window 128 + min(500, 512) + 500
    assert attention_work([999], ratio=2) == 128 + 500 + 500
    # p = 9999, ratio 1: topk caps selection, indexer scans all
    assert attention_work([9999]) == 128 + 512 + 10000
    assert attention_work([9999], ratio=0) == 128


@pytest.mark.parametrize("cp", [2, 4])
def test_dense_causal_zigzag_balanced_contiguous_not(cp):
    rep = balance_report(N16K, cp, dense_causal=True)
    z, c = rep["zigzag"]["max_over_mean"], rep["contiguous"]["max_over_mean"]
    print(f"dense causal 16K cp={cp}: zigzag max/mean={z:.4f} contiguous max/mean={c:.4f}")
    assert z <= 1.01
    assert c >= 1.3
    total = N16K * (N16K + 1) / 2
    assert sum(rep["zigzag"]["work"]) == pytest.approx(total)
    assert sum(rep["contiguous"]["work"]) == pytest.approx(total)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("ratio", [1, 2])
def test_v41_sparse_zigzag_not_worse(cp, ratio):
    rep = balance_report(N16K, cp, window=128, topk=512, ratio=ratio)
    z, c = rep["zigzag"]["max_over_mean"], rep["contiguous"]["max_over_mean"]
    print(f"V4.1 sparse 16K cp={cp} ratio={ratio}: zigzag max/mean={z:.4f} contiguous max/mean={c:.4f}")
    assert z <= c + 1e-12


@pytest.mark.parametrize("bad", [0, -1, -4])
def test_invalid_cp_raises(bad):
    for fn in (zigzag_blocks, contiguous_blocks, balance_report):
        with pytest.raises(ValueError, match="cp"):
            fn(1024, bad)


# ---- the layout forward_cp uses --------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,cp", [(301, 2), (301, 4), (203, 4), (64, 2), (5, 4), (1000, 3)])
def test_cp_layout_is_the_zigzag_split(num_tokens, cp):
    slots, positions = cp_layout(num_tokens, cp)
    np.testing.assert_array_equal(positions, np.concatenate(zigzag_blocks(num_tokens, cp)))
    np.testing.assert_array_equal(np.sort(slots), np.arange(len(slots)))  # a permutation
    real = positions >= 0
    np.testing.assert_array_equal(slots[real], positions[real])
    assert (slots[~real] >= num_tokens).all() and real.sum() == num_tokens


@pytest.mark.parametrize("num_tokens,cp", [(301, 2), (301, 4), (203, 4), (16, 8)])
def test_unzigzag_inverts_the_host_permutation(num_tokens, cp):
    slots, _ = cp_layout(num_tokens, cp)
    natural = np.arange(len(slots) * 3).reshape(1, len(slots), 3)
    zigzag = natural[:, slots]
    np.testing.assert_array_equal(np.asarray(unzigzag(jnp.asarray(zigzag), cp)), natural)


@pytest.mark.parametrize("num_tokens,cp", [(301, 2), (301, 4), (N16K + 5, 4), (4099, 8), (7, 4)])
def test_forward_cp_split_has_equal_real_queries_per_rank(num_tokens, cp):
    """Padding only shortens the last block (rank 0), so real query counts differ by < 2*cp,
    i.e. by less than one block."""
    _, positions = cp_layout(num_tokens, cp)
    per_rank = positions.reshape(cp, -1)
    real = (per_rank >= 0).sum(axis=1)
    block = per_rank.shape[1] // 2
    assert real.sum() == num_tokens
    assert real.max() - real.min() < min(2 * cp, block + 1), real


@pytest.mark.parametrize("cp", [2, 4])
def test_forward_cp_split_balances_causal_work(cp):
    _, positions = cp_layout(N16K, cp)
    work = [attention_work(p, dense_causal=True) for p in positions.reshape(cp, -1)]
    assert max(work) / np.mean(work) <= 1.01, work


def test_padding_is_never_visible_to_real_queries():
    """Padding keys (position -1) are masked for every query; a compressed row that pools any
    padded slot (its last token >= T) is invisible to every real query (position < T)."""
    T, cp = 301, 4
    _, zz = cp_layout(T, cp)
    k_pos = jnp.asarray(np.sort(zz)[::-1].copy()[None])  # all slots, padding included
    q_pos = jnp.asarray(zz[None])
    mask = np.asarray(window_mask(q_pos, k_pos, 128))[0]
    assert not mask[:, np.asarray(k_pos)[0] < 0].any()
    assert mask[zz >= 0].any(axis=1).all()  # every real query sees at least itself
    real = jnp.asarray(np.arange(T, dtype=np.int32)[None])
    for ratio in (1, 2, 4, 128):
        rows = np.asarray(dense_selection(real, len(zz) // ratio, ratio))[0]  # [T, rows]
        last_token = np.where(rows >= 0, rows * ratio + ratio - 1, -1)
        assert (last_token.max(axis=1) <= np.arange(T)).all(), ratio


# ---- forward_cp == forward --------------------------------------------------------------------

MEASURED: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if MEASURED:
        print("\nforward_cp vs forward: max |diff| / max |logit|, max |diff|")
        for name, (rel, diff) in MEASURED.items():
            print(f"  {name:<36} {rel:.2e}  {diff:.2e}")


def _mesh(cp: int):
    return make_mesh(f"cp={cp}", devices=jax.devices()[:cp])


def _prompts(batch: int, num_tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 128000, (batch, num_tokens))


def _compare(name: str, config, params, ids, cp: int, rel_tol: float, ref=None, out=None, upto=None):
    """`forward_cp` == `forward` to `rel_tol` of the logit scale; with `upto` (per row), only at the
    positions before each row's first near-tie (tests/choice_margins.py)."""
    ref = np.asarray(forward(params, config, ids)) if ref is None else ref
    out = forward_cp(params, config, ids, _mesh(cp)) if out is None else out
    assert out.shape == ref.shape and np.isfinite(out).all()
    if upto is not None:
        T, V = ref.shape[-2:]
        keep = np.arange(T)[None, :] < np.asarray(upto)[:, None]
        ref, out = ref.reshape(-1, T, V)[keep], out.reshape(-1, T, V)[keep]
        name = f"{name} (positions < {list(upto)})"
    per_position = np.abs(out - ref).max(-1)
    scale = float(np.abs(ref).max())
    diff = float(per_position.max())
    rel = diff / scale
    MEASURED[name] = (rel, diff)
    print(f"{name}: rel {rel:.2e} abs {diff:.2e}")
    bad = np.argwhere(per_position > rel_tol * scale)[:3].tolist()
    assert rel <= rel_tol, f"{name}: rel {rel:.2e}; first differing (row, position): {bad}"
    assert_argmax_agrees(out, ref, rel_tol * scale)


@pytest.fixture(scope="module")
def tiny41():
    config = load_config("tiny-v4.1-short", dtype="float32", fake_quant=False)
    return config, init_params(config, seed=3)


@pytest.fixture(scope="module")
def near_ties(tiny41):
    """`near_ties(config, ids [B, T])`: each row's first position with a choice decided by less
    than NEAR_TIE, from the float64 reference (so the same on every machine)."""
    find = near_tie_finder(*tiny41, NEAR_TIE)
    return lambda config, ids: [find(row, config) for row in ids]


@pytest.mark.parametrize("cp", [2, 4])
def test_forward_cp_matches_forward_v41(tiny41, near_ties, cp):
    """B=2, T=301: odd (padding), past the window (128), the candidate pool (64 entries) and
    index_topk (32); Engram, all layer kinds. Compared before each row's first near-tie (these
    prompts hold none: smallest margins 1.3e-5 and 1.1e-5). Measured rel ~3e-6 (cp=2), ~5e-6
    (cp=4)."""
    config, params = tiny41
    ids = _prompts(2, 301, seed=0)
    _compare(f"tiny-v4.1-short cp={cp} B=2 T=301", config, params, ids, cp, 2e-5, upto=near_ties(config, ids))


def test_forward_cp_exact_without_topk_truncation(tiny41, near_ties):
    """With every visible entry selected the indexer chooses nothing; the routers still do
    (cp=4, T=139: 5 padding slots)."""
    config, params = tiny41
    config = dataclasses.replace(config, index_topk=256, candidate_topk_blocks=64)
    ids = _prompts(1, 139, seed=5)
    _compare("tiny-v4.1-short no-truncation cp=4 T=139", config, params, ids, 4, 2e-5, upto=near_ties(config, ids))


def test_forward_cp_matches_forward_v4():
    """V4: CSA with overlapping windows and its own indexer compressor, HCA ratio 128 (dense
    selection), hash-routed MoE; 1-D input. Measured rel ~3e-6."""
    config = load_config("tiny-v4", dtype="float32", fake_quant=False)
    params = init_params(config, seed=3)
    ids = _prompts(1, 301, seed=1)[0]
    _compare("tiny-v4 cp=2 T=301", config, params, ids, 2, 2e-5)


def test_forward_cp_matches_forward_v41_fake_quant(tiny41):
    """QAT fake-quant on: fp32 noise that crosses an FP4/FP8 rounding midpoint changes a value by
    a whole quantization step and moves every later logit (measured up to 2e-2 of the logit scale
    at T=61, cp=2; ~0.2-0.8 at T=301, where flips cascade through top-k), and which values flip
    depends on the machine. So the CP run adopts the single-device run's quantization decisions
    wherever its site input is within 1e-3 of a recorded one (tests/qat_sites.py: the padding
    slots' rows find none, few matched rows may round differently on their own), and must then
    match as tightly as with fake-quant off. T=61: odd, past index_topk."""
    config, params = tiny41
    config = dataclasses.replace(config, fake_quant=True)
    ids = _prompts(1, 61, seed=4)
    ref, sites = qat_sites.record_forward(params, config, ids)
    assert sites.calls > 0  # fake-quant really ran
    inputs, order = cp_inputs(config, ids, 2)
    replayer = qat_sites.Replayer(sites)
    mesh = _mesh(2)
    out = replayer(("forward_cp", config, mesh),
                   lambda p, i, pos, h: forward_cp_program(p, i, pos, h, config=config, mesh=mesh), params, *inputs)
    replayer.found.check(unmatched=None)
    _compare("tiny-v4.1-short QAT cp=2 T=61", config, params, ids, 2, 2e-5, ref=ref, out=np.asarray(out)[:, order])
