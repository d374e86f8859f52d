"""Reward-model training (Bradley-Terry) on preference pairs of 2-digit addition.

python recipes/rm_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
