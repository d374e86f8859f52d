"""The driver: config → dataflow graph → plan → workers → ``Trainer.fit()``.

Its names load on first use (PEP 562), so ``from rlflow.trainer import Trainer`` stays light and
``Trainer(...)`` can begin a local Ray before the heavy imports (:mod:`rlflow.trainer.local_ray`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlflow.trainer.config import ConfigError, RLFlowConfig, load_config, parse_cli
    from rlflow.trainer.recipe import run_recipe
    from rlflow.trainer.trainer import FitResult, Trainer

_EXPORTS = {
    "ConfigError": "rlflow.trainer.config",
    "RLFlowConfig": "rlflow.trainer.config",
    "load_config": "rlflow.trainer.config",
    "parse_cli": "rlflow.trainer.config",
    "run_recipe": "rlflow.trainer.recipe",
    "FitResult": "rlflow.trainer.trainer",
    "Trainer": "rlflow.trainer.trainer",
}

__all__ = ["ConfigError", "FitResult", "RLFlowConfig", "Trainer", "load_config", "parse_cli", "run_recipe"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlflow.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
