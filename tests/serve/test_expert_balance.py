"""EPLB while serving across hosts: the devices of one process form one node, so a mesh spread
over two processes plans with the hierarchical policy (an expert's replicas stay on its node),
and a one-process or interleaved mesh plans globally. Fake devices stand in for the processes:
only their `process_index` and their order in the mesh matter. Pure numpy."""

from types import SimpleNamespace

import numpy as np
import pytest

from deepinfer.serve.engine.expert_balance import ExpertBalancer, nodes_of
from deepinfer.sharding.eplb import device_load, imbalance

LAYERS, EXPERTS, DEVICES = 3, 8, 8


def fake_mesh(process_of_device: list[int]):
    devices = np.array([SimpleNamespace(id=i, process_index=p) for i, p in enumerate(process_of_device)], object)
    return SimpleNamespace(devices=devices.reshape(1, 2, -1), size=devices.size)


def skewed_load(seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(1e4 / np.arange(1, EXPERTS + 1) ** 1.2) for _ in range(LAYERS)])


@pytest.mark.parametrize("procs, nodes", [
    ([0] * 8, 1),
    ([0, 0, 0, 0, 1, 1, 1, 1], 2),
    ([0, 0, 1, 1, 2, 2, 3, 3], 4),
    ([0, 1, 0, 1, 0, 1, 0, 1], 1),  # interleaved: a node would not be a contiguous run of slots
    ([0, 0, 0, 1, 1, 1, 1, 1], 1),  # unequal device counts
    ([0, 0, 1, 1, 0, 0, 1, 1], 1),  # a process owning two runs
])
def test_nodes_of(procs, nodes):
    assert nodes_of(procs) == nodes


def test_two_processes_plan_hierarchically_with_a_valid_layout():
    balancer = ExpertBalancer.for_mesh(LAYERS, EXPERTS, 16, fake_mesh([0] * 4 + [1] * 4), interval=2)
    assert (balancer.nodes, balancer.groups, balancer.devices) == (2, EXPERTS, DEVICES)
    assert balancer.hierarchical
    load = skewed_load()
    phy2log, log2phy, count = balancer.plan(load)
    assert phy2log.shape == (LAYERS, 16) and (count >= 1).all() and (count.sum(axis=1) == 16).all()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=EXPERTS), count[layer])
        for e in range(EXPERTS):
            slots = log2phy[layer, e, :count[layer, e]]
            assert (phy2log[layer, slots] == e).all()
            # hierarchical: every replica of an expert lives on one node (slots 0-7 node 0, 8-15 node 1)
            assert len(set(slots // 8)) == 1, (layer, e, slots)
        # each node holds half the experts
        assert len(set(phy2log[layer, :8])) == len(set(phy2log[layer, 8:])) == EXPERTS // 2
    # and the plan balances the skewed load better than one expert per device would
    planned = imbalance(device_load(load, phy2log, count, DEVICES)).max()
    assert planned < imbalance(load).max()
    assert balancer.max_replicas >= count.max()


def test_one_process_plans_globally():
    balancer = ExpertBalancer.for_mesh(LAYERS, EXPERTS, None, fake_mesh([0] * 8))
    assert (balancer.nodes, balancer.groups) == (1, 1) and not balancer.hierarchical
    assert balancer.slots == EXPERTS + DEVICES  # default: one extra slot per device
    phy2log, _, count = balancer.plan(skewed_load())
    # global: the hottest expert's replicas may go anywhere, every device gets two slots
    assert phy2log.shape == (LAYERS, 16) and (count.sum(axis=1) == 16).all()


def test_without_a_mesh_one_device():
    balancer = ExpertBalancer.for_mesh(LAYERS, EXPERTS, None)
    assert (balancer.devices, balancer.nodes, balancer.slots) == (1, 1, EXPERTS + 1)


def test_experts_not_whole_per_node_plan_globally():
    """Six processes over 6 devices with 8 experts: groups cannot be whole per node."""
    balancer = ExpertBalancer.for_mesh(LAYERS, EXPERTS, 12, fake_mesh([0, 1, 2, 3, 4, 5]))
    assert balancer.nodes == 6 and balancer.groups == 1 and not balancer.hierarchical
    phy2log, _, count = balancer.plan(skewed_load())
    assert (count.sum(axis=1) == 12).all()


def test_bad_nodes_and_groups_are_named():
    with pytest.raises(ValueError, match="nodes"):
        ExpertBalancer(LAYERS, EXPERTS, 16, 8, nodes=3)
    with pytest.raises(ValueError, match="groups"):
        ExpertBalancer(LAYERS, EXPERTS, 16, 8, groups=3)
