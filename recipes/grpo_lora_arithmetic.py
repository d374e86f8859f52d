"""GRPO with LoRA on 2-digit addition: the adapters train, the SFT-warmed base stays frozen.

The base (``models.actor.path``) is the export of a 350-step ``sft_arithmetic`` run, which this
script trains first when that directory holds no model.

python recipes/grpo_lora_arithmetic.py [recipes/other.yaml] [key=value ...]
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
# The main recipe's warm-up as a run of its own, as long as it runs at seed 0 (docs/benchmarks.md, "Recipes").
SFT_WARMUP = ["experiment_name=sft_warmup_arithmetic", "trainer.total_steps=350", "trainer.eval_every=50"]


def main(argv: Sequence[str] | None = None, sft_argv: Sequence[str] = ()) -> FitResult:
    """Trains the base if ``models.actor.path`` holds none, then GRPO on its LoRA adapters.

    Args:
        argv: the recipe's command line (default ``sys.argv[1:]``): an optional YAML, then
            ``key=value`` overrides.
        sft_argv: overrides of ``sft_arithmetic`` (after :data:`SFT_WARMUP`) when the base has to be trained.
    """
    source, overrides = recipe_args(RECIPE, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_model(cfg, "actor", lambda args, path: train_sft(args, path), [*SFT_WARMUP, *sft_argv])
    return run_recipe(source, overrides)


if __name__ == "__main__":
    main()
