"""Expert-parallel load balancing (EPLB): where to put redundant copies of MoE experts.

Why: under expert parallelism each device owns a fixed set of expert slots, and real routing is
skewed -- a few experts see most tokens, so the device holding them sets the step time while the
others idle. Given a predicted per-expert load (e.g. a moving average of routed token counts), this
module gives heavy experts extra replicas and places all replicas so every device carries about the
same load. It is a host-side planning step run rarely (every few thousand steps), so it is written
in plain numpy, not JAX.

Two policies, after DeepSeek's EPLB:

- hierarchical (when ``num_groups % num_nodes == 0``): pack whole expert groups onto nodes, so
  group-limited routing keeps its traffic inside a node; replicate experts inside each node; then
  pack each node's replicas onto that node's devices.
- global: ignore groups and nodes; replicate over all slots and pack onto all devices.

Every packing step is the same greedy: take items heaviest first and put each into the currently
lightest bin that still has room, where every bin receives the same number of items. Replication
repeatedly gives one more copy to the expert with the largest load per copy.

Outputs: ``physical_to_logical[l, p]`` names the logical expert in physical slot ``p`` (slots are
laid out device by device, ``num_replicas // num_devices`` per device); ``logical_to_physical[l, e]``
lists the slots holding expert ``e`` in ascending order, padded with -1; ``replica_count[l, e]`` is
how many slots hold ``e``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["rebalance", "device_load", "imbalance", "balanced_packing", "replicate_experts"]

_POLICIES = ("auto", "hierarchical", "global")


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``n`` items (1-D ``weight``) into ``num_packs`` packs of exactly ``n // num_packs`` items.

    Heaviest item first, each to the lightest pack with a free slot (ties: lowest pack index).
    Returns ``(pack_of_item, rank_in_pack)``, both ``[n]`` int64.
    """
    weight = np.asarray(weight, dtype=np.float64)
    n = weight.shape[0]
    if num_packs <= 0 or n % num_packs:
        raise ValueError(f"num_packs={num_packs} must divide the number of items {n}")
    per_pack = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    totals = np.zeros(num_packs, dtype=np.float64)
    filled = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        open_totals = np.where(filled < per_pack, totals, np.inf)
        pack = int(np.argmin(open_totals))
        pack_of[item] = pack
        rank[item] = filled[pack]
        totals[pack] += weight[item]
        filled[pack] += 1
    return pack_of, rank


