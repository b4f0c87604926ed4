"""Tests of deepinfer.sharding.eplb: valid, mutually inverse maps; equal slots per device; a skewed
(Zipf) load becomes balanced under both policies; a uniform load stays balanced; bad arguments fail
with a message naming them. Pure numpy, no devices needed."""

import numpy as np
import pytest

from deepinfer.sharding.eplb import balanced_packing, device_load, imbalance, rebalance

E, R, GROUPS, NODES, DEVICES, LAYERS = 64, 80, 8, 2, 8, 4


def zipf_load(layers=LAYERS, experts=E, s=1.0, seed=0):
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, experts + 1) ** s
    return np.stack([rng.permutation(base) for _ in range(layers)]) * 1e5


def check_maps(load, p2l, l2p, cnt, num_replicas, num_devices):
    layers, experts = load.shape
    assert p2l.shape == (layers, num_replicas)
    assert cnt.shape == (layers, experts)
    assert l2p.shape[:2] == (layers, experts) and l2p.shape[2] == cnt.max()
    assert (cnt >= 1).all() and (cnt.sum(axis=1) == num_replicas).all()
    assert ((p2l >= 0) & (p2l < experts)).all()
    for l in range(layers):
        np.testing.assert_array_equal(np.bincount(p2l[l], minlength=experts), cnt[l])
        for e in range(experts):
            slots = l2p[l, e]
            valid = slots[: cnt[l, e]]
            assert (slots[cnt[l, e]:] == -1).all()
            assert (valid >= 0).all() and (np.diff(valid) > 0).all()
            assert (p2l[l, valid] == e).all()
    # Slots per device: the layout is fixed, so every device gets exactly num_replicas/num_devices,
    # and together they cover all the load.
    dl = device_load(load, p2l, cnt, num_devices)
    assert dl.shape == (layers, num_devices)
    np.testing.assert_allclose(dl.sum(axis=1), load.sum(axis=1), rtol=1e-9)


@pytest.mark.parametrize("policy", ["hierarchical", "global", "auto"])
def test_maps_valid_and_inverse(policy):
    load = zipf_load()
    p2l, l2p, cnt = rebalance(load, R, GROUPS, NODES, DEVICES, policy=policy)
    check_maps(load, p2l, l2p, cnt, R, DEVICES)


def test_hierarchical_keeps_groups_on_one_node():
    load = zipf_load()
    p2l, _, _ = rebalance(load, R, GROUPS, NODES, DEVICES, policy="hierarchical")
    per_node = R // NODES
    group_size = E // GROUPS
    for l in range(LAYERS):
        for node in range(NODES):
            groups = set(p2l[l, node * per_node:(node + 1) * per_node] // group_size)
            assert len(groups) == GROUPS // NODES  # whole groups, each on exactly one node


def test_auto_falls_back_to_global():
    load = zipf_load(experts=48)
    # 3 groups over 2 nodes: not divisible, so auto uses the global policy.
    auto = rebalance(load, 64, 3, 2, 8)
    glob = rebalance(load, 64, 3, 2, 8, policy="global")
    for a, g in zip(auto, glob):
        np.testing.assert_array_equal(a, g)
    check_maps(load, *auto, 64, 8)


def test_skewed_load_gets_balanced():
    load = zipf_load()
    identity = np.tile(np.arange(E), (LAYERS, 1))
    before = imbalance(device_load(load, identity, np.ones_like(load), DEVICES))
    p2l, _, cnt = rebalance(load, R, GROUPS, NODES, DEVICES)  # auto -> hierarchical
    after = imbalance(device_load(load, p2l, cnt, DEVICES))
    p2l_g, _, cnt_g = rebalance(load, R, GROUPS, NODES, DEVICES, policy="global")
    after_g = imbalance(device_load(load, p2l_g, cnt_g, DEVICES))
    print(f"max/mean device load: identity {before.max():.3f}, hierarchical {after.max():.3f}, "
          f"global {after_g.max():.3f}")
    assert before.min() >= 1.5
    assert after.max() <= 1.15
    assert after_g.max() <= 1.15
    # Heavy experts got the redundant replicas.
    heaviest = load.argmax(axis=1)
    assert (cnt[np.arange(LAYERS), heaviest] >= 2).all()


@pytest.mark.parametrize("policy", ["hierarchical", "global"])
def test_uniform_load_stays_balanced(policy):
    load = np.full((2, E), 100.0)
    p2l, l2p, cnt = rebalance(load, R, GROUPS, NODES, DEVICES, policy=policy)
    check_maps(load, p2l, l2p, cnt, R, DEVICES)
    dl = device_load(load, p2l, cnt, DEVICES)
    np.testing.assert_allclose(imbalance(dl), 1.0, atol=0.26)  # 16 extra copies of 64 on 8 devices
    no_spare = rebalance(load, E, GROUPS, NODES, DEVICES, policy=policy)
    np.testing.assert_allclose(imbalance(device_load(load, no_spare[0], no_spare[2], DEVICES)), 1.0)


def test_balanced_packing_equal_counts():
    w = np.array([9.0, 1, 1, 1, 5, 5, 2, 2])
    pack, rank = balanced_packing(w, 4)
    assert (np.bincount(pack, minlength=4) == 2).all()
    for p in range(4):
        assert sorted(rank[pack == p]) == [0, 1]
    totals = np.bincount(pack, weights=w, minlength=4)
    # Greedy trace: 9->p0, 5->p1, 5->p2, 2 and 2->p3 (now full), then the 1s to p1, p2, p0.
    np.testing.assert_array_equal(totals, [10.0, 6.0, 6.0, 4.0])


def test_imbalance_zero_layer():
    np.testing.assert_allclose(imbalance(np.array([[0.0, 0.0], [1.0, 3.0]])), [1.0, 1.5])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_replicas=81), "num_replicas"),       # not divisible by num_devices
        (dict(num_replicas=56), "num_replicas"),       # fewer slots than experts
        (dict(num_groups=7), "num_groups"),            # does not divide 64 experts
        (dict(num_nodes=3), "num_nodes"),              # does not divide num_devices
        (dict(num_devices=0), "num_devices"),
        (dict(num_groups=-1), "num_groups"),
        (dict(policy="nope"), "policy"),
    ],
)
def test_bad_arguments(kwargs, name):
    args = dict(num_replicas=R, num_groups=GROUPS, num_nodes=NODES, num_devices=DEVICES)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        rebalance(zipf_load(), **args)


def test_bad_load_and_hierarchical_requirement():
    with pytest.raises(ValueError, match="load"):
        rebalance(np.ones(64), R, GROUPS, NODES, DEVICES)
    with pytest.raises(ValueError, match="load"):
        rebalance(-np.ones((1, 64)), R, GROUPS, NODES, DEVICES)
    with pytest.raises(ValueError, match="num_groups"):
        rebalance(np.ones((1, 48)), 64, 3, 2, 8, policy="hierarchical")
    with pytest.raises(ValueError, match="num_devices"):
        device_load(np.ones((1, 64)), np.tile(np.arange(64), (1, 1)), np.ones((1, 64)), 7)
