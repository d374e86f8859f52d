"""GRPO ``fit()`` with vLLM rollouts on a CPU worker learns the main job's task (2-digit addition,
``recipes/grpo_arithmetic.yaml`` shrunk to fit ``make test-vllm``): a short supervised warm-up
reaches a partly right model, then every GRPO step pushes the trained weights into vLLM's
parameters through the reshard executor and samples the next batch with vLLM."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 20
# The trainer in float32, as vLLM runs on CPU: the recompute then measures vLLM's log-probs to 1e-3.
OVERRIDES = [
    "rollout.engine=vllm", "models.actor.dtype=float32", "placement.devices_per_node=1", "placement.profile=false",
    f"trainer.total_steps={STEPS}", f"trainer.eval_every={STEPS // 2}", "trainer.max_wall_seconds=null",
    "checkpoint.every_n_steps=0", "checkpoint.save_final=false", "data.eval_size=200",
    "warmup.target_score=0.3", "warmup.eval_every=25",
    "logging.console=false", "logging.tensorboard=false",
]  # fmt: skip


def _fit(overrides: list[str], tmp_path):
    """``fit()`` of the main recipe with ``overrides``; its result and every metrics record."""
    from rlflow.trainer import Trainer, load_config

    cfg = load_config(REPO / "recipes" / "grpo_arithmetic.yaml", [*overrides, f"logging.dir={tmp_path}"])
    trainer = Trainer(cfg, progress_bars=False)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    return result, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_vllm_rollouts_learns_the_main_task(ray_session, tmp_path, capsys):
    start = time.time()
    result, records = _fit(OVERRIDES, tmp_path)
    steps = [r for r in records if "actor_train/approx_kl" in r]
    scores = [(r["step"], r["eval/score"]) for r in records if "eval/score" in r]
    rewards = [r["reward_inf/score_mean"] for r in steps]
    mismatch = [r["actor_inf/logp_mismatch_max"] for r in steps]
    with capsys.disabled():  # the learning figures, in make test-vllm's output
        print(
            f"\nwall {time.time() - start:.0f} s; held-out {[(step, round(s, 3)) for step, s in scores]}; reward per step "
            f"{[round(x, 3) for x in rewards]}; max |vLLM - trainer log-prob| per step <= {max(mismatch):.2e}"
        )
    assert result.steps == STEPS and [r["step"] for r in steps] == list(range(1, STEPS + 1))
    evaluated = {step for step, _ in scores}
    for record in steps:
        # Every step's trained weights were pushed into vLLM: before the next rollout, or before
        # the evaluation that follows the step (step 0: the warm-up's last), whose copy the
        # rollout then finds current.
        pushed = "realloc/actor_gen/bytes_intra_host" in record
        assert pushed != (record["step"] - 1 in evaluated), record["step"]
        # vLLM's log-probs of its samples are the trainer's (the recompute call measures them, fp32
        # on both sides): a stale or dummy policy would be orders of magnitude off.
        assert record["actor_inf/logp_mismatch_max"] < 1e-3
        assert record["actor_train/approx_kl"] < 1e-3
    first = [s for step, s in scores if step == 0][-1]  # after the warm-up (its evaluations come first)
    last = [s for step, s in scores if step == STEPS][-1]
    assert 0.2 < first < 0.9
    # Held-out greedy accuracy on 200 problems (the sampled reward per step is printed, not
    # asserted: 256 samples a step move it less than its noise in 20 steps).
    assert last >= first + 0.05, scores


TP2 = [
    "rollout.engine=vllm", "models.actor.dtype=float32", "placement.devices_per_node=2", "placement.mode=manual",
    "placement.manual.actor_gen.mesh.num_devices=2", "placement.manual.actor_gen.strategy.tp=2",
    "placement.manual.actor_train.mesh.num_devices=2", "placement.manual.actor_train.strategy.dp=2",
    "placement.manual.actor_inf.mesh.num_devices=2", "placement.manual.actor_inf.strategy.dp=2",
    "trainer.total_steps=3", "trainer.eval_every=0", "trainer.eval_before_train=false", "warmup.steps=0",
    "checkpoint.every_n_steps=0", "checkpoint.save_final=false", "data.eval_size=8", "logging.console=false",
    "logging.tensorboard=false",
]  # fmt: skip


def test_grpo_with_vllm_tp2_across_two_cpu_workers(ray_session, tmp_path):
    """The rollout runs vLLM with tp = 2 over both Ray workers (training: dp = 2), each step's
    weights pushed from the FSDP home into each worker's half of vLLM's parameters."""
    result, records = _fit(TP2, tmp_path)
    steps = [r for r in records if "actor_train/approx_kl" in r]
    assert result.steps == 3 and len(steps) == 3
    for record in steps:
        assert record["realloc/actor_gen/bytes_intra_host"] > 0  # pushed between the two workers
        assert record["actor_inf/logp_mismatch_max"] < 1e-4
