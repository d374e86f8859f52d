"""DAPO's dynamic sampling: groups that all score the same are dropped and further prompts refill the
batch; checked against what the reward function saw in a run, and the pieces on their own."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from rlflow.trainer import ConfigError, Trainer, load_config
from rlflow.trainer.dynamic_sampling import informative_groups
from rlflow.trainer.runner import LaggedIssuer

ROWS = [{"prompt": f"{a}+{b}="} for a in range(6) for b in range(6)]
CONFIG = {
    "experiment_name": "dynamic_sampling",
    "algorithm": {"name": "grpo", "n_samples": 2, "dynamic_sampling": True, "dynamic_sampling_max_rounds": 2},
    "data": {"batch_size": 4, "max_prompt_len": 8},
    "rollout": {"max_new_tokens": 4},
    "models": {"actor": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}},
    "warmup": {"steps": 0},
    "trainer": {"total_steps": 2, "log_every": 1, "eval_before_train": False, "eval_every": 0},
    "placement": {"worker_host": "driver", "mode": "heuristic", "profile": False},
    "logging": {"tensorboard": False, "console": False},
    "checkpoint": {"save_final": False},
}


def test_informative_groups_are_those_whose_rewards_differ():
    rewards = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 0.2])
    assert informative_groups(rewards, ["a", "a", "b", "b", "c", "c", "d", "d"]) == {
        "a": False, "b": True, "c": False, "d": True,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["algorithm.name=ppo"], "compares the responses to a prompt"),
        (["algorithm.n_samples=1"], "n_samples=1"),
        (["algorithm.policy_lag=1"], "policy_lag=1"),
    ],
)
def test_settings_without_groups_or_on_policy_rollouts_are_refused(overrides, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(None, ["algorithm.dynamic_sampling=true", *overrides])
    assert err.value.key == "algorithm.dynamic_sampling"


def test_the_issuer_refuses_a_sampler_with_lagged_rollouts():
    with pytest.raises(ValueError, match="a rollout sampler needs on-policy rollouts, not policy_lag=1"):
        LaggedIssuer(None, 1, last_step=3, sample=lambda step, batches: None)


def test_a_run_trains_on_the_groups_whose_rewards_differ(tmp_path):
    calls = tmp_path / "reward_calls.jsonl"  # the worker scores with a copy of the function: it writes here

    def varied_reward(prompts, completions, trainer_state, **kwargs):
        rewards = [float(len(set(c)) % 3) for c in completions]
        with open(calls, "a") as f:
            f.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts, "rewards": rewards}) + "\n")
        return rewards

    config = {**CONFIG, "logging": {**CONFIG["logging"], "dir": str(tmp_path / "run")}}
    with Trainer(config, reward_funcs=[varied_reward], train_dataset=ROWS, progress_bars=False) as trainer:
        assert trainer.fit().steps == 2
    seen = defaultdict(list)  # step -> (prompts, rewards) of each reward call
    for call in map(json.loads, calls.read_text().splitlines()):
        seen[call["step"]].append((call["prompts"], call["rewards"]))
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in logged if "actor_train/score_mean" in r}
    assert sorted(by_step) == [1, 2]
    for step, record in by_step.items():
        kept, dropped = [], []
        for prompts, rewards in seen[step]:
            for i in range(0, len(prompts), 2):  # the 2 samples of a prompt are consecutive
                (kept if rewards[i] != rewards[i + 1] else dropped).append(rewards[i : i + 2])
        assert record["dynamic_sampling/rounds"] == len(seen[step])
        assert record["dynamic_sampling/groups_dropped"] == len(dropped)
        short = max(0, 4 - len(kept))
        assert record["dynamic_sampling/groups_short"] == short
        assert len(seen[step]) == 2 or short == 0  # rounds stop once 4 groups differ
        trained = kept[:4] + dropped[:short]
        assert record["actor_train/score_mean"] == pytest.approx(np.mean(trained))
