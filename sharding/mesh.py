"""The device mesh: axes ("dp", "cp", "tp") — attention data parallel, context parallel,
tensor parallel. Experts shard over all of them (DeepSeek's "DP attention + EP MoE")."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("dp", "cp", "tp")


def parse_mesh_spec(spec: str | dict[str, int] | None, n_devices: int) -> dict[str, int]:
    """"dp=2,cp=2,tp=1" (or a dict) -> axis sizes. With nothing given all devices go to dp; a
    missing cp or tp is 1 and a missing dp takes the devices left ("cp=2" on 8 devices is
    dp=4,cp=2). The product must equal the device count."""
    if spec is None or spec == "":
        sizes = {"dp": n_devices, "cp": 1, "tp": 1}
    else:
        if isinstance(spec, str):
            sizes = {}
            for part in spec.split(","):
                name, _, value = part.partition("=")
                name = name.strip()
                if not value.strip().isdigit() or int(value) < 1:
                    raise ValueError(f"mesh axis {name!r}: size must be a positive integer, got {value!r}")
                sizes[name] = int(value)
        else:
            sizes = dict(spec)
        unknown = sorted(set(sizes) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown[0]!r}; axes are {', '.join(AXES)}")
        if "dp" not in sizes:
            rest = math.prod(int(sizes.get(a, 1)) for a in AXES if a != "dp")
            sizes["dp"] = max(1, n_devices // rest) if n_devices % rest == 0 else 1
        sizes = {a: int(sizes.get(a, 1)) for a in AXES}
    product = math.prod(sizes.values())
    if product != n_devices:
        raise ValueError(
            f"mesh {','.join(f'{a}={n}' for a, n in sizes.items())} has {product} devices but {n_devices} are available"
        )
    return sizes


def make_mesh(spec: str | dict[str, int] | None = None, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
