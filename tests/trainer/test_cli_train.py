"""``rlflow train <recipe.yaml> [key=value ...]``: the console script trains a recipe; bad input exits 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_helpers import TINY

from rlflow.cli import main
from rlflow.planner.plan import ExecutionPlan

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"


def rlflow_command() -> list[str]:
    """The installed console script of this interpreter's environment, else ``python -m rlflow.cli``."""
    script = Path(sys.executable).with_name("rlflow")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rlflow.cli"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rlflow_train_runs_a_recipe_on_a_searched_plan(ray_session, tmp_path):
    # The run joins this session's Ray cluster (placement.ray_address) instead of starting one.
    address = ray_session.get_runtime_context().gcs_address
    argv = [*rlflow_command(), "train", str(GRPO), *TINY, f"placement.ray_address={address}", f"logging.dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    score = (
        rf"held-out score of grpo_arithmetic: before \d+\.\d% -> after \d+\.\d% \(1 steps; run directory {tmp_path}\)"
    )
    assert re.search(score, proc.stdout), proc.stdout[-3000:]
    assert "sft warm-up: 1 steps" in proc.stdout
    assert ExecutionPlan.load(tmp_path / "plan.json").name == "search"  # the recipe's placement.mode: auto
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["step"] == 1 and "actor_train/loss" in r for r in records)
    assert (tmp_path / "checkpoints" / "step_1" / "actor" / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["recipes/no_such_recipe.yaml"], "recipe 'recipes/no_such_recipe.yaml': expected an existing YAML file"),
        ([str(GRPO), "trainer.total_steps"], "'trainer.total_steps' is not an override; expected key=value"),
        (
            [str(GRPO), "trainer.total_stepz=3"],
            "bad config: trainer.total_stepz: unknown key; valid keys here: ['total_steps'",
        ),
        (
            [str(GRPO), "rollout.engine=sglang"],
            "bad config: rollout.engine: 'sglang' is not allowed; expected one of ['hf', 'vllm']",
        ),
    ],
)
def test_rlflow_train_rejects_bad_input_with_exit_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_rlflow_help_lists_train():
    out = subprocess.run([*rlflow_command(), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "train" in out and "a recipe (YAML) with key=value overrides" in out
