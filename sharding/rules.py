"""Logical axis names of the parameters -> mesh axes.

Each `ParamSpec` names its dims ("vocab", "embed", "experts", ...). The rules below map them onto
the mesh; a dim may use a mesh axis only once per tensor (checked), and a dim whose size the axes
do not divide stays replicated on them.
"""

from __future__ import annotations

import math

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer.model.params import ParamSpec, QuantWeight, quant_block, quant_shapes

# logical axis -> mesh axes, in order of preference
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "experts": ("dp", "cp", "tp"),
    "vocab": ("tp",),
}


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    rules: dict[str, tuple[str, ...]] | None = None) -> PartitionSpec:
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        mesh_axes = tuple(a for a in rules.get(name, ()) if mesh.shape[a] > 1) if name else ()
        collision = used.intersection(mesh_axes)
        if collision:
            raise ValueError(f"logical axis {name!r} reuses mesh axis {sorted(collision)[0]!r} in one tensor")
        if mesh_axes and size % math.prod(mesh.shape[a] for a in mesh_axes) == 0:
            used.update(mesh_axes)
            out.append(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])
        else:
            out.append(None)
    return PartitionSpec(*out)


def param_sharding(spec: ParamSpec, mesh: Mesh, config, quantized: bool = False):
    """NamedSharding of a leaf (a QuantWeight of shardings when kept quantized): quantized
    tensors shard their leading (expert / row) dims like the dense tensor; block-scale dims
    that no longer divide stay replicated."""
    if not quantized:
        return NamedSharding(mesh, logical_to_spec(spec.axes, spec.shape, mesh))
    q_shape, s_shape = quant_shapes(spec, config)
    q_spec = logical_to_spec(spec.axes, q_shape, mesh)
    s_spec = logical_to_spec(spec.axes, s_shape, mesh)
    return QuantWeight(NamedSharding(mesh, q_spec), NamedSharding(mesh, s_spec), kind=spec.storage,
                       block=quant_block(spec, config))


def mesh_placement(mesh: Mesh):
    """The checkpoint loaders' `placement` for `mesh`: every leaf as `param_sharding` lays it out."""

    def place(spec: ParamSpec, config, quantized: bool):
        return param_sharding(spec, mesh, config, quantized=quantized)

    return place


def params_shardings(config, mesh: Mesh, quantized_storage: set[str] | None = None) -> dict:
    """Shardings tree matching `init_params` (dense) or a loaded checkpoint."""
    from deepinfer.model.params import build_tree

    return build_tree(config, lambda s: param_sharding(s, mesh, config,
                                                       quantized=bool(quantized_storage) and s.storage in quantized_storage))
