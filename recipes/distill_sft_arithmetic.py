"""The baseline of ``distill_arithmetic``: SFT of the same student on its teacher's samples
(sequence-level knowledge distillation), with the same budget of steps and sequences per step.

The teacher and the student's start are ``distill_arithmetic``'s (trained first as
``distill_arithmetic.py`` does when they are missing). The teacher samples responses to
the training prompts at the rollout's temperature (``SAMPLES_PER_PROMPT`` each at most; the same
samples as a distillation run of the same seed mixes in); the student trains on those (prompt,
response) pairs with the distillation run's optimizer, steps and sequences per step, and is scored on
the same held-out problems.

python recipes/distill_sft_arithmetic.py [recipes/other.yaml] [key=value ...]   (overrides of distill_arithmetic.yaml)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from distill_arithmetic import RECIPE, ensure_models, teacher_sample_data

from rlflow.trainer import FitResult, load_config, run_recipe
from rlflow.trainer.recipe import recipe_args


def main(argv: Sequence[str] | None = None) -> FitResult:
    """Samples the teacher, then trains the student of ``distill_arithmetic.yaml`` by SFT on the samples
    (both trained first where missing, as ``distill_arithmetic.py`` does)."""
    source, overrides = recipe_args(RECIPE, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_models(cfg)
    rows_per_step = cfg.data.batch_size * cfg.algorithm.n_samples
    data = teacher_sample_data(cfg, Path(cfg.run_dir).with_name(f"{cfg.experiment_name}_sft_data"), rows_per_step)
    sft = [
        "algorithm.name=sft",
        "algorithm.distill_loss=sampled",  # SFT reads no teacher: its distillation settings go
        "algorithm.distill_divergence=reverse",
        "algorithm.distill_jsd_beta=0.5",
        "algorithm.distill_student_fraction=1",
        f"experiment_name={cfg.experiment_name}_sft",
        f"data.batch_size={rows_per_step}",
        *data,
    ]
    return run_recipe(source, [*overrides, *sft])


if __name__ == "__main__":
    main()
