"""Overlong handling in the train steps: the penalty in the advantages, truncated responses out of the
actor's loss (the batch its engine is given)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlflow.algos import compute_advantages
from rlflow.algos.overlong import overlong_penalty
from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow import MFCDef
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.advantage import AdvantageEstimator
from rlflow.workers.context import CallContext, last_token_scatter
from rlflow.workers.interfaces import ActorInterface
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

TRAIN = MFCDef("actor_train", "actor", "train_step", ("input_ids",), (), objective="rl")
CTX = CallContext(TRAIN)
STOP = 2


def rows() -> dict[str, torch.Tensor]:
    """Four samples of two prompts: 1 prompt token then responses of 4, 2, 4 (ending on the stop token) and 3."""
    input_ids = torch.tensor([[1, 5, 6, 7, 8], [1, 5, 6, 0, 0], [3, 5, 6, 7, STOP], [3, 5, 6, 7, 0]])
    response_mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != 0).long(),
        "response_mask": response_mask,
        "old_logp": -0.5 * response_mask.float(),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
    }


def test_the_soft_penalty_is_added_to_the_rewards_before_the_advantages():
    algo = AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2, overlong_buffer=3, overlong_penalty=0.5)
    data = DataProto.from_dict(rows(), {"uid": ["a", "a", "b", "b"]})
    adv, _, metrics = AdvantageEstimator(algo, max_new_tokens=4)(data, CTX)
    penalty = overlong_penalty(torch.tensor([4, 2, 4, 3]), max_len=4, buffer=3, factor=0.5)
    assert penalty.tolist() == pytest.approx([-0.5, -1 / 6, -0.5, -1 / 3])  # 0.5 * (length - 1) / 3
    mask = rows()["response_mask"].float()
    expected, _ = compute_advantages(
        "grpo",
        token_level_rewards=last_token_scatter(rows()["rewards"] + penalty, mask),
        response_mask=mask,
        index=["a", "a", "b", "b"],
    )
    torch.testing.assert_close(adv, expected)
    assert metrics["overlong_penalty_mean"] == pytest.approx(float(penalty.mean()))
    assert metrics["score_mean"] == 0.5  # the task's score, before the penalty


def test_the_penalty_needs_the_generation_limit():
    algo = AlgorithmParams("grpo", adv_estimator="grpo", overlong_buffer=8)
    for limit in (None, 4):
        with pytest.raises(ValueError, match=f"overlong_buffer=8 needs .*max_new_tokens={limit}"):
            AdvantageEstimator(algo, max_new_tokens=limit)


def actor(algo: AlgorithmParams) -> ActorInterface:
    models = {"actor": ModelSetup("actor", "actor", "unused", trainable=True, optim=OptimConfig())}
    sampling = SamplingParams(n=2, max_new_tokens=4, stop_token_ids=(STOP,))
    layouts = {"actor_train": CallLayout((0,), ParallelStrategy())}
    setup = WorkerSetup(models, {"actor_train": TRAIN}, layouts, algo, sampling, SamplingParams(greedy=True), "unused")
    return ActorInterface(models["actor"], setup)


def engine_given() -> tuple[SimpleNamespace, list[dict]]:
    """An engine that records what the train step hands it."""
    calls: list[dict] = []

    def train_step(batch, loss_fn, **options):
        calls.append({"batch": dict(batch), **options})
        return {"loss": 0.0}

    return SimpleNamespace(stage=SimpleNamespace(), train_step=train_step), calls


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_responses_leave_the_actor_loss(mask_truncated):
    algo = AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2, mask_truncated=mask_truncated)
    engine, calls = engine_given()
    data = DataProto.from_dict(rows(), {"uid": ["a", "a", "b", "b"]})
    metrics = actor(algo).train_step(engine, data, CTX)
    (call,) = calls
    given = call["batch"]["response_mask"]
    if mask_truncated:  # row 0 reached 4 tokens without the stop token; row 2 stopped on its 4th
        assert given.sum(1).tolist() == [0, 2, 4, 3] and metrics["truncated_fraction"] == 0.25
        assert call["empty_ok"] is True
    else:
        assert torch.equal(given, rows()["response_mask"]) and "truncated_fraction" not in metrics
        assert call["empty_ok"] is False
