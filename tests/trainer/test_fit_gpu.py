"""Whole runs on one CUDA device with the built-in sampler (no vLLM): GRPO, and PPO with a critic
and a reference model sharing the GPU, through Ray workers, a NCCL process group of one, bf16
compute for the actor (``models.actor.dtype``: its training and its sampler; the critic and the
reference in float32), and a resume from a checkpoint written on the GPU.

Each run is short; what they check is that the GPU path works end to end and that the calls
really ran on the device (their CUDA peak memory is logged), not that they learn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from recipe_helpers import PPO_FROM_GRPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "placement.use_gpu=true", "placement.devices_per_node=1", "trainer.eval_every=0",
    "trainer.eval_before_train=false", "warmup.steps=0", "data.batch_size=4", "data.eval_size=8",
    "algorithm.n_samples=2", "models.actor.hidden_size=64", "models.actor.num_layers=2",
    "models.actor.intermediate_size=128", "models.actor.dtype=bfloat16", "logging.console=false",
    "logging.tensorboard=false",
]  # fmt: skip


def _fit(recipe: str, tmp_path: Path, *overrides: str):
    from rlflow.trainer import Trainer, load_config

    cfg = load_config(REPO / "recipes" / recipe, [*SMALL, f"logging.dir={tmp_path}", *overrides])
    trainer = Trainer(cfg, progress_bars=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _step_records(tmp_path: Path) -> list[dict]:
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "actor_train/approx_kl" in r]


def test_grpo_on_one_gpu_with_the_builtin_sampler(ray_session, tmp_path):
    result = _fit("grpo_arithmetic.yaml", tmp_path, "trainer.total_steps=3", "rollout.engine=hf")
    assert result.steps == 3
    steps = _step_records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        # on-policy: the rollout sampled from the weights being trained
        assert record["actor_train/approx_kl"] < 0.05
        # the calls ran on the GPU: a tiny model's CUDA peak (~70 MiB on an H200), below a worker's RSS
        for call in ("actor_gen", "actor_train"):
            assert 0 < record[f"{call}/peak_memory_bytes"] < 256 * 2**20, call


def test_ppo_with_critic_and_reference_on_one_gpu_resumes(ray_session, tmp_path):
    # PPO on the GRPO recipe with the task's rule as reward (its own recipe needs a trained reward model)
    ppo = [*PPO_FROM_GRPO, "checkpoint.every_n_steps=2", "algorithm.n_samples=1"]
    _fit("grpo_arithmetic.yaml", tmp_path, *ppo, "trainer.total_steps=2")
    second = _fit("grpo_arithmetic.yaml", tmp_path, *ppo, "trainer.total_steps=3", "checkpoint.resume=auto")
    assert second.steps == 3
    steps = _step_records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]  # the resumed run appended step 3
    for call in ("actor_train", "critic_train", "ref_inf"):
        assert 0 < steps[-1][f"{call}/peak_memory_bytes"] < 256 * 2**20, call
