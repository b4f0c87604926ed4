"""Tests of the zigzag context-parallel split and its per-rank attention work model."""

import numpy as np
import pytest

from deepinfer.sharding.context_parallel import (
    PAD,
    attention_work,
    balance_report,
    contiguous_blocks,
    zigzag_blocks,
)

N16K = 16 * 1024


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
