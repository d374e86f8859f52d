"""``rlflow --version``, ``rlflow train`` without a recipe, and ``rlflow train --print-config``."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import yaml

from rlflow.cli import main
from rlflow.trainer.config import load_config

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlflow {importlib.metadata.version('rlflow')}"


def test_print_config_prints_the_resolved_config_and_trains_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run would write runs/ here
    assert main(["train", str(GRPO), "trainer.total_steps=3", "algorithm.n_samples=4", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["total_steps"] == 3 and printed["algorithm"]["n_samples"] == 4
    assert printed["experiment_name"] == "grpo_arithmetic"  # the recipe's
    assert printed["data"]["task"] == "arithmetic"  # resolved from "auto"
    assert load_config(printed) == load_config(GRPO, ["trainer.total_steps=3", "algorithm.n_samples=4"])
    assert not (tmp_path / "runs").exists()


def test_print_config_without_a_recipe_prints_the_defaults_with_the_overrides(capsys):
    assert main(["train", "trainer.total_steps=2", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert load_config(printed) == load_config(None, ["trainer.total_steps=2"])
    assert printed["experiment_name"] == "rlflow"


def test_print_config_validates(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "algorithm.n_samples=1", "--print-config"])
    assert info.value.code == 2
    assert "bad config: algorithm.n_samples: 1; the grpo estimator needs >= 2" in capsys.readouterr().err


def test_train_without_a_recipe_trains_the_defaults_with_the_overrides(tmp_path):
    overrides = [
        "trainer.total_steps=1",
        "trainer.eval_every=0",
        "trainer.eval_before_train=false",
        "algorithm.n_samples=2",
        "data.batch_size=2",
        "data.eval_size=2",
        "models.actor.hidden_size=32",
        "models.actor.intermediate_size=64",
        "models.actor.num_layers=1",
        "placement.worker_host=driver",
        "placement.mode=heuristic",
        "placement.profile=false",
        "logging.tensorboard=false",
        f"logging.dir={tmp_path}",
    ]
    assert main(["train", *overrides]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 1 in steps
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["models"]["actor"]["hidden_size"] == 32
