"""GRPO with a calculator tool on 3-digit multiplication, after an SFT warm-up on tool-use traces.

python recipes/grpo_tools_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from pathlib import Path

from rlflow.trainer import run_recipe

if __name__ == "__main__":
    run_recipe(Path(__file__).with_suffix(".yaml"))
