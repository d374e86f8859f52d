"""PPO with an EMA reference: the reference policy follows the actor by a moving average.

python recipes/ppo_ema_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
