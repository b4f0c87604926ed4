"""Expert load balancing while serving: the engine counts the tokens each layer routes to each
expert, and every `interval` steps plans a new physical layout with DeepSeek's EPLB
(`deepinfer.sharding.eplb.rebalance`: redundant replicas of hot experts, packed so every device
gets an equal share) and installs it between steps.

A layout never changes outputs (replicas hold the same weights) and never recompiles: the number
of physical slots and the replica-table width are fixed when the engine starts.
"""

from __future__ import annotations

import logging

import numpy as np

from deepinfer.sharding.eplb import device_load, imbalance, rebalance

log = logging.getLogger("deepinfer.engine")


class ExpertBalancer:
    def __init__(self, n_layers: int, n_experts: int, slots: int, devices: int, nodes: int = 1,
                 interval: int = 100, policy: str = "auto"):
        if slots < n_experts or slots % devices:
            raise ValueError(f"eplb_slots ({slots}) must be at least the {n_experts} experts and a multiple of "
                             f"the {devices} devices")
        self.n_layers, self.n_experts = n_layers, n_experts
        self.slots, self.devices, self.nodes, self.interval, self.policy = slots, devices, nodes, interval, policy
        self.max_replicas = slots - n_experts + 1  # the most copies one expert can get
        self.layout: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._load_at_last = np.zeros((n_layers, n_experts), np.int64)
        self.history: list[dict] = []

    def plan(self, load: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(phy2log, log2phy, count) for a `[layers, experts]` load; all-zero rows plan evenly."""
        load = np.where(load.sum(axis=1, keepdims=True) > 0, load, 1)
        return rebalance(load, self.slots, 1, self.nodes, self.devices, self.policy)

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
        log.info("EPLB: new expert layout from %d routed tokens; worst layer max/mean device load "
                 "%.3f -> %.3f", window.sum(), before, after)
        return self.layout

    def _worst_imbalance(self, load: np.ndarray) -> float:
        """Max over layers of max/mean device load of `load` under the current layout."""
        phy2log, _, count = self.layout
        return float(imbalance(device_load(load, phy2log, count, self.devices)).max())
