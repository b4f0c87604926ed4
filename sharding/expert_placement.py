"""Applying an EPLB layout (`deepinfer.sharding.eplb.rebalance`) to the MoE params.

Why: EPLB decides which logical expert each physical expert slot holds (hot experts get several
slots, spread over devices). Applying it means (1) rearranging the routed-expert weights into
physical slots, ``[n_phys, ...]`` laid out device by device so they shard over the EP axes like
any experts leaf, and (2) remapping each routed (token, logical expert) to one of that expert's
slots. The layout lives in the params as arrays of fixed shape (``p["placement"]``: ``log2phy
[E, max_replicas]``, ``count [E]``), so installing a new layout of the same ``n_phys`` and
``max_replicas`` changes values only and never recompiles the model.

The remap itself (`to_physical`) is the model's own (`deepinfer.model.moe`), so the model stays
independent of this package; it is re-exported here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from deepinfer.model.moe import expert_counts, to_physical
from deepinfer.model.params import QuantWeight

__all__ = ["physical_experts", "placement_arrays", "with_placement", "to_physical", "expert_counts"]


def _take_slots(leaf, idx: jnp.ndarray):
    """Rows `idx` of a stacked experts leaf; a QuantWeight keeps its checkpoint form."""
    if isinstance(leaf, QuantWeight):
        return QuantWeight(jnp.take(leaf.q, idx, axis=0), jnp.take(leaf.scale, idx, axis=0),
                           kind=leaf.kind, block=leaf.block)
    return jnp.take(leaf, idx, axis=0)


def physical_experts(experts_logical: dict, phy2log: np.ndarray) -> dict:
    """The routed experts subtree (w1/w3/w2, dense or QuantWeight: q and scales alike) with slot j
    holding logical expert ``phy2log[j]``, shape ``[n_phys, ...]``."""
    phy2log = np.asarray(phy2log)
    n_logical = {_leading_dim(leaf) for leaf in experts_logical.values()}
    if phy2log.ndim != 1 or len(n_logical) != 1:
        raise ValueError(f"phy2log must be 1-D [n_phys] for one layer (got shape {phy2log.shape}) and "
                         f"the experts leaves must share their expert count (got {sorted(n_logical)})")
    (n,) = n_logical
    if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= n):
        raise ValueError(f"phy2log names experts outside [0, {n})")
    idx = jnp.asarray(phy2log, dtype=jnp.int32)
    return {name: _take_slots(leaf, idx) for name, leaf in experts_logical.items()}


def placement_arrays(phy2log: np.ndarray, log2phy: np.ndarray, count: np.ndarray,
                     max_replicas: int) -> dict:
    """``{"log2phy": int32 [E, max_replicas] (-1 padded), "count": int32 [E]}`` for one layer,
    checked against ``phy2log``: expert e's first ``count[e]`` entries are exactly its slots."""
    phy2log, log2phy, count = (np.asarray(a, dtype=np.int64) for a in (phy2log, log2phy, count))
    if log2phy.ndim != 2 or count.shape != (log2phy.shape[0],):
        raise ValueError(f"log2phy must be [E, r] and count [E]; got {log2phy.shape} and {count.shape}")
    if phy2log.ndim != 1 or phy2log.min() < 0 or phy2log.max() >= count.shape[0]:
        raise ValueError(f"phy2log must be 1-D with expert ids in [0, {count.shape[0]}), got {phy2log.tolist()}")
    if count.min() < 1 or count.max() > max_replicas:
        raise ValueError(f"replica counts must lie in [1, max_replicas={max_replicas}], got {count.tolist()}")
    table = np.full((log2phy.shape[0], max(max_replicas, log2phy.shape[1])), -1, dtype=np.int64)
    table[:, :log2phy.shape[1]] = log2phy
    for e, c in enumerate(count):
        if sorted(table[e, :c]) != np.flatnonzero(phy2log == e).tolist() or np.any(table[e, c:] != -1):
            raise ValueError(f"log2phy[{e}] / count[{e}]={c} do not list exactly the slots of phy2log "
                             f"holding expert {e} ({np.flatnonzero(phy2log == e).tolist()})")
    return {"log2phy": jnp.asarray(table[:, :max_replicas], dtype=jnp.int32),
            "count": jnp.asarray(count, dtype=jnp.int32)}


def with_placement(ffn_params_logical: dict, phy2log: np.ndarray, log2phy: np.ndarray, count: np.ndarray,
                   max_replicas: int) -> dict:
    """One layer's ffn params (logical experts) -> the same with physical experts and
    ``"placement"``; `max_replicas` fixes the table width so later layouts reuse the compiled model."""
    out = dict(ffn_params_logical)
    out["experts"] = physical_experts(ffn_params_logical["experts"], phy2log)
    out["placement"] = placement_arrays(phy2log, log2phy, count, max_replicas)
    return out


def _leading_dim(w) -> int:
    return (w.q if isinstance(w, QuantWeight) else w).shape[0]
