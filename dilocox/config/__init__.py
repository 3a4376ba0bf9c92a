"""Configuration: dataclasses validated on load, YAML files, ``--a.b=value`` overrides.

Every field has a default so that a YAML file only states what differs. A config file may
``include:`` other YAML files (paths relative to the including file); later keys win.
Validation happens at load time and names the field, the value and the constraint, e.g.::

    ConfigError: model.n_heads=6 is not divisible by parallel.tensor=4
                 (each tensor-parallel rank must own whole attention heads)

Layout: ``sections`` (one dataclass per YAML section), ``checks`` (``ConfigError``, ``QUANT_KINDS``
and the rules, one checker per concern), ``root`` (the root ``Config``, ``validate``,
``validate_swarm_layout``), ``loading`` (YAML, includes, overrides, ``load_config``, ``to_yaml``),
``reference`` (docs/CONFIG.md). Import from ``dilocox.config``: every name is re-exported here.
"""

from dilocox.config.checks import QUANT_KINDS, ConfigError, check_outer_schedule
from dilocox.config.loading import _deep_merge as _deep_merge
from dilocox.config.loading import _read_yaml as _read_yaml
from dilocox.config.loading import from_dict, load_config, parse_overrides, to_yaml
from dilocox.config.reference import reference_markdown
from dilocox.config.root import Config, validate, validate_swarm_layout
from dilocox.config.sections import (
    AdaptiveConfig,
    CheckpointConfig,
    CompressConfig,
    DataConfig,
    ElasticSection,
    LogConfig,
    LowRankConfig,
    ModelConfig,
    OptimConfig,
    OuterConfig,
    ParallelConfig,
    SecurityConfig,
    SparseConfig,
    StreamingConfig,
    SwarmConfig,
    TrainConfig,
)

__all__ = [
    "QUANT_KINDS",
    "AdaptiveConfig",
    "CheckpointConfig",
    "CompressConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ElasticSection",
    "LogConfig",
    "LowRankConfig",
    "SparseConfig",
    "ModelConfig",
    "OptimConfig",
    "OuterConfig",
    "ParallelConfig",
    "SecurityConfig",
    "StreamingConfig",
    "SwarmConfig",
    "TrainConfig",
    "check_outer_schedule",
    "from_dict",
    "load_config",
    "parse_overrides",
    "reference_markdown",
    "to_yaml",
    "validate",
    "validate_swarm_layout",
]
