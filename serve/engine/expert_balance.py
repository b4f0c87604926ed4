"""Expert load balancing while serving: the engine counts the tokens each layer routes to each
expert, and every `interval` steps plans a new physical layout with DeepSeek's EPLB
(`deepinfer.sharding.eplb.rebalance`: redundant replicas of hot experts, packed so every device
gets an equal share) and installs it between steps.

A layout never changes outputs (replicas hold the same weights) and never recompiles: the number
of physical slots and the replica-table width are fixed when the engine starts.

On many hosts (`ExpertBalancer.for_mesh`) the devices of one process are one node and EPLB's
hierarchical policy runs: experts are packed onto nodes by load, then replicated and packed onto
the node's devices, so an expert's replicas never leave its node. DeepSeek-V4 routing has no
expert groups, so every expert is its own group (the policy's groups only have to be whole
per node). The physical slots split over the mesh's devices in `mesh.devices.flat` order, so a
node is a contiguous, equal run of that order; a mesh whose processes interleave plans globally.
"""

from __future__ import annotations

import logging

import numpy as np

from typing import Sequence

from deepinfer.sharding.eplb import device_load, imbalance, rebalance

log = logging.getLogger("deepinfer.engine")


def nodes_of(process_indices: Sequence[int]) -> int:
    """How many nodes the devices (`process_index` of each, in slot order) form for EPLB: the
    number of processes when each holds one contiguous run of equally many devices, else 1."""
    runs: list[list[int]] = []  # [process, devices] per contiguous run
    for p in process_indices:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    processes = {p for p, _ in runs}
    if len(runs) != len(processes) or len({n for _, n in runs}) != 1:
        return 1  # a process owns two runs, or processes own different device counts
    return len(runs)


class ExpertBalancer:
    def __init__(self, n_layers: int, n_experts: int, slots: int, devices: int, nodes: int = 1,
                 interval: int = 100, policy: str = "auto", groups: int = 1):
        if slots < n_experts or slots % devices:
            raise ValueError(f"eplb_slots ({slots}) must be at least the {n_experts} experts and a multiple of "
                             f"the {devices} devices")
        if devices % nodes:
            raise ValueError(f"EPLB nodes ({nodes}) must divide the {devices} devices")
        if n_experts % groups:
            raise ValueError(f"EPLB expert groups ({groups}) must divide the {n_experts} experts")
        self.n_layers, self.n_experts = n_layers, n_experts
        self.slots, self.devices, self.nodes, self.interval, self.policy = slots, devices, nodes, interval, policy
        self.groups = groups
        self.max_replicas = slots - n_experts + 1  # the most copies one expert can get
        self.layout: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._load_at_last = np.zeros((n_layers, n_experts), np.int64)
        self.history: list[dict] = []

    @classmethod
    def for_mesh(cls, n_layers: int, n_experts: int, slots: int | None, mesh=None,
                 interval: int = 100) -> ExpertBalancer:
        """The balancer of an engine on `mesh` (None: one device): `slots` physical experts per
        layer (None: the experts plus one per device); nodes are the mesh's processes (see
        `nodes_of`), every expert its own group, so a multi-host mesh plans hierarchically."""
        procs = [0] if mesh is None else [int(d.process_index) for d in np.asarray(mesh.devices).flat]
        nodes = nodes_of(procs)
        # whole groups per node; one node plans globally (groups = 1), as one process always did
        groups = n_experts if nodes > 1 and n_experts % nodes == 0 else 1
        return cls(n_layers, n_experts, slots or n_experts + len(procs), len(procs), nodes=nodes,
                   interval=interval, groups=groups)

    @property
    def hierarchical(self) -> bool:
        """Whether `plan` uses EPLB's hierarchical policy (nodes > 1 with whole groups per node)."""
        return self.policy != "global" and self.nodes > 1 and self.groups % self.nodes == 0

    def plan(self, load: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(phy2log, log2phy, count) for a `[layers, experts]` load; all-zero rows plan evenly."""
        load = np.where(load.sum(axis=1, keepdims=True) > 0, load, 1)
        return rebalance(load, self.slots, self.groups, self.nodes, self.devices, self.policy)

    def initial(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.layout = self.plan(np.ones((self.n_layers, self.n_experts)))
        return self.layout

    def due(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def update(self, total_load: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A new layout from the load counted since the last one (None when nothing was routed)."""
        window = total_load - self._load_at_last
        self._load_at_last = total_load.copy()
        if not window.any():
            return None
        before = self._worst_imbalance(window)
        self.layout = self.plan(window)
        after = self._worst_imbalance(window)
        self.history.append({"tokens": int(window.sum()), "imbalance_before": before, "imbalance_after": after})
        log.info("EPLB: new expert layout (%s) from %d routed tokens; worst layer max/mean device load "
                 "%.3f -> %.3f", f"hierarchical over {self.nodes} nodes" if self.hierarchical else "global",
                 window.sum(), before, after)
        return self.layout

    def _worst_imbalance(self, load: np.ndarray) -> float:
        """Max over layers of max/mean device load of `load` under the current layout."""
        phy2log, _, count = self.layout
        return float(imbalance(device_load(load, phy2log, count, self.devices)).max())
