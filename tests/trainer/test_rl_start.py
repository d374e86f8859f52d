"""The start of RL, end to end on two CPU workers: warm-up until a target, ``init: copy`` models, evaluation.

One PPO run (``whole``: a warm-up, then 2 steps and a final checkpoint) is shared by both
tests; ``test_resume.py`` checks that a resumed run keeps the copies of its checkpoint. The
manual plan gives every model its own home layout — the actor trains with FSDP over both
workers (dp=2), the reference lives tensor-parallel (tp=2), the critic trains as a two-stage
pipeline (pp=2) — so the copies made when RL starts are real reshards between layouts, and the
critic's copy leaves out the actor's LM head. The run's directory is relative to a working
directory the Ray workers do not share (they kept the one Ray started in).

The critic's learning rate is tiny (1e-6), so that its final checkpoint (4 optimizer steps of
at most ~1e-6 each) still shows the weights it started RL with, to within 1e-5.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from recipe_helpers import PPO_FROM_GRPO
from safetensors.torch import load_file

from rlflow.trainer import FitResult, Trainer, load_config
from rlflow.workers.model_worker import FROZEN_WEIGHTS

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"
M = "placement.manual"
CONFIG = [
    *PPO_FROM_GRPO,
    "data.batch_size=8",
    "data.eval_size=8",
    "models.actor.hidden_size=64",
    "models.actor.intermediate_size=128",
    "models.actor.num_layers=2",
    "models.actor.num_heads=4",
    "models.actor.num_kv_heads=2",
    "models.actor.lr=1e-3",
    "models.critic.lr=1e-6",
    "warmup.batch_size=16",
    "warmup.lr=1e-2",  # one warm-up step moves the actor far from its initial weights
    "trainer.total_steps=2",
    "placement.mode=manual",
    "placement.devices_per_node=2",
    *[f"{M}.{mfc}.mesh.num_devices=2" for mfc in ("actor_train", "actor_gen", "ref_inf", "critic_inf", "critic_train")],
    f"{M}.actor_train.strategy.dp=2",
    f"{M}.actor_gen.strategy.tp=2",
    f"{M}.ref_inf.strategy.tp=2",
    f"{M}.critic_inf.strategy.dp=2",
    f"{M}.critic_train.strategy.pp=2",
    "logging.console=false",
    "logging.tensorboard=false",
]
# The shared run: a warm-up of at most 2 steps that stops at the first evaluation reaching its
# target (any score reaches 0), and evaluations after every RL step.
WHOLE = ["warmup.steps=2", "warmup.eval_every=1", "warmup.target_score=0.0", "trainer.eval_every=1"]
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]
UNCOMPARED = ("time", "time_s", "peak_memory_bytes")


def fit(*overrides: str) -> FitResult:
    trainer = Trainer(load_config(GRPO, [*CONFIG, *overrides]), progress_bars=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def whole(ray_session, tmp_path_factory) -> tuple[Path, FitResult]:
    root = tmp_path_factory.mktemp("rl_start")
    free = ray_session.available_resources().get("CPU", 0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        result = fit(*WHOLE, "logging.dir=whole")
    # A closed trainer hands its workers' CPUs back (placement groups removed), so later runs
    # in the same Ray cluster find them. (At least what was free before: an earlier test's
    # placement groups may still have been on their way out when ``free`` was read.)
    deadline = time.time() + 30
    while ray_session.available_resources().get("CPU", 0.0) < free and time.time() < deadline:
        time.sleep(0.2)
    assert ray_session.available_resources().get("CPU", 0.0) >= free
    return root / "whole", result


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Training-step metrics by step, without wall-clock and memory figures or the bytes
    reallocations moved (which depend on the copies a run holds, not on what it trains)."""
    out: dict[int, dict[str, float]] = {}
    for record in records(run_dir):
        if any(k.startswith("actor_train/") for k in record):
            out[record["step"]] = {
                k: v
                for k, v in record.items()
                if k != "time" and not k.startswith(("time/", "realloc/")) and k.rsplit("/", 1)[-1] not in UNCOMPARED
            }
    return out


def weights(run_dir: Path, step: int, model: str) -> dict[str, torch.Tensor]:
    """A model's weights in a checkpoint: the HF export of a trainable one, the frozen reference's file."""
    directory = run_dir / "checkpoints" / f"step_{step}" / model
    return load_file(directory / FROZEN_WEIGHTS if model == "ref" else directory / "hf" / "model.safetensors")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in names)


def test_copies_take_the_warmed_up_actor_when_rl_starts(whole):
    run_dir, result = whole
    assert Path(result.run_dir) == run_dir and run_dir.is_absolute()
    # The warm-up stopped at its first evaluation (the target is reached) and logged it; that
    # evaluation is also the score after the warm-up.
    assert result.warmup_steps == 1 and [s for s, _ in result.warmup_history] == [1]
    assert result.eval_history[:2] == [result.eval_history[0], (0, result.warmup_history[0][1])]
    assert [s for s, _ in result.eval_history] == [0, 0, 1, 2]
    assert any("warmup/eval_score" in r and "warmup/loss" in r for r in records(run_dir))

    # Before the first update the reference is the policy that sampled: their KL is rounding.
    assert abs(step_metrics(run_dir)[1]["actor_train/kl"]) < 1e-5
    initial = load_file(run_dir / "models" / "actor" / "model.safetensors")
    ref = weights(run_dir, 2, "ref")  # the frozen reference's checkpoint holds its copy
    assert sorted(ref) == sorted(initial) and max_diff(ref, initial, initial) > 1e-3  # not the initial actor
    # The critic's backbone is the same warmed-up actor (moved by its tiny learning rate only);
    # its value head is its own, zero-initialised.
    critic = weights(run_dir, 2, "critic")
    backbone = [k for k in critic if not k.startswith("score.")]
    assert sorted(backbone) == sorted(ref)
    assert max_diff(critic, ref, backbone) < 1e-5 < max_diff(critic, initial, backbone)
    assert float(critic["score.weight"].abs().max()) < 1e-5


def test_evaluating_at_other_steps_leaves_training_unchanged(whole, tmp_path):
    """Evaluation rollouts sample from a stream of their own: a run that evaluates only at the
    start and the end trains exactly like one that evaluates during the warm-up and every step."""
    run_dir, _ = whole
    fit("warmup.steps=1", "trainer.eval_every=0", "checkpoint.save_final=false", f"logging.dir={tmp_path}")
    expected, got = step_metrics(run_dir), step_metrics(tmp_path)
    assert sorted(got) == sorted(expected) == [1, 2]
    for step in (1, 2):
        assert {"actor_train/pg_loss", "critic_train/vf_loss", "reward_inf/score_mean"} <= set(expected[step])
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-9), f"step {step}"
