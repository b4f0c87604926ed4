"""Many hosts through JAX's own multi-controller runtime (`jax.distributed`).

Every process runs the same program on the same inputs; after `initialize`, `jax.devices()`
lists the devices of all processes and a mesh built from them spans the hosts. On CPU the
cross-process collectives go through gloo (XLA's CPU client has no other implementation).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator listens and who this process is; all None = one process."""

    coordinator: str | None = None  # "host:port" of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))

    def validate(self) -> None:
        if not self.enabled:
            return
        missing = [name for name, v in (("coordinator", self.coordinator), ("num_processes", self.num_processes),
                                        ("process_id", self.process_id)) if v is None]
        if missing:
            raise ValueError(f"multi-process run needs coordinator, num_processes and process_id; missing "
                             f"{', '.join(missing)}")
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator must be host:port, got {self.coordinator!r}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")


def initialize(config: DistributedConfig) -> bool:
    """Join the multi-process runtime (before any other JAX call); False when not configured."""
    config.validate()
    if not config.enabled:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                               process_id=config.process_id)
    return True


def is_primary() -> bool:
    """Process 0 prints progress and results; the others stay quiet."""
    return jax.process_index() == 0


def process_zero_value(values) -> np.ndarray:
    """Process 0's `values` (a numeric array) in every process; `values` itself in a lone process.

    Every process must take the same host decisions, or they dispatch different programs and the
    collectives inside them never meet. A decision that rests on something a process measures
    itself (wall time: the verify step costs of confidence-scheduled verification) takes process
    0's measurement instead. Call it at the same point in every process (it is a collective)."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def barrier(name: str) -> None:
    """Wait until every process of a multi-process run reaches the barrier `name` (nothing to
    wait for in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def host_value(array: jax.Array) -> np.ndarray:
    """A global array's whole value in this process: in a multi-process run every process's
    shards gathered (a collective: call it at the same point in every process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)
