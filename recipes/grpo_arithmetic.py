"""GRPO on 2-digit addition after a short SFT warm-up: the main job (see README).

python recipes/grpo_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
