"""A TRL GRPO program ported by changing its imports and its config: conversational data, a
``TrainerCallback``, and rewards from a reward model given by Hub id (resolved offline from a cache
built here) or from a function that reads the conversation as TRL hands it."""

from __future__ import annotations

import pytest
from huggingface_hub import constants
from test_reward_model_id import SNAPSHOT, save_reward_model
from test_trl_callbacks import Recorder

from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import Trainer

# A chat template in the char tokenizer's alphabet: "<u>" / "<a>" open a turn, a newline closes it.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
ROWS = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "total": a + b} for a in range(4) for b in range(4)]
CONFIG = {
    "experiment_name": "trl_program",
    "algorithm": {"name": "grpo", "n_samples": 2},
    "data": {"batch_size": 4, "max_prompt_len": 16},
    "rollout": {"max_new_tokens": 4},
    "warmup": {"steps": 0},
    "trainer": {"total_steps": 2, "log_every": 1, "eval_before_train": False},
    "placement": {"mode": "heuristic", "devices_per_node": 1, "profile": False},
    "logging": {"tensorboard": False, "console": False},
    "checkpoint": {"save_final": False},
}


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_actor(tokenizer):
    return build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


def config_in(tmp_path) -> dict:
    return {**CONFIG, "logging": {**CONFIG["logging"], "dir": str(tmp_path / "run")}}


def conversation_reward(prompts, completions, completion_ids, trainer_state, total, **kwargs):
    """TRL's conversational convention, checked on every call: message lists in, one assistant message out."""
    for prompt, completion, ids, row_total in zip(prompts, completions, completion_ids, total):
        assert prompt[-1]["role"] == "user" and prompt[-1]["content"].endswith("=")
        a, b = prompt[-1]["content"][:-1].split("+")
        assert int(a) + int(b) == row_total  # the row's own column beside its own prompt
        assert [m["role"] for m in completion] == ["assistant"] and len(ids) >= 1
    return [float(len(c[0]["content"])) + 100.0 * trainer_state.global_step for c in completions]


@pytest.mark.timeout(180)
def test_a_conversational_program_with_a_reward_function_and_a_trainer_callback(tmp_path, chat_tokenizer):
    recorder = Recorder()
    with Trainer(
        config_in(tmp_path),
        model=tiny_actor(chat_tokenizer),
        tokenizer=chat_tokenizer,
        reward_funcs=conversation_reward,
        train_dataset=ROWS,
        callbacks=[recorder],
        progress_bars=False,
    ) as trainer:
        assert trainer.fit().steps == 2
    rewards = {h["step"]: h["reward_inf/rewards/conversation_reward"] for h in recorder.seen[-1][1].log_history
               if "reward_inf/rewards/conversation_reward" in h}  # fmt: skip
    assert sorted(rewards) == [1, 2] and all(100 * s <= r <= 100 * s + 4 for s, r in rewards.items())


@pytest.mark.timeout(180)
def test_a_conversational_program_scored_by_a_reward_model_id(tmp_path, chat_tokenizer, monkeypatch):
    repo = tmp_path / "hub" / "models--org--tiny-rm"
    save_reward_model(repo / "snapshots" / SNAPSHOT, chat_tokenizer)  # the policy's tokenizer, as rlflow needs
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    recorder = Recorder(stop_at=1)
    with Trainer(
        config_in(tmp_path),
        model=tiny_actor(chat_tokenizer),
        tokenizer=chat_tokenizer,
        reward_funcs="org/tiny-rm",
        train_dataset=ROWS,
        callbacks=[recorder],
        progress_bars=False,
    ) as trainer:
        result = trainer.fit()
    assert 1 <= result.steps <= 2 and recorder.events[-1][0] == "train_end"
    scores = [h["reward_inf/score_mean"] for h in recorder.seen[-1][1].log_history if "reward_inf/score_mean" in h]
    assert len(scores) == result.steps and all(s != 0.0 for s in scores)
