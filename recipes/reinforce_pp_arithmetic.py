"""REINFORCE++: batch-whitened discounted returns with the KL penalty in the reward, no critic.

python recipes/reinforce_pp_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
