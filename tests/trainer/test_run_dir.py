"""A run directory that already holds an earlier run: refused, replaced, kept apart, or resumed only
with the models it was trained with; the models a run builds follow its config (seed and shape)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_fit import DRIVER_FIT, GRPO, TINY_ACTOR

from rlflow.trainer import ConfigError, Trainer, load_config
from rlflow.trainer.build import materialize_models, materialize_tokenizer

TINY = [*TINY_ACTOR, *DRIVER_FIT, "trainer.total_steps=1"]


def fit(run_dir: Path, *overrides: str) -> Trainer:
    with Trainer(GRPO, overrides=[*TINY, f"logging.dir={run_dir}", *overrides], progress_bars=False) as trainer:
        trainer.fit()
    return trainer


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if any(k.startswith("actor_train/") for k in r)]


def actor_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "models" / "actor" / "model.safetensors")


def test_a_second_run_in_the_same_directory_is_refused_before_any_work(tmp_path):
    # It used to train the first run's initial model and append its steps to the first run's metrics.
    fit(tmp_path / "run")
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds an earlier run \(metrics.jsonl, .*step_1.*\)") as err:
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'run'}", "seed=1"], progress_bars=False)
    assert err.value.key == "logging.dir"
    assert "checkpoint.resume=auto" in str(err.value) and "logging.if_exists=replace" in str(err.value)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing touched
    named = load_config(GRPO, [*TINY, "experiment_name=x"])
    assert named.logging.if_exists == "refuse"


def test_replace_trains_the_new_seed_and_logs_only_the_new_run(tmp_path):
    run = tmp_path / "run"
    fit(run)
    first = actor_weights(run)
    fit(run, "seed=1", "logging.if_exists=replace")
    second = actor_weights(run)
    assert any(not torch.equal(first[k], second[k]) for k in first)  # the new seed's initial model
    assert steps_logged(run) == [1]  # not [1, 1]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_1"]


def test_new_takes_a_directory_beside_the_earlier_run(tmp_path):
    run = tmp_path / "run"
    fit(run)
    before = (run / "metrics.jsonl").read_text()
    trainer = fit(run, "logging.if_exists=new", "models.actor.hidden_size=64")
    assert trainer.run_dir == tmp_path / "run-2"
    assert (run / "metrics.jsonl").read_text() == before
    assert steps_logged(tmp_path / "run-2") == [1]
    assert actor_weights(tmp_path / "run-2")["model.embed_tokens.weight"].shape[1] == 64


def test_a_resume_with_another_model_shape_names_the_field(tmp_path):
    run = tmp_path / "run"
    fit(run)
    with pytest.raises(ConfigError, match=r"hidden_size: 32 there, 64 here") as err:
        Trainer(
            GRPO,
            overrides=[*TINY, f"logging.dir={run}", "checkpoint.resume=auto", "models.actor.hidden_size=64"],
            progress_bars=False,
        )
    assert err.value.key == "models.actor.hidden_size"
    # The same shape resumes.
    with Trainer(
        GRPO, overrides=[*TINY, f"logging.dir={run}", "checkpoint.resume=auto", "trainer.total_steps=2"],
        progress_bars=False,
    ) as trainer:  # fmt: skip
        assert trainer.fit().steps == 2
    assert steps_logged(run) == [1, 2]


def test_the_models_a_run_builds_follow_its_seed_and_shape(tmp_path):
    def built(*overrides: str) -> dict[str, torch.Tensor]:
        cfg = load_config(GRPO, [*TINY, f"logging.dir={tmp_path}", *overrides])
        materialize_models(cfg, tmp_path, materialize_tokenizer(cfg, tmp_path))
        return actor_weights(tmp_path)

    first = built()
    stamp = (tmp_path / "models" / "actor" / "model.safetensors").stat().st_mtime_ns
    assert all(torch.equal(first[k], v) for k, v in built().items())
    assert (tmp_path / "models" / "actor" / "model.safetensors").stat().st_mtime_ns == stamp  # kept, not rebuilt
    assert any(not torch.equal(first[k], v) for k, v in built("seed=3").items())
    assert built("models.actor.hidden_size=64")["model.embed_tokens.weight"].shape[1] == 64


def test_resume_auto_starts_over_a_run_that_died_before_its_first_checkpoint(tmp_path):
    run = tmp_path / "run"
    fit(run)
    shutil.rmtree(run / "checkpoints")  # as a run killed before its first checkpoint completed leaves it
    shutil.rmtree(run / "final")
    with pytest.raises(ConfigError, match="already holds an earlier run") as err:
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={run}"], progress_bars=False)
    assert "checkpoint.resume=auto" not in str(err.value)  # nothing there to resume
    trainer = fit(run, "checkpoint.resume=auto")
    assert trainer.run_dir == run
    assert steps_logged(run) == [1]  # its steps once, not after the dead attempt's
