"""Resuming: 2 steps, then ``checkpoint.resume=auto`` up to 4, equals 4 steps in one go.

Both runs evaluate and checkpoint every 2 steps on the resharding plan of the end-to-end test
(FSDP training, tensor-parallel rollouts, a data-parallel reference), after a short SFT
warm-up. For the metrics of steps 3 and 4 to match, a checkpoint must carry everything that
decides them: the actor's weights and AdamW moments, the reference (a copy of the actor taken
when RL started, after the warm-up — ``init: copy``), the data loader's position, the rollout
counter that seeds sampling, the RNG states, and the evaluation history. A resumed run must
not copy the actor into the reference again: the reference would become the trained actor
and the KL penalty would change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlflow.trainer import Trainer, load_config
from rlflow.workers.model_worker import FROZEN_WEIGHTS

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"
M = "placement.manual"
CONFIG = [
    "data.batch_size=4",
    "data.eval_size=8",
    "algorithm.n_samples=4",
    "algorithm.entropy_coef=0.1",  # rewards are 0 this early; the entropy bonus moves the weights
    "models.actor.lr=1e-2",
    "models.actor.hidden_size=64",
    "models.actor.intermediate_size=128",
    "models.actor.num_layers=2",
    "models.actor.num_heads=4",
    "models.actor.num_kv_heads=2",
    "models.ref.init=copy",
    "models.ref.init_from=actor",
    "algorithm.kl_coef=0.05",  # GRPO's KL loss against the reference
    "warmup.steps=2",
    "warmup.batch_size=16",
    "trainer.eval_every=2",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=0",
    "placement.mode=manual",
    "placement.devices_per_node=2",
    f"{M}.actor_train.mesh.num_devices=2",
    f"{M}.actor_train.strategy.dp=2",
    f"{M}.actor_gen.mesh.num_devices=2",
    f"{M}.actor_gen.strategy.tp=2",
    f"{M}.ref_inf.mesh.num_devices=2",
    f"{M}.ref_inf.strategy.dp=2",
    "logging.console=false",
    "logging.tensorboard=false",
]
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

# Wall-clock and memory figures differ between any two runs; everything else must not.
UNCOMPARED = ("time", "time_s", "peak_memory_bytes")


def run(run_dir: Path, *overrides: str):
    trainer = Trainer(load_config(GRPO, [*CONFIG, f"logging.dir={run_dir}", *overrides]), progress_bars=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def last_record_per_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """Training-step metrics by step; a resumed run appends to the same metrics.jsonl."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(k.startswith("actor_train/") for k in record):
            out.setdefault(record["step"], {}).update(record)
    return out


def comparable(record: dict[str, float]) -> dict[str, float]:
    """Without timings, memory, and the bytes reallocations moved: a resumed run rebuilds the copies
    that the whole run kept current."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(("time/", "realloc/")) and k.rsplit("/", 1)[-1] not in UNCOMPARED
    }


def test_two_steps_plus_a_resumed_run_equal_four_steps(ray_session, tmp_path, caplog):
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole_result = run(whole, "trainer.total_steps=4")
    caplog.clear()

    first = run(split, "trainer.total_steps=2")
    assert first.steps == 2 and "sft warm-up: 2 steps" in caplog.text
    caplog.clear()
    second = run(split, "trainer.total_steps=4", "checkpoint.resume=auto")
    out = caplog.text
    assert f"resumed from {split / 'checkpoints' / 'step_2'} at step 2" in out
    assert "sft warm-up" not in out  # the warm-up belongs to the first part only

    assert second.steps == whole_result.steps == 4
    assert second.eval_history == whole_result.eval_history
    assert [s for s, _ in second.eval_history] == [0, 0, 2, 4]  # before warm-up, after it, every 2 steps

    expected, got = last_record_per_step(whole), last_record_per_step(split)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in (3, 4):
        want = comparable(expected[step])
        assert {"actor_train/loss", "actor_train/kl_loss", "reward_inf/score_mean", "actor_gen/tokens"} <= set(want)
        assert comparable(got[step]) == pytest.approx(want, rel=1e-6, abs=1e-9), f"step {step}"
    assert expected[4]["actor_train/entropy"] != expected[3]["actor_train/entropy"]  # the steps did differ

    # The same weights at the end, exported by both runs.
    for model in ("actor", "ref"):
        a, b = checkpoint_weights(whole, 4, model), checkpoint_weights(split, 4, model)
        assert sorted(a) == sorted(b) and max_diff(a, b) <= 1e-6, model
    # The resumed run kept the reference of its checkpoint rather than copying the actor of
    # step 2 again; that reference is the actor after the warm-up, not the initial model.
    ref = checkpoint_weights(split, 2, "ref")
    assert max_diff(checkpoint_weights(split, 4, "ref"), ref) == 0.0
    assert max_diff(checkpoint_weights(split, 2, "actor"), ref) > 1e-4
    assert max_diff(load_file(split / "models" / "actor" / "model.safetensors"), ref) > 1e-3


def checkpoint_weights(run_dir: Path, step: int, model: str) -> dict:
    """A model's weights in a checkpoint: the HF export of the actor, the frozen reference's file."""
    directory = run_dir / "checkpoints" / f"step_{step}" / model
    return load_file(directory / FROZEN_WEIGHTS if model == "ref" else directory / "hf" / "model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)
