"""RLOO: REINFORCE with a leave-one-out baseline over the samples of each prompt.

python recipes/rloo_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
