"""Calls through the dataflow runner on two real workers: records carry the step the driver gave,
and a call that raises reaches the driver as an error naming the call, its model and the rank.

The failing call is a rule reward given a ground truth that is not a number (a configuration
error, which the reward raises on); it runs on rank 1 alone, beside the same reward on both ranks.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.algos.params import AlgorithmParams
from rlflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool, WorkerError
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.dataflow import MFCDef, build_graph
from rlflow.dataflow.algorithms import ROLLOUT_KEYS
from rlflow.engine.rollout import SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.runner import CallPlacement, DataflowRunner
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

DP2 = CallLayout((0, 1), ParallelStrategy(dp=2))
RANK1 = CallLayout((1,), ParallelStrategy())


def reward_call(name: str, model: str) -> MFCDef:
    return MFCDef(name, model, "inference", (*ROLLOUT_KEYS, "answers"), ("rewards",))


@pytest.fixture(scope="module")
def group(ray_session, tmp_path_factory):
    tokenizer_dir = str(tmp_path_factory.mktemp("tokenizer"))
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    models = {
        "score": ModelSetup("score", "reward", None, reward_fn="numeric_match"),
        "reward": ModelSetup("reward", "reward", None, reward_fn="numeric_match"),
    }
    mfcs = {"score_inf": reward_call("score_inf", "score"), "reward_inf": reward_call("reward_inf", "reward")}
    setup = WorkerSetup(
        models,
        mfcs,
        {"score_inf": DP2, "reward_inf": RANK1},
        AlgorithmParams("grpo", adv_estimator="grpo", n_samples=1),
        SamplingParams(max_new_tokens=2),
        SamplingParams(greedy=True, max_new_tokens=2),
        tokenizer_dir,
    )
    pool = ResourcePool([2], cpus_per_worker=0.25)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ModelWorker, setup))
    group.init_process_group(timeout_s=120)
    group.build()
    yield group, setup
    pool.release()


def runner_for(group: RayWorkerGroup, setup: WorkerSetup, name: str) -> DataflowRunner:
    layout = setup.layouts[name]
    placement = CallPlacement(setup.mfcs[name], layout.ranks, layout.strategy, setup.hook_ranks(name))
    return DataflowRunner(group, build_graph([setup.mfcs[name]]), {name: placement})


def rollout_rows(answers: tuple[str, ...] = ("2", "4", "6", "8")) -> DataProto:
    """Four prompt + response rows (two answered right) and their ground-truth ``answers``."""
    tokenizer = build_char_tokenizer()
    texts = [("1+1=", "2"), ("2+2=", "5"), ("3+3=", "6"), ("4+4=", "9")]
    ids = [tokenizer(p + r, add_special_tokens=False).input_ids for p, r in texts]
    response = [[0] * len(tokenizer(p, add_special_tokens=False).input_ids) + [1] for p, _ in texts]
    return DataProto.from_dict(
        {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.ones(len(ids), len(ids[0]), dtype=torch.long),
            "response_mask": torch.tensor(response),
        },
        {"answers": list(answers)},
    )


def test_records_carry_the_step_the_runner_gave_the_call(group):
    workers, setup = group
    workers.pop_metrics()
    runner = runner_for(workers, setup, "score_inf")
    out = runner.wait(runner.submit(rollout_rows(), step=3), fetch=["score_inf"])["score_inf"]
    assert out.batch["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    records = [r for per_rank in workers.pop_metrics() for r in per_rank]
    assert [(r.mfc, r.model, r.kind, r.rank, r.step) for r in records] == [
        ("score_inf", "score", "call", 0, 3),
        ("score_inf", "score", "call", 1, 3),
    ]
    # Each rank scored two rows; the numbers are the call's, reduced over its dp ranks.
    assert all(r.metrics["rows"] == 4 and r.metrics["score_mean"] == 0.5 and r.end >= r.start for r in records)


def test_a_failing_call_names_the_call_model_and_rank(group):
    workers, setup = group
    runner = runner_for(workers, setup, "reward_inf")
    with pytest.raises(WorkerError) as info:
        runner.wait(runner.submit(rollout_rows(("2", "4", "six", "8")), step=1))
    message = str(info.value)
    cause = "ValueError: numeric_match ground truth answer 'six' is not a number"
    # The call, its model and rank, then the reward, the sample's index among the rank's rows and its prompt.
    task = "reward_inf (model reward) on rank 1: RewardCallError: reward 'numeric_match' raised on sample 2 "
    task += f"(prompt '3+3='): {cause} (algorithm.reward_errors=zero or skip scores such samples)"
    assert message.startswith(f"{task}\n")
    assert info.value.rank == 1 and info.value.task == task
    # The worker's traceback is kept: the reward's frame and the original exception.
    assert "in numeric_match_reward" in message and f"\n{cause}\n" in message
    # The worker goes on serving calls after a failed one.
    runner = runner_for(workers, setup, "score_inf")
    assert len(runner.wait(runner.submit(rollout_rows(), step=2), fetch=["score_inf"])["score_inf"]) == 4
