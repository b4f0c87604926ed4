"""DeepSeek-V4.1 as pure JAX functions over parameter pytrees.

Public API: `load_config`, `init_params`, `forward`, `load_checkpoint`, `write_checkpoint`,
`convert_to_orbax`. This package never imports `deepinfer.serve`.
"""

from deepinfer.model.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from deepinfer.model.config import PRESETS, ConfigError, ModelConfig, load_config
from deepinfer.model.forward import forward
from deepinfer.model.orbax_format import convert_to_orbax, save_orbax
from deepinfer.model.params import QuantWeight, abstract_params, init_params, param_specs

__all__ = [
    "PRESETS", "CheckpointError", "ConfigError", "ModelConfig", "QuantWeight", "abstract_params",
    "convert_to_orbax", "forward", "init_params", "load_checkpoint", "load_config", "param_specs",
    "save_orbax", "write_checkpoint",
]
