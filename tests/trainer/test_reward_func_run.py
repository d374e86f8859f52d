"""In a run, reward functions get the step of their call and the completions' token ids (TRL's
``trainer_state`` and ``completion_ids``): the driver's step reaches the reward worker."""

from __future__ import annotations

import json

import pytest

from rlflow.trainer import Trainer

ROWS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
CONFIG = {
    "experiment_name": "reward_func_run",
    "algorithm": {"name": "grpo", "n_samples": 2},
    "data": {"batch_size": 4, "max_prompt_len": 8},
    "rollout": {"max_new_tokens": 4},
    "models": {"actor": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}},
    "warmup": {"steps": 0},
    "trainer": {"total_steps": 3, "log_every": 1, "eval_before_train": False},
    "placement": {"mode": "heuristic", "devices_per_node": 1, "profile": False},
    "logging": {"tensorboard": False, "console": False},
    "checkpoint": {"save_final": False},
}


def step_reward(prompts, completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step + 10 * trainer_state.max_steps)] * len(completions)


def ids_reward(prompts, completions, completion_ids):
    assert all(1 <= len(ids) <= 4 for ids in completion_ids)  # the sampled tokens, no padding
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.timeout(180)
def test_reward_functions_get_their_calls_step_and_the_completion_ids(tmp_path):
    config = {**CONFIG, "logging": {**CONFIG["logging"], "dir": str(tmp_path / "run")}}
    with Trainer(config, reward_funcs=[step_reward, ids_reward], train_dataset=ROWS, progress_bars=False) as trainer:
        assert trainer.fit().steps == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["reward_inf/rewards/step_reward"] for r in records if "reward_inf/rewards/step_reward" in r}
    assert by_step == {1: 31.0, 2: 32.0, 3: 33.0}
    lengths = [r["reward_inf/rewards/ids_reward"] for r in records if "reward_inf/rewards/ids_reward" in r]
    assert len(lengths) == 3 and all(1.0 <= n <= 4.0 for n in lengths)
