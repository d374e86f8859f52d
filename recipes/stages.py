"""Pipelines of recipes: a recipe whose model starts from another recipe's output trains that one first.

InstructGPT's order on the arithmetic task: ``sft_arithmetic`` trains the policy on reference
answers; ``rm_arithmetic`` starts a reward model from it and trains it on preference pairs;
``ppo_arithmetic`` (whose actor takes its own SFT warm-up steps) scores its rollouts with that
reward model. Each stage's model is exported as an HF directory at the path its consumer's YAML names
(``models.<role>: {init: path, path: ...}``); :func:`ensure_model` runs the producing recipe only
when nothing is there yet, so a second run reuses the first run's models.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from rlflow.trainer import FitResult, RLFlowConfig, load_config, run_recipe
from rlflow.trainer.recipe import recipe_args


def has_model(path: str | Path) -> bool:
    """Whether ``path`` holds an HF model directory (a ``config.json`` and weights)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def run_and_export(
    default_yaml: str | Path, argv: Sequence[str], role: str, export_to: str | Path | None = None
) -> tuple[RLFlowConfig, FitResult, Path]:
    """Runs a recipe and copies the final HF export of its model ``role`` to ``export_to``.

    Args:
        default_yaml: the recipe's YAML; a first element of ``argv`` without ``=`` replaces it.
        argv: ``key=value`` overrides (:func:`rlflow.trainer.recipe.recipe_args`).
        role: the model to export (``actor`` for SFT, ``reward`` for reward modelling).
        export_to: destination directory, replaced if it exists; default ``<run dir>/<role>``.

    Returns:
        ``(config, fit result, export directory)``.

    Raises:
        ValueError: the config does not save a final checkpoint with HF exports.
    """
    source, overrides = recipe_args(default_yaml, argv)
    cfg = load_config(source, overrides)
    if not (cfg.checkpoint.save_final and cfg.checkpoint.save_hf):
        raise ValueError(
            f"{source}: the {role} model is exported from the final checkpoint; keep checkpoint.save_final "
            f"and checkpoint.save_hf true (got {cfg.checkpoint.save_final}, {cfg.checkpoint.save_hf})"
        )
    result = run_recipe(source, overrides)
    run_dir = Path(result.run_dir)
    checkpoints = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    trained = checkpoints / f"step_{result.steps}" / role / "hf"
    target = Path(export_to) if export_to is not None else run_dir / role
    staging = target.with_name(f".{target.name}.tmp")  # copied aside, then renamed: never half a model
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(trained, staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    print(f"{cfg.experiment_name}: {role} model exported to {target}")
    return cfg, result, target


def ensure_model(
    cfg: RLFlowConfig, role: str, train: Callable[[Sequence[str], Path], object], argv: Sequence[str] = ()
) -> None:
    """Trains ``models.<role>`` of ``cfg`` with ``train(argv, path)`` when its ``init: path`` directory is empty.

    ``train`` gets ``argv`` with ``seed=<cfg.seed>`` (and ``data.split_seed`` when ``cfg`` sets it)
    first, so the producing recipe draws the same train/test split of the task as the consumer (its
    training never sees held-out problems).
    """
    model = cfg.models.get(role)
    if model is None or model.init != "path" or has_model(model.path):
        return
    print(f"{cfg.experiment_name}: models.{role}.path {model.path} holds no model yet; training it first")
    args = list(argv)
    head = [args.pop(0)] if args and "=" not in args[0] else []  # the producing recipe's own YAML
    split = [] if cfg.data.split_seed is None else [f"data.split_seed={cfg.data.split_seed}"]
    train([*head, f"seed={cfg.seed}", *split, *args], Path(model.path))
