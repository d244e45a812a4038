"""The one typed config: a schema (one dataclass per section), a loader (YAML + dotted overrides) and
validation that names the field.

- :mod:`gspo_megatron.config.schema`: ``Config`` and its sections (its errors are
  :class:`gspo_megatron.errors.ConfigError`).
- :mod:`gspo_megatron.config.loader`: ``load_config``, ``save_config``, ``config_help``.
- :mod:`gspo_megatron.config.validation`: ``validate`` (world size), ``validate_model_layout`` (model
  dims), and the derived sizes ``data_parallel_size``, ``micro_batches_per_rank``, ``engine_count``.

Everything public is importable from here (``from gspo_megatron.config import load_config, Config``).
"""

from gspo_megatron.config.loader import config_help, load_config, save_config
from gspo_megatron.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    GSPOConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    values_for,
)
from gspo_megatron.config.validation import (
    data_parallel_size,
    engine_count,
    micro_batches_per_rank,
    parse_eval_dataset,
    validate,
    validate_model_layout,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "GSPOConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "config_help",
    "data_parallel_size",
    "engine_count",
    "load_config",
    "micro_batches_per_rank",
    "parse_eval_dataset",
    "save_config",
    "validate",
    "validate_model_layout",
    "values_for",
]
