"""verl's keys are refused with the rlflow key that means the same; ``policy_loss: vanilla`` is refused
naming both of its meanings."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from rlflow.trainer.config import ConfigError, RLFlowConfig, load_config, render_config_reference
from rlflow.trainer.config_fields import optional_section
from rlflow.trainer.verl_keys import VERL_KEYS, VERL_SECTIONS


def _declared(key: str) -> bool:
    """Whether ``key`` names a field (or section) of the config; ``models.<role>`` stands for any role."""
    cls: typing.Any = RLFlowConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        hint = hints[part]
        if typing.get_origin(hint) is dict:  # models.<role>.<field>: skip the role
            if i + 1 == len(parts) - 1 or i + 1 == len(parts):
                return True
            parts.pop(i + 1)
            hint = typing.get_args(hint)[1]
        hint = optional_section(hint) or hint  # models.<role>.lora: a section that is off when null
        if i < len(parts) - 1 and not dataclasses.is_dataclass(hint):
            return False
        cls = hint
    return True


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_batch_size=64", "data.train_batch_size: a verl key; rlflow's is data.batch_size"),
        ("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.n: a verl key; rlflow's is algorithm.n_samples"),
        ("trainer.save_freq=10", "trainer.save_freq: a verl key; rlflow's is checkpoint.every_n_steps"),
        ("trainer.test_freq=5", "trainer.test_freq: a verl key; rlflow's is trainer.eval_every"),
        ("algorithm.kl_ctrl.kl_coef=0.001", "algorithm.kl_ctrl.kl_coef: a verl key; rlflow's is algorithm.kl_coef"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr: a verl key; rlflow's is "),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "ppo_mini_batch_size: a verl key; rlflow's is algorithm.n_minibatches (verl counts prompts per "
            "mini-batch, rlflow counts mini-batches: n_minibatches = data.batch_size / ppo_mini_batch_size)",
        ),
        ("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref: a verl section; rlflow's keys for verl's are"),
    ],
)
def test_a_verl_override_names_the_rlflow_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_a_verl_yaml_names_its_verl_key_and_the_file(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("trainer:\n  total_steps: 3\nactor_rollout_ref:\n  model:\n    path: /models/qwen\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "actor_rollout_ref.model.path"
    assert info.value.problem.startswith("a verl key; rlflow's is models.actor.path")
    assert info.value.source == f"in {path}"


def test_the_error_names_every_verl_key_given_so_a_verl_config_converts_in_one_go(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("data:\n  max_prompt_length: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["trainer.total_steps=3", "trainer.test_freq=5", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert info.value.key == "data.max_prompt_length"
    assert info.value.problem == (
        "a verl key; rlflow's is data.max_prompt_len; other verl keys given: trainer.test_freq (rlflow: "
        "trainer.eval_every), actor_rollout_ref.actor.optim.lr (rlflow: models.actor.lr)"
    )


def test_other_unknown_keys_still_list_the_valid_keys():
    with pytest.raises(ConfigError, match=r"^data.train_batch: unknown key; valid keys here: \['task'"):
        load_config(None, ["data.train_batch=3"])


def test_vanilla_is_refused_with_both_meanings_and_both_rlflow_names():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.policy_loss=vanilla"])
    assert info.value.key == "algorithm.policy_loss"
    assert "verl's is PPO's clipped surrogate, rlflow's 'ppo'" in info.value.problem
    assert "-A * pi / pi_old is rlflow's 'unclipped'" in info.value.problem
    assert load_config(None, ["algorithm.policy_loss=unclipped"]).algorithm.policy_loss == "unclipped"


def test_the_table_names_only_verl_keys_rlflow_lacks_and_rlflow_keys_it_has():
    for entry in VERL_KEYS:
        assert not _declared(entry.verl), f"{entry.verl} is an rlflow key too: its verl hint can never be shown"
        assert _declared(entry.rlflow), f"{entry.verl}: {entry.rlflow} is no rlflow key"
        assert entry.verl.split(".")[0] in (*VERL_SECTIONS, "data", "algorithm", "trainer")


def test_the_reference_lists_the_table():
    reference = render_config_reference()
    assert "## Coming from verl" in reference
    assert "| `actor_rollout_ref.rollout.n` | `algorithm.n_samples` |  |" in reference
