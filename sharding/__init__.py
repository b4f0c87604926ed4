"""Meshes and partitioning rules: `make_mesh`, logical-axis rules for the parameters."""

from deepinfer.sharding.mesh import AXES, make_mesh, parse_mesh_spec
from deepinfer.sharding.rules import logical_to_spec, param_sharding, params_shardings

__all__ = ["AXES", "make_mesh", "parse_mesh_spec", "logical_to_spec", "param_sharding", "params_shardings"]
