"""What every recipe in ``recipes/`` does: load its YAML with command-line overrides, train, report."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rlflow.trainer.config import load_config
from rlflow.trainer.trainer import FitResult, Trainer


def run_recipe(default_yaml: str | Path, argv: Sequence[str] | None = None) -> FitResult:
    """Trains the recipe ``default_yaml`` with ``key=value`` overrides from ``argv``.

    A first argument ending in ``.yaml`` replaces the recipe's YAML. Prints the held-out score
    before RL (after the warm-up, if any) and after training.

    >>> run_recipe("recipes/grpo_arithmetic.yaml", ["trainer.total_steps=5"])  # doctest: +SKIP
    """
    args = list(sys.argv[1:] if argv is None else argv)
    source = args.pop(0) if args and args[0].endswith((".yaml", ".yml")) else default_yaml
    cfg = load_config(source, args)
    trainer = Trainer(cfg)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    if result.score_before is not None and result.score_after is not None:
        print(
            f"held-out score of {cfg.experiment_name}: before {result.score_before:.1%} -> "
            f"after {result.score_after:.1%} ({result.steps} steps; run directory {result.run_dir})"
        )
    return result
