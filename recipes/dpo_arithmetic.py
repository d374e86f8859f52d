"""DPO on preference pairs of 2-digit addition (correct answer chosen, a wrong one rejected).

python recipes/dpo_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
