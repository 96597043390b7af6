"""Typed experiment configuration: nested dataclasses loaded from YAML.

A config file is a YAML mapping whose sections mirror the dataclasses of this package, one
module per section (`data`, `model`, `head`, `optim`, `train` with `precision`, `eval`;
`synthetic` holds `data.synthetic` and the generator's `SyntheticSpec`, `augment`
`data.augment` and its presets), gathered in
`experiment.ExperimentConfig` with the checks that span sections. The dataclasses' defaults
are the built-in run's (`python train.py`). A file may name a `base:` file (beside it, else
a name in configs/) that it overrides key by key, so each experiment is a short file over
one base. Command-line overrides use dotted names (`head.margin=cosface optim.lr=0.05`);
their values are parsed as YAML scalars (`loader`; `convert` turns the mapping into the
dataclasses).

Unknown keys, wrong types and bad combinations raise `ConfigError` with the dotted key.
Derived quantities (total steps, warmup steps) are computed where they are used and never
written back here, so the saved `config.yaml` is exactly what the user asked for.
"""

from recognition.config.augment import PRESET_NAMES, PRESETS, AugmentConfig, blur_kernel_size
from recognition.config.data import DataConfig
from recognition.config.eval import EVAL_METRICS, EvalConfig, EvalTarget, parse_metric
from recognition.config.experiment import ExperimentConfig, check_fused_update, check_pipeline
from recognition.config.head import MARGIN_KEYS, HeadConfig
from recognition.config.loader import (
    CONFIG_DIR,
    FOLLOWERS,
    config_from_dict,
    config_to_dict,
    load_config,
    load_config_sources,
    resolve_config_path,
    save_config,
)
from recognition.config.model import ModelConfig
from recognition.config.optim import OptimConfig
from recognition.config.synthetic import GENERATOR_VERSION, SyntheticConfig, SyntheticSpec
from recognition.config.train import PrecisionConfig, TrainConfig
from recognition.config.values import (
    MIN_IMAGE_SIDE,
    ConfigError,
    check_counts,
    check_image_size,
    image_size_pair,
    parse_image_size,
)

__all__ = [
    "CONFIG_DIR",
    "PRESETS",
    "PRESET_NAMES",
    "AugmentConfig",
    "EVAL_METRICS",
    "FOLLOWERS",
    "GENERATOR_VERSION",
    "MARGIN_KEYS",
    "MIN_IMAGE_SIDE",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "EvalTarget",
    "ExperimentConfig",
    "HeadConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "SyntheticConfig",
    "SyntheticSpec",
    "TrainConfig",
    "blur_kernel_size",
    "check_counts",
    "check_fused_update",
    "check_image_size",
    "check_pipeline",
    "config_from_dict",
    "config_to_dict",
    "image_size_pair",
    "load_config",
    "load_config_sources",
    "parse_image_size",
    "parse_metric",
    "resolve_config_path",
    "save_config",
]
