"""What every recipe in ``recipes/`` does: load its YAML with command-line overrides, train, report."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from rlflow.trainer.trainer import FitResult, Trainer

logger = logging.getLogger(__name__)


def recipe_args(default_yaml: str | Path, argv: Sequence[str]) -> tuple[str | Path, list[str]]:
    """``(recipe YAML, overrides)`` of a recipe's command line.

    A first argument without ``=`` is the recipe's YAML (replacing ``default_yaml``); every
    other argument is a ``key=value`` override, whatever its value ends with.

    >>> recipe_args("grpo.yaml", ["data.train_file=train.yaml"])
    ('grpo.yaml', ['data.train_file=train.yaml'])
    >>> recipe_args("grpo.yaml", ["mine.yaml", "seed=1"])
    ('mine.yaml', ['seed=1'])
    """
    args = list(argv)
    source = args.pop(0) if args and "=" not in args[0] else default_yaml
    return source, args


def run_recipe(default_yaml: str | Path, argv: Sequence[str] | None = None) -> FitResult:
    """Trains the recipe ``default_yaml`` with ``key=value`` overrides from ``argv``.

    A first argument without ``=`` replaces the recipe's YAML (:func:`recipe_args`). Logs the
    held-out score before RL (after the warm-up, if any) and after training.

    >>> run_recipe("recipes/grpo_arithmetic.yaml", ["trainer.total_steps=5"])  # doctest: +SKIP
    """
    source, overrides = recipe_args(default_yaml, sys.argv[1:] if argv is None else argv)
    trainer = Trainer(source, overrides=overrides)  # a path: Ray starts while the config is checked
    cfg = trainer.cfg
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    if result.score_before is not None and result.score_after is not None:
        logger.info(
            f"held-out score of {cfg.experiment_name}: before {result.score_before:.1%} -> "
            f"after {result.score_after:.1%} ({result.steps} steps; run directory {result.run_dir})"
        )
    return result