def replicate_experts(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``num_slots >= n`` slots with the ``n`` experts of 1-D ``weight``.

    Slot ``i < n`` holds expert ``i``; each further slot copies the expert whose load per copy is the
    largest. Returns ``(expert_of_slot [num_slots], count [n])``.
    """
    weight = np.asarray(weight, dtype=np.float64)
    n = weight.shape[0]
    if num_slots < n:
        raise ValueError(f"num_slots={num_slots} is smaller than the number of experts {n}")
    expert_of_slot = np.empty(num_slots, dtype=np.int64)
    expert_of_slot[:n] = np.arange(n)
    count = np.ones(n, dtype=np.int64)
    for slot in range(n, num_slots):
        e = int(np.argmax(weight / count))
        expert_of_slot[slot] = e
        count[e] += 1
    return expert_of_slot, count


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _rebalance_layer(w: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                     num_devices: int) -> np.ndarray:
    """Physical-to-logical map ``[num_replicas]`` for one layer (hierarchical; groups=nodes=1 is global)."""
    num_experts = w.shape[0]
    group_size = num_experts // num_groups
    slots_per_node = num_replicas // num_nodes
    devices_per_node = num_devices // num_nodes
    slots_per_device = num_replicas // num_devices

    # 1. Groups to nodes.
    group_w = w.reshape(num_groups, group_size).sum(axis=1)
    node_of_group, rank_of_group = balanced_packing(group_w, num_nodes)

    phy2log = np.empty(num_replicas, dtype=np.int64)
    for node in range(num_nodes):
        groups = np.flatnonzero(node_of_group == node)
        groups = groups[np.argsort(rank_of_group[groups], kind="stable")]
        experts = (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)

        # 2. Replicate inside the node.
        local_of_slot, count = replicate_experts(w[experts], slots_per_node)

        # 3. Replicas to the node's devices, weighted by load per copy.
        slot_w = w[experts][local_of_slot] / count[local_of_slot]
        dev_of_slot, rank_in_dev = balanced_packing(slot_w, devices_per_node)
        position = (node * devices_per_node + dev_of_slot) * slots_per_device + rank_in_dev
        phy2log[position] = experts[local_of_slot]
    return phy2log


def rebalance(load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
              num_devices: int, policy: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plan replicas and their placement from a predicted per-expert load.

    Args:
      load: ``[layers, logical_experts]`` non-negative token counts (or any load estimate).
      num_replicas: physical expert slots in total, ``>= logical_experts``, divisible by ``num_devices``.
      num_groups: expert groups of the router; must divide ``logical_experts``.
      num_nodes: server nodes; must divide ``num_devices``.
      num_devices: devices in total (expert-parallel size).
      policy: ``"auto"`` (hierarchical when ``num_groups % num_nodes == 0``, else global),
        ``"hierarchical"`` (error if that condition fails) or ``"global"``.

    Returns:
      ``(physical_to_logical [layers, num_replicas], logical_to_physical [layers, logical_experts,
      max_replicas] padded with -1, replica_count [layers, logical_experts])``, all int64.
    """
    load = np.asarray(load)
    if load.ndim != 2 or load.shape[0] == 0 or load.shape[1] == 0:
        raise ValueError(f"load must be a non-empty 2-D array [layers, logical_experts], got shape {load.shape}")
    if not np.issubdtype(load.dtype, np.number) or np.issubdtype(load.dtype, np.complexfloating):
        raise ValueError(f"load must be real-valued, got dtype {load.dtype}")
    load = load.astype(np.float64)
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("load must be finite and non-negative")
    num_layers, num_experts = load.shape
    num_replicas = _check_positive_int("num_replicas", num_replicas)
    num_groups = _check_positive_int("num_groups", num_groups)
    num_nodes = _check_positive_int("num_nodes", num_nodes)
    num_devices = _check_positive_int("num_devices", num_devices)
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} must be >= the number of logical experts {num_experts}")
    if num_replicas % num_devices:
        raise ValueError(f"num_replicas={num_replicas} must be divisible by num_devices={num_devices}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of logical experts {num_experts}")
    if num_devices % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} must divide num_devices={num_devices}")

    hierarchical = num_groups % num_nodes == 0
    if policy == "hierarchical" and not hierarchical:
        raise ValueError(
            f"hierarchical policy needs num_groups={num_groups} divisible by num_nodes={num_nodes}")
    if policy == "global":
        hierarchical = False
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)

    phy2log = np.stack([_rebalance_layer(load[l], num_replicas, groups, nodes, num_devices)
                        for l in range(num_layers)])
    count = np.stack([np.bincount(phy2log[l], minlength=num_experts) for l in range(num_layers)])
    max_replicas = int(count.max())
    log2phy = np.full((num_layers, num_experts, max_replicas), -1, dtype=np.int64)
    for l in range(num_layers):
        order = np.argsort(phy2log[l], kind="stable")  # slots grouped by expert, ascending within
        starts = np.concatenate([[0], np.cumsum(count[l])[:-1]])
        rank = np.arange(num_replicas) - np.repeat(starts, count[l])
        log2phy[l, phy2log[l, order], rank] = order
    return phy2log, log2phy, count.astype(np.int64)


def device_load(load: np.ndarray, physical_to_logical: np.ndarray, replica_count: np.ndarray,
                num_devices: int) -> np.ndarray:
    """Load per device ``[layers, num_devices]``: each replica takes ``load / replica_count`` of its
    expert; slots go ``num_replicas // num_devices`` per device, in order."""
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(physical_to_logical)
    count = np.asarray(replica_count)
    num_devices = _check_positive_int("num_devices", num_devices)
    if phy2log.ndim != 2 or phy2log.shape[0] != load.shape[0]:
        raise ValueError(f"physical_to_logical must be [layers, num_replicas], got {phy2log.shape}")
    if count.shape != load.shape:
        raise ValueError(f"replica_count must have the shape of load {load.shape}, got {count.shape}")
    num_layers, num_replicas = phy2log.shape
    if num_replicas % num_devices:
        raise ValueError(f"num_devices={num_devices} must divide num_replicas={num_replicas}")
    per_slot = np.take_along_axis(load / np.maximum(count, 1), phy2log, axis=1)
    return per_slot.reshape(num_layers, num_devices, num_replicas // num_devices).sum(axis=2)


def imbalance(device_load: np.ndarray) -> np.ndarray:
    """Max over mean device load, per layer (1.0 is perfect; an all-zero layer counts as 1.0)."""
    dl = np.asarray(device_load, dtype=np.float64)
    if dl.ndim != 2:
        raise ValueError(f"device_load must be [layers, num_devices], got shape {dl.shape}")
    mean = dl.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    return np.where(mean > 0, dl.max(axis=1) / safe, 1.0)
