"""What the trainer tells the planner: micro-batch budgets and the generation dtype of the engine."""

from __future__ import annotations

from pathlib import Path

from rlflow.trainer.config import load_config
from rlflow.trainer.placement import planning_cluster, planning_workload

GRPO = Path(__file__).parents[2] / "recipes" / "grpo_arithmetic.yaml"


def test_workload_micro_batches_follow_the_models_token_budget() -> None:
    assert planning_workload(load_config(GRPO)).max_tokens_per_mb is None  # one micro-batch per batch
    cfg = load_config(GRPO, ["models.actor.micro_batch_tokens=256"])
    assert planning_workload(cfg).max_tokens_per_mb == 256


def test_gpu_generation_is_priced_in_the_engines_dtype() -> None:
    hf = planning_cluster(load_config(GRPO), use_gpu=True, profile=None)
    vllm = planning_cluster(load_config(GRPO, ["rollout.engine=vllm"]), use_gpu=True, profile=None)
    assert hf.precision.rollout_bytes == 4  # the HF sampler runs the fp32 copy
    assert vllm.precision.rollout_bytes == 2  # vLLM generates in bf16
