"""Every registered algorithm runs ``Trainer(cfg).fit()`` from its recipe, shrunk to two steps.

One CPU worker, the heuristic placement, a 2-layer 64-wide model, no warm-up: a run costs one
worker process and a few seconds of compute. Each run must train every model its graph trains
(finite losses and gradient norms logged for every train call, exported weights that differ
from the initial ones) and, for algorithms that sample, log rollout scores. Learning itself is
measured by running the recipes (docs/benchmarks.md, section "Recipes").
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from recipe_helpers import PPO_FROM_GRPO, QUICK_FIT, TINY_ACTOR
from safetensors.torch import load_file

from rlflow.dataflow import get_algorithm, list_algorithms
from rlflow.trainer import Trainer, load_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STEPS = 2
TINY_MODEL = ["hidden_size=64", "intermediate_size=128", "num_layers=2", "num_heads=4", "num_kv_heads=2"]
COMMON = [f"trainer.total_steps={STEPS}", *QUICK_FIT, "checkpoint.save_final=true", "checkpoint.save_hf=true"]
ACTOR = TINY_ACTOR
TINY_TEACHER = ["models.teacher.init=tiny", *(f"models.teacher.{o}" for o in TINY_MODEL)]

# recipe, overrides on top of COMMON. An untrained model scores 0 on every response, so the
# critic-free estimators give zero advantages; their entropy bonus moves the weights all the same.
# PPO's own recipe scores with a reward model that other
# recipes train first; here PPO runs on the GRPO recipe with the task's rule as reward.
RUNS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo", [*ACTOR, "algorithm.n_samples=2", "algorithm.entropy_coef=0.1"]),
    "rloo": ("rloo", [*ACTOR, "algorithm.n_samples=2", "algorithm.entropy_coef=0.1"]),
    "remax": ("remax", [*ACTOR, "algorithm.n_samples=2", "algorithm.entropy_coef=0.1"]),
    "reinforce_pp": ("reinforce_pp", [*ACTOR, "algorithm.n_samples=2", "algorithm.entropy_coef=0.1"]),
    "ppo": ("grpo", [*ACTOR, *PPO_FROM_GRPO]),
    "ppo_ema": ("ppo_ema", [*ACTOR, "algorithm.ema_eta=0.5"]),
    "distill": ("grpo", [*ACTOR, "algorithm.name=distill", "algorithm.n_samples=2", *TINY_TEACHER]),
    "dpo": ("dpo", ACTOR),
    "sft": ("sft", ACTOR),
    "rm": ("rm", ["models.reward.init=tiny", "models.reward.path=null", *(f"models.reward.{o}" for o in TINY_MODEL)]),
}


def test_every_registered_algorithm_has_a_fit_run_here():
    assert sorted(RUNS) == list_algorithms()


def _max_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    assert sorted(before) == sorted(after)
    assert all(torch.isfinite(t).all() for t in after.values())
    return max(float((after[k].float() - before[k].float()).abs().max()) for k in before)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_fit_trains_every_model_of_the_algorithm(name, ray_session, tmp_path):
    recipe, overrides = RUNS[name]
    cfg = load_config(RECIPES / f"{recipe}_arithmetic.yaml", [*COMMON, *overrides, f"logging.dir={tmp_path}"])
    assert cfg.algorithm.name == name
    trainer = Trainer(cfg, progress_bars=False)
    try:
        result = trainer.fit()
        train_calls = {
            trainer.graph.nodes[n]["mfc"].name: trainer.graph.nodes[n]["mfc"].model_name
            for n in trainer.graph
            if trainer.graph.nodes[n]["mfc"].is_train
        }
    finally:
        trainer.close()

    assert result.steps == STEPS
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if any(k.startswith("time/") for k in r)}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for record in steps.values():
        for call in train_calls:
            assert math.isfinite(record[f"{call}/loss"]) and record[f"{call}/grad_norm"] > 0, call
        if get_algorithm(name).samples_responses and get_algorithm(name).scores_responses:
            assert 0.0 <= record["reward_inf/score_mean"] <= 1.0
    # Every trained model's exported weights moved away from the ones it started from.
    final = tmp_path / "checkpoints" / f"step_{STEPS}"
    for model in set(train_calls.values()):
        before = load_file(tmp_path / "models" / model / "model.safetensors")
        after = load_file(final / model / "hf" / "model.safetensors")
        assert _max_change(before, after) > 1e-6, model
