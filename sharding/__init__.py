"""Meshes and partitioning rules: `make_mesh`, logical-axis rules for the parameters; expert
parallelism for the MoE and applying an EPLB expert layout."""

from deepinfer.sharding.expert_parallel import ExpertParallel, ep_size, ffn_partition_specs
from deepinfer.sharding.expert_placement import physical_experts, to_physical, with_placement
from deepinfer.sharding.mesh import AXES, make_mesh, parse_mesh_spec
from deepinfer.sharding.rules import logical_to_spec, mesh_placement, param_sharding, params_shardings

__all__ = ["AXES", "make_mesh", "parse_mesh_spec", "logical_to_spec", "mesh_placement", "param_sharding", "params_shardings",
           "ExpertParallel", "ep_size", "ffn_partition_specs", "physical_experts", "to_physical", "with_placement"]
