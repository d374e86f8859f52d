"""Supervised fine-tuning of a tiny Llama on 2-digit addition; the policy is exported to ``<run dir>/actor``.

The export is an HF directory that other recipes start from (``init: path``): the reward model
of ``rm_arithmetic.yaml`` warm-starts from it.

python recipes/sft_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from stages import run_and_export

RECIPE = Path(__file__).with_suffix(".yaml")


def train_sft(argv: Sequence[str] = (), export_to: str | Path | None = None) -> Path:
    """Runs the recipe with ``argv`` and exports the trained actor to ``export_to`` (default ``<run dir>/actor``)."""
    return run_and_export(RECIPE, argv, "actor", export_to)[2]


if __name__ == "__main__":
    train_sft(sys.argv[1:])
