"""PPO with a critic (GAE) and a KL penalty in the reward, on 2-digit addition.

python recipes/ppo_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
