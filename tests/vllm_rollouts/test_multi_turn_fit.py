"""Multi-turn GRPO ``fit()`` with vLLM rollouts on a CPU worker: each sample is an episode of an
environment whose turns vLLM samples (ending at the environment's stop string), the trained weights
pushed into vLLM before each rollout; the trainer's recompute of the sampled tokens' log-probs over
the whole episode (observations in the context, out of the loss) matches vLLM's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlflow.workers.environments import Step

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "rollout.engine=vllm", "placement.devices_per_node=1", "placement.mode=heuristic", "placement.profile=false",
    # A one-layer actor whose head size (64 / 2) vLLM-CPU's attention runs.
    "models.actor.hidden_size=64", "models.actor.intermediate_size=128", "models.actor.num_layers=1",
    "models.actor.num_heads=2", "models.actor.num_kv_heads=2",
    "data.batch_size=2", "algorithm.n_samples=2", "data.eval_size=2", "warmup.steps=0",
    "trainer.eval_before_train=false", "trainer.eval_every=0", "trainer.total_steps=2",
    "checkpoint.every_n_steps=0", "checkpoint.save_final=false", "logging.console=false", "logging.tensorboard=false",
    "rollout.max_new_tokens=4", "rollout.multi_turn.max_prompt_tokens=16", "rollout.multi_turn.max_total_tokens=24",
    "algorithm.recompute_old_logp=true",
]  # fmt: skip


class Echo:
    """Two turns, each rewarded 0.5; the observation is ``=`` and the turn's length. A turn also ends
    once it writes ``+`` (``stop_strings``: a tool call's closing tag in a real environment)."""

    stop_strings = ("+",)

    def reset(self, row):
        self.turns = 0
        return row["prompt"]

    def step(self, text):
        self.turns += 1
        return Step(f"={len(text)}", 0.5, self.turns >= 2)

    def metrics(self):
        return {"echo/turns": float(self.turns)}


def test_multi_turn_grpo_with_vllm_rollouts(ray_session, tmp_path):
    from rlflow.trainer import Trainer

    overrides = [*OVERRIDES, f"logging.dir={tmp_path}"]
    with Trainer(REPO / "recipes" / "grpo_arithmetic.yaml", overrides=overrides, environment=Echo) as trainer:
        result = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor_train/pg_loss" in r]
    assert result.steps == 2 and len(steps) == 2
    for metrics in steps:
        assert metrics["actor_gen/multi_turn/turns"] == 2.0 and metrics["actor_gen/echo/turns"] == 2.0
        assert 0.0 < metrics["actor_gen/multi_turn/observation_share"] < 1.0
        assert metrics["actor_gen/multi_turn/env_reward"] == 1.0
        assert metrics["actor_gen/old_logp_filtered"] == 0.0  # vLLM sampled them (the hf engine reports no such flag)
        assert math.isfinite(metrics["actor_train/pg_loss"])
        # vLLM's log-probs of its sampled tokens are the trainer's over the same episode tokens.
        assert metrics["actor_inf/logp_mismatch_max"] < 1e-3
