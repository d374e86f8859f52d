"""``Trainer(reward_funcs="org/reward-model")`` as TRL takes it: a reward model by local path or Hub
id (resolved offline from a Hugging Face cache built here), a ``*ForSequenceClassification``
checkpoint that becomes the run's ``models.reward``, and a short GRPO run scored by it."""

from __future__ import annotations

import json
import math

import pytest
from huggingface_hub import constants
from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaForTokenClassification

from rlflow.data.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from rlflow.trainer import ConfigError, Trainer, build
from rlflow.trainer.inputs import split_reward_funcs
from tests.workers.worker_helpers import save_sequence_classifier

ROWS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
SMALL = {
    "experiment_name": "reward_model_id",
    "algorithm": {"name": "grpo", "n_samples": 2},
    "data": {"batch_size": 4, "max_prompt_len": 8},
    "rollout": {"max_new_tokens": 4},
    "models": {"actor": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}},
    "warmup": {"steps": 0},
    "trainer": {"total_steps": 2, "log_every": 1, "eval_before_train": False},
    "placement": {"mode": "heuristic", "devices_per_node": 1, "profile": False},
    "logging": {"tensorboard": False, "console": False},
    "checkpoint": {"save_final": False},
}
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def save_reward_model(path, tokenizer=None) -> None:
    """A tiny one-label LlamaForSequenceClassification (TRL's reward-model kind) with ``tokenizer``."""
    save_sequence_classifier(path, tokenizer or build_char_tokenizer())


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding ``org/tiny-rm`` (the layout huggingface_hub writes)."""
    repo = tmp_path / "hub" / "models--org--tiny-rm"
    save_reward_model(repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / SNAPSHOT


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(cfg):
        raise AssertionError("Trainer.__init__ started Ray")

    monkeypatch.setattr(build, "ensure_ray", refuse)


def config_in(tmp_path) -> dict:
    return {**SMALL, "logging": {**SMALL["logging"], "dir": str(tmp_path / "run")}}


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_strings_are_reward_models_and_functions_stay_functions():
    assert split_reward_funcs("org/rm") == (None, "org/rm")  # not iterated character by character
    assert split_reward_funcs(["org/rm"]) == (None, "org/rm")
    assert split_reward_funcs([length_reward]) == ([length_reward], None)
    assert split_reward_funcs(length_reward) == ([length_reward], None)
    with pytest.raises(ConfigError, match="reward_funcs: a reward model \\('org/rm'\\) beside reward functions"):
        split_reward_funcs(["org/rm", length_reward])
    with pytest.raises(ConfigError, match="reward_funcs: 2 reward models"):
        split_reward_funcs(["org/a", "org/b"])
    with pytest.raises(ConfigError, match="reward_weights: \\[2.0\\] for a reward model"):
        split_reward_funcs("org/rm", [2.0])


def test_a_local_reward_model_becomes_models_reward(tmp_path, no_ray):
    save_reward_model(tmp_path / "rm")
    trainer = Trainer(config_in(tmp_path), reward_funcs=str(tmp_path / "rm"), train_dataset=ROWS)
    reward = trainer.cfg.models["reward"]
    assert (reward.init, reward.path) == ("path", str(tmp_path / "rm"))
    assert trainer.reward_funcs is None and trainer.data.reward_fn is None
    assert "reward_inf" in trainer.graph.nodes  # scored by the model, not by a rule
    trainer.close()


def test_a_reward_model_object_is_saved_into_the_run(tmp_path, no_ray):
    save_reward_model(tmp_path / "rm")
    model = LlamaForSequenceClassification.from_pretrained(tmp_path / "rm")
    trainer = Trainer(config_in(tmp_path), reward_funcs=[model], train_dataset=ROWS)
    path = trainer.cfg.models["reward"].path
    assert (
        path == str(tmp_path / "run" / "models" / "reward_init")
        and (tmp_path / "run" / "models" / "reward_init" / "config.json").is_file()
    )
    trainer.close()


def test_a_hub_id_resolves_offline_from_the_cache(tmp_path, hub_cache, no_ray):
    trainer = Trainer(config_in(tmp_path), reward_funcs="org/tiny-rm", train_dataset=ROWS)
    assert trainer.cfg.models["reward"].path == str(hub_cache)
    trainer.close()
    with pytest.raises(
        ConfigError,
        match="reward_funcs: 'org/absent' does not exist as a local directory.*huggingface-cli download org/absent",
    ):
        Trainer(config_in(tmp_path), reward_funcs="org/absent", train_dataset=ROWS)


def test_only_a_token_classification_reward_model_must_share_the_runs_tokenizer(tmp_path, no_ray):
    other = build_char_tokenizer(alphabet=DEFAULT_ALPHABET[::-1])
    save_reward_model(tmp_path / "trl_rm", other)  # TRL's kind: scored on the text, re-tokenized by its own
    trainer = Trainer(config_in(tmp_path), reward_funcs=str(tmp_path / "trl_rm"), train_dataset=ROWS)
    assert trainer.cfg.models["reward"].path == str(tmp_path / "trl_rm")
    trainer.close()

    config = LlamaConfig(vocab_size=len(other), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1)  # fmt: skip
    LlamaForTokenClassification(config).save_pretrained(tmp_path / "rlflow_rm")  # rlflow's kind: reads token ids
    other.save_pretrained(tmp_path / "rlflow_rm")
    with pytest.raises(ConfigError, match="models.reward.path: the tokenizer of .* differs from the run's"):
        Trainer(config_in(tmp_path), reward_funcs=str(tmp_path / "rlflow_rm"), train_dataset=ROWS)


def test_a_trl_reward_model_with_a_smaller_vocabulary_than_the_run_is_accepted(tmp_path, no_ray):
    small = build_char_tokenizer(alphabet="0123456789+=")  # its own tokenizer: fewer ids than the run's
    assert len(small) < len(build_char_tokenizer())
    save_reward_model(tmp_path / "small_rm", small)
    trainer = Trainer(config_in(tmp_path), reward_funcs=str(tmp_path / "small_rm"), train_dataset=ROWS)
    assert trainer.cfg.models["reward"].path == str(tmp_path / "small_rm")
    trainer.close()


def test_a_causal_lm_is_no_reward_model(tmp_path, no_ray):
    from rlflow.data.tiny_models import build_tiny_model

    build_tiny_model(vocab_size=len(build_char_tokenizer()), hidden_size=32, num_layers=1).save_pretrained(
        tmp_path / "lm"
    )
    with pytest.raises(ConfigError, match="ForCausalLM'\\]; a reward model is a \\*ForSequenceClassification"):
        Trainer(config_in(tmp_path), reward_funcs=str(tmp_path / "lm"), train_dataset=ROWS)


@pytest.mark.timeout(180)
def test_a_grpo_run_is_scored_by_a_reward_model_given_by_id(tmp_path, hub_cache):
    with Trainer(config_in(tmp_path), reward_funcs="org/tiny-rm", train_dataset=ROWS, progress_bars=False) as trainer:
        result = trainer.fit()
    assert result.steps == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["reward_inf/score_mean"] for r in records if "reward_inf/score_mean" in r]
    assert len(scores) == 2 and all(math.isfinite(s) and s != 0.0 for s in scores)  # the model's scores


@pytest.mark.timeout(180)
def test_a_grpo_run_is_scored_by_a_reward_model_of_another_tokenizer(tmp_path):
    save_reward_model(tmp_path / "rm", build_char_tokenizer(alphabet=DEFAULT_ALPHABET[::-1]))
    with Trainer(config_in(tmp_path), reward_funcs=str(tmp_path / "rm"), train_dataset=ROWS, progress_bars=False) as t:
        assert t.fit().steps == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["reward_inf/score_mean"] for r in records if "reward_inf/score_mean" in r]
    assert len(scores) == 2 and all(math.isfinite(s) and s != 0.0 for s in scores)
