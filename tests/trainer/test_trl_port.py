"""The TRL GRPO port of docs/quickstart.md, end to end on a tiny model: a model and a tokenizer
as objects, a dataset as a list of dicts with a column of its own, a reward function reading
that column, a callback receiving the metrics and stopping the run.

The reward functions are defined in this test module, which the Ray workers cannot import
(pytest puts ``tests/trainer`` on the driver's path only): they reach the workers by value.
"""

from __future__ import annotations

import importlib.util

import pytest

from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import Trainer

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# Each row carries its prompt reversed in a column of its own: the reward can only score 0.5 for
# every completion when each completion arrives with its own row's column (samples repeated,
# rows split over workers and back).
ROWS = [{"prompt": f"{a}+{b}=", "mirror": f"{a}+{b}="[::-1]} for a in range(4) for b in range(4)]
CONFIG = {
    "experiment_name": "trl_port",
    "algorithm": {"name": "grpo", "n_samples": 2},
    "data": {"batch_size": 4, "max_prompt_len": 8},
    "rollout": {"max_new_tokens": 4},  # data.max_response_len follows
    "models": {"actor": {"lr": 1e-4}},
    "trainer": {"total_steps": 4, "log_every": 1, "eval_before_train": False},
    "placement": {"devices_per_node": 2, "search_seconds": 0.2},  # two CPU workers: rows split between them
    "logging": {"tensorboard": False, "console": False},
    "checkpoint": {"save_final": False},
}


def mirror_reward(prompts, completions, mirror, **kwargs):
    """0.5 when the row's ``mirror`` column is its prompt reversed; -1 for a misaligned column."""
    return [0.5 if m == p[::-1] else -1.0 for p, m in zip(prompts, mirror)]


def length_reward(completions, **kwargs):
    return [0.0 * len(c) for c in completions]


def test_the_trl_grpo_port_runs_with_a_column_reward_and_a_stopping_callback(ray_session, tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    logged: list[tuple[int, dict[str, float]]] = []

    def on_step(step, metrics):
        logged.append((step, metrics))
        return step >= 2  # stop: the step in flight finishes, then the run ends

    config = {**CONFIG, "logging": {**CONFIG["logging"], "dir": str(tmp_path / "run")}}
    with Trainer(
        config,
        model=model,
        tokenizer=tokenizer,
        reward_funcs=[mirror_reward, length_reward],
        reward_weights=[1.0, 2.0],
        train_dataset=ROWS,
        eval_dataset=ROWS[:4],
        callbacks=[on_step],
        progress_bars=False,
    ) as trainer:
        assert not trainer.launched  # built, not launched
        result = trainer.fit()
        assert trainer.launched
    assert not trainer.launched  # the with block released the workers

    steps = [(step, m) for step, m in logged if "reward_inf/score_mean" in m]
    assert [step for step, _ in steps][:2] == [1, 2] and 2 <= result.steps < CONFIG["trainer"]["total_steps"]
    for _, metrics in steps:
        assert metrics["reward_inf/rewards/mirror_reward"] == 0.5
        assert metrics["reward_inf/rewards/length_reward"] == 0.0
        assert metrics["reward_inf/score_mean"] == 0.5
    assert result.score_after == 0.5  # the held-out rows are scored by the same functions


def test_the_reward_module_is_not_importable_on_the_workers(ray_session):
    """What makes the port's rewards travel by value necessary (and the test above meaningful)."""

    @ray_session.remote
    def find(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    assert importlib.util.find_spec(__name__) is not None
    assert ray_session.get(find.remote(__name__)) is False
