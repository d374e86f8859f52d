"""PPO with a critic (GAE), a learned reward model and a KL penalty in the reward, on 2-digit addition.

The rollouts are scored by the reward model of ``rm_arithmetic`` (``models.reward``), which this
script trains first, with the SFT policy it starts from, when its export is missing. Held-out
accuracy is still the task's exact-match rule: the learned reward steers training, the rule
measures it.

python recipes/ppo_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rm_arithmetic import train_reward_model
from stages import ensure_model

from rlflow.trainer import FitResult, load_config, run_recipe
from rlflow.trainer.recipe import recipe_args

RECIPE = Path(__file__).with_suffix(".yaml")


def main(argv: Sequence[str] | None = None, rm_argv: Sequence[str] = (), sft_argv: Sequence[str] = ()) -> FitResult:
    """Trains the reward model if ``models.reward.path`` holds none, then PPO.

    Args:
        argv: the recipe's command line (default ``sys.argv[1:]``): an optional YAML, then
            ``key=value`` overrides.
        rm_argv: overrides of ``rm_arithmetic`` when it has to run first.
        sft_argv: overrides of ``sft_arithmetic`` when the reward model's start has to be trained too.
    """
    source, overrides = recipe_args(RECIPE, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_model(cfg, "reward", lambda args, path: train_reward_model(args, path, sft_argv), rm_argv)
    return run_recipe(source, overrides)


if __name__ == "__main__":
    main()
