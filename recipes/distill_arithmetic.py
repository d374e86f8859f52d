"""On-policy distillation of the SFT policy of ``sft_arithmetic`` into a smaller student on 2-digit addition.

The teacher (``models.teacher``) is the export of ``sft_arithmetic``, which this script trains
first when ``models.teacher.path`` holds no model; after its SFT warm-up the student learns from the
teacher's per-token log-probs of its own samples alone (``algorithm.name: distill``).

python recipes/distill_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from sft_arithmetic import train_sft
from stages import ensure_model

from rlflow.trainer import FitResult, load_config, run_recipe
from rlflow.trainer.recipe import recipe_args

RECIPE = Path(__file__).with_suffix(".yaml")


def main(argv: Sequence[str] | None = None, sft_argv: Sequence[str] = ()) -> FitResult:
    """Trains the teacher if ``models.teacher.path`` holds none, then distils it into the student.

    Args:
        argv: the recipe's command line (default ``sys.argv[1:]``): an optional YAML, then
            ``key=value`` overrides.
        sft_argv: overrides of ``sft_arithmetic`` when the teacher has to be trained first.
    """
    source, overrides = recipe_args(RECIPE, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_model(cfg, "teacher", lambda args, path: train_sft(args, path), sft_argv)
    return run_recipe(source, overrides)


if __name__ == "__main__":
    main()
