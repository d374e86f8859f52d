"""A reward that raises on one sample (issue 15: it aborted the run): ``algorithm.reward_errors``
``raise`` names the call's sample and prompt; ``zero`` and ``skip`` score it, count it and log the
fraction, for rule rewards and TRL-style reward functions alike."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.dataflow import MFCDef
from rlflow.dataflow.algorithms import ROLLOUT_KEYS
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.build import model_setups
from rlflow.trainer.config import load_config
from rlflow.trainer.runner import CallPlacement
from rlflow.workers import rewards
from rlflow.workers.context import CallContext
from rlflow.workers.interfaces.reward import RuleRewardInterface
from rlflow.workers.reward_errors import RewardCallError, RewardErrors
from rlflow.workers.reward_funcs import pack_reward_funcs, score_completions
from rlflow.workers.rewards import compute_rule_rewards, register_reward
from rlflow.workers.setup import ModelSetup

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
RESPONSES = ["2", "5", "boom", "8"]


@pytest.fixture
def fragile(monkeypatch):
    """A rule that raises on the response ``boom``, registered for this test only."""
    monkeypatch.setattr(rewards, "_REWARDS", dict(rewards._REWARDS))

    @register_reward("fragile", needs_ground_truth=False)
    def fragile_reward(prompt, response, ground_truth):
        if response == "boom":
            raise RuntimeError("cannot score 'boom'")
        return 1.0

    return "fragile"


def test_raise_names_the_reward_the_sample_its_prompt_id_and_prompt(fragile):
    with pytest.raises(RewardCallError) as err:
        compute_rule_rewards(fragile, PROMPTS, RESPONSES, [None] * 4, uids=[10, 11, 12, 13])
    assert str(err.value).startswith(
        "reward 'fragile' raised on sample 2, prompt id 12 (prompt '3+3='): RuntimeError: cannot score 'boom'"
    )
    assert "algorithm.reward_errors" in str(err.value)


def test_zero_scores_the_sample_zero_and_skip_leaves_it_out(fragile):
    zero = RewardErrors("zero")
    assert compute_rule_rewards(fragile, PROMPTS, RESPONSES, [None] * 4, zero).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert zero.count == 1 and zero.metrics(4) == {"reward_error_fraction": 0.25}
    skip = RewardErrors("skip")
    scores = compute_rule_rewards(fragile, PROMPTS, RESPONSES, [None] * 4, skip).tolist()
    assert math.isnan(scores[2]) and [scores[i] for i in (0, 1, 3)] == [1.0, 1.0, 1.0] and skip.count == 1


def test_a_reward_function_that_raises_is_scored_sample_by_sample():
    def length(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    def strict(prompts, completions, **kwargs):
        if "boom" in completions:
            raise ValueError("boom is no number")
        return [1.0] * len(completions)

    funcs = pack_reward_funcs([length, strict])
    with pytest.raises(RewardCallError, match=r"reward 'strict' raised on sample 2 \(prompt '3\+3='\): ValueError"):
        score_completions(funcs, PROMPTS, RESPONSES, {})
    zero, skip = RewardErrors("zero"), RewardErrors("skip")
    total, means = score_completions(funcs, PROMPTS, RESPONSES, {}, zero)
    assert total.tolist() == [2.0, 2.0, 4.0, 2.0] and means["rewards/strict"] == 0.75 and zero.count == 1
    total, means = score_completions(funcs, PROMPTS, RESPONSES, {}, skip)
    assert total.tolist() == [2.0, 2.0, 4.0, 2.0] and means["rewards/strict"] == 1.0 and skip.count == 1

    def short(prompts, completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="returned 1 values for 4 completions"):  # a contract error still raises
        score_completions(pack_reward_funcs([short]), PROMPTS, RESPONSES, {}, RewardErrors("zero"))


def rollout(answers: list) -> DataProto:
    tokenizer = build_char_tokenizer()
    ids = [tokenizer(p + r, add_special_tokens=False).input_ids for p, r in zip(PROMPTS, RESPONSES)]
    width = max(map(len, ids))
    masks = [[0] * len(tokenizer(p, add_special_tokens=False).input_ids) for p in PROMPTS]
    masks = [m + [1] * (len(i) - len(m)) + [0] * (width - len(i)) for m, i in zip(masks, ids)]
    ids = [i + [0] * (width - len(i)) for i in ids]
    return DataProto.from_dict(
        {
            "input_ids": torch.tensor(ids),
            "attention_mask": (torch.tensor(ids) != 0).long(),
            "response_mask": torch.tensor(masks),
        },
        {"answers": answers, "uid": [0, 1, 2, 3]},
    )


@pytest.mark.parametrize(("policy", "mean"), [("zero", 2 / 4), ("skip", 2 / 3)])  # skip: out of the mean
def test_the_rule_reward_call_scores_counts_and_logs_the_failures(tmp_path, caplog, policy, mean):
    caplog.set_level(logging.INFO, logger="rlflow")
    build_char_tokenizer().save_pretrained(tmp_path)
    model = ModelSetup("reward", "reward", None, reward_fn="numeric_match", reward_errors=policy)
    interface = RuleRewardInterface(model, SimpleNamespace(tokenizer_path=str(tmp_path)))
    ctx = CallContext(MFCDef("reward_inf", "reward", "inference", (*ROLLOUT_KEYS, "answers"), ("rewards",)))
    # Sample 2's ground truth is malformed (a worker sees it only if it got past loading, say from Python rows).
    out = interface.inference(None, rollout(["2", "4", {"answr": "6"}, "8"]), ctx)
    assert out.batch["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]  # a skipped sample gets 0, as TRL's all-None
    assert out.meta_info["score_mean"] == pytest.approx(mean)
    assert out.meta_info["reward_error_fraction"] == 0.25
    assert f"reward_inf: 1 reward error(s) scored by reward_errors={policy!r}; first: reward 'numeric_match'" in (
        caplog.text
    )


def test_the_config_field_reaches_the_reward_models_of_the_workers():
    cfg = load_config(None, ["algorithm.reward_errors=skip"])
    call = MFCDef("reward_inf", "reward", "inference", (*ROLLOUT_KEYS, "answers"), ("rewards",), runs_on_host=True)
    calls = {"reward_inf": CallPlacement(call, (0,), ParallelStrategy())}
    assert model_setups(cfg, {}, calls, "numeric_match")["reward"].reward_errors == "skip"
    with pytest.raises(ValueError, match="reward_errors='ignore'"):
        ModelSetup("reward", "reward", None, reward_fn="numeric_match", reward_errors="ignore")
