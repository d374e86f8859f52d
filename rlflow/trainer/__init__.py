"""The driver: config → dataflow graph → plan → workers → ``Trainer.fit()``."""

from rlflow.trainer.config import ConfigError, RLFlowConfig, load_config, parse_cli
from rlflow.trainer.recipe import run_recipe
from rlflow.trainer.trainer import FitResult, Trainer

__all__ = ["ConfigError", "FitResult", "RLFlowConfig", "Trainer", "load_config", "parse_cli", "run_recipe"]
