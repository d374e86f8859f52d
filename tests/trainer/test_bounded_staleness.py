"""Bounded staleness (``algorithm.policy_lag``): what is issued when, what the loss corrects, and
two real runs on two CPU workers — lag 0 equals the whole-iteration (synchronous) issue bit for
bit; lag 1 samples each rollout with the weights one step older than those training on it, on a
mesh of its own while the previous step trains.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import GRPO, GRPO_TINY, fit, step_metrics

from rlflow.algos import behaviour_weights, get_policy_loss
from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow import mfcs_of
from rlflow.dataflow.algorithms import algorithm_graph
from rlflow.trainer import ConfigError, load_config
from rlflow.trainer.runner import DataflowRunner, LaggedIssuer, Submitted
from rlflow.workers.losses import policy_loss_fn

# --- What is issued ahead, and in which order ---


def graph_runner(name: str, **options) -> DataflowRunner:
    """A runner over ``name``'s graph with no workers: enough for the issue order."""
    runner = DataflowRunner.__new__(DataflowRunner)
    runner.graph = algorithm_graph(name, **options)
    runner.order = [m.name for m in mfcs_of(runner.graph)]
    runner.placements = {m.name: SimpleNamespace(mfc=m) for m in mfcs_of(runner.graph)}
    return runner


@pytest.mark.parametrize(
    ("name", "options", "ahead"),
    [
        ("grpo", {"use_ref": True, "rule_based_reward": True}, ["actor_gen", "ref_inf", "reward_inf"]),
        # The critic trains: its values come with the step that trains on them, not ahead.
        ("ppo", {"use_ref": True}, ["actor_gen", "ref_inf", "reward_inf"]),
        # The EMA reference reads the actor's weights through its hook: not ahead.
        ("ppo_ema", {"use_ref": True}, ["actor_gen", "reward_inf"]),
        ("dpo", {}, []),
    ],
)
def test_rollout_calls_are_the_rollout_and_what_reads_only_it_on_frozen_weights(name, options, ahead):
    assert graph_runner(name, **options).rollout_calls() == ahead


class RecordingRunner:
    """Stands in for a DataflowRunner: records (step, calls) in issue order."""

    def __init__(self) -> None:
        self.issued: list[tuple[int, tuple[str, ...]]] = []
        self.order = ["actor_gen", "reward_inf", "actor_train"]

    def rollout_calls(self) -> list[str]:
        return ["actor_gen", "reward_inf"]

    def submit(self, batch, mfcs=None, *, step, upstream=None):
        self.issued.append((step, tuple(mfcs or self.order)))
        assert batch == f"batch{step}", "each step's calls get that step's batch"
        return Submitted()

    def wait(self, submitted):
        self.issued.append((-1, ("wait",)))


def batches():
    step = 0
    while True:
        step += 1
        yield f"batch{step}"


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_rollouts_are_issued_lag_steps_ahead_of_the_train_steps(lag):
    runner = RecordingRunner()
    issuer = LaggedIssuer(runner, lag, last_step=4)
    source = batches()
    for step in range(1, 5):
        issuer.issue(step, source)
    rollout, train = ("actor_gen", "reward_inf"), ("actor_train",)
    expected = []
    for step in range(1, 5):
        expected += [(s, rollout) for s in range(step, min(step + lag, 4) + 1) if (s, rollout) not in expected]
        expected.append((step, train))
    assert runner.issued == expected
    # The train step of step t comes after the rollout of t + lag: that rollout reads the weights before it.
    position = {entry: i for i, entry in enumerate(runner.issued)}
    for step in range(1, 5 - lag):
        assert position[(step + lag, rollout)] < position[(step, train)]


def test_a_run_stopping_early_waits_for_the_rollouts_it_issued_ahead():
    runner = RecordingRunner()
    issuer = LaggedIssuer(runner, 2, last_step=10)
    issuer.issue(1, batches())
    assert sorted(issuer.ahead) == [2, 3]
    issuer.drain()
    assert runner.issued[-2:] == [(-1, ("wait",))] * 2 and sorted(issuer.ahead) == [2, 3]


def test_policy_lag_is_refused_for_algorithms_that_sample_nothing_and_negative_lags():
    with pytest.raises(ConfigError, match="algorithm.policy_lag: 1 needs an algorithm that samples"):
        load_config(None, ["algorithm.name=dpo", "algorithm.policy_lag=1"])
    with pytest.raises(ConfigError, match="algorithm.policy_lag"):
        load_config(None, ["algorithm.policy_lag=-1"])
    with pytest.raises(ValueError, match="policy_lag=-1"):
        LaggedIssuer(RecordingRunner(), -1, last_step=3)


# --- The loss's correction for the behaviour policy ---


def test_auto_correction_is_decoupled_only_when_rollouts_may_lag():
    assert AlgorithmParams().resolved().behaviour_correction == "none"
    assert AlgorithmParams(policy_lag=1).resolved().behaviour_correction == "decoupled"
    assert AlgorithmParams(policy_lag=1, behaviour_correction="none").resolved().behaviour_correction == "none"


def test_behaviour_weights_are_truncated_detached_and_masked():
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.2, 0.3]], requires_grad=True))
    behaviour = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.01]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, metrics = behaviour_weights(prox, behaviour, mask, cap=2.0)
    assert not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 0.5, 0.0]]))  # 3 truncated to 2; padding 0
    assert metrics["is_truncated_fraction"] == pytest.approx(1 / 3)
    assert metrics["is_weight_max"] == pytest.approx(3.0)
    assert metrics["is_weight_mean"] == pytest.approx((1.0 + 3.0 + 0.5) / 3)
    assert metrics["behaviour_kl"] > 0


def rl_batch(seed: int = 0, lag_shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    log_prob = torch.log(torch.rand(4, 6, generator=g) * 0.8 + 0.1).requires_grad_(True)
    old = (log_prob.detach() + lag_shift * torch.randn(4, 6, generator=g)).clamp(max=0.0)
    mask = (torch.rand(4, 6, generator=g) > 0.2).long()
    advantages = torch.randn(4, 6, generator=g)
    return log_prob, {"old_logp": old, "advantages": advantages, "response_mask": mask}


def test_decoupled_loss_is_the_ppo_loss_around_the_proximal_policy_weighted_by_truncated_ratios():
    log_prob, batch = rl_batch(lag_shift=0.5)
    prox = (log_prob.detach() + 0.05).clamp(max=0.0)
    algo = AlgorithmParams(policy_lag=1, is_cap=1.5).resolved()
    outputs = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    loss, metrics = policy_loss_fn(algo, kl_coef=0.0)(outputs, {**batch, "prox_logp": prox})
    (grad,) = torch.autograd.grad(loss, log_prob)
    # By hand: PPO around prox, advantages times min(prox / behaviour, cap).
    weights = (prox - batch["old_logp"]).exp().clamp(max=1.5) * batch["response_mask"]
    expected = get_policy_loss("ppo")(
        log_prob,
        prox,
        batch["advantages"] * weights,
        batch["response_mask"],
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=None,
        loss_agg_mode="token-mean",
    ).loss
    (expected_grad,) = torch.autograd.grad(expected, log_prob)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < metrics["is_truncated_fraction"] < 1


def test_one_update_takes_its_own_forward_as_the_proximal_policy():
    """One optimizer step per batch: the weights before it are the weights of its forward."""
    log_prob, batch = rl_batch(lag_shift=0.3)
    algo = AlgorithmParams(policy_lag=1).resolved()
    outputs = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    own, _ = policy_loss_fn(algo, kl_coef=0.0)(outputs, batch)
    given, _ = policy_loss_fn(algo, kl_coef=0.0)(outputs, {**batch, "prox_logp": log_prob.detach()})
    torch.testing.assert_close(own, given)


def test_on_policy_rows_make_the_decoupled_loss_the_plain_one():
    """Rollout log-probs equal to the proximal ones: weights 1, and the same loss and gradient."""
    log_prob, batch = rl_batch()
    outputs = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    batch["old_logp"] = log_prob.detach().clone()
    plain, _ = policy_loss_fn(AlgorithmParams().resolved(), 0.0)(outputs, batch)
    decoupled, metrics = policy_loss_fn(AlgorithmParams(policy_lag=1).resolved(), 0.0)(outputs, batch)
    torch.testing.assert_close(torch.autograd.grad(plain, log_prob)[0], torch.autograd.grad(decoupled, log_prob)[0])
    assert metrics["is_weight_mean"] == pytest.approx(1.0) and metrics["is_truncated_fraction"] == 0.0


# --- Real runs on two CPU workers ---

# The rollout (and the rule reward) on worker 1, the train step on worker 0: with a lag they overlap.
DISJOINT = [
    "placement.mode=manual",
    "placement.manual.actor_gen.mesh.device_start=1",
    "placement.manual.reward_inf.mesh.device_start=1",
    "placement.manual.actor_train.mesh.device_start=0",
]
LAG_STEPS = 4
LAG_RUN = [*GRPO_TINY, *DISJOINT, f"trainer.total_steps={LAG_STEPS}", "checkpoint.every_n_steps=0"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{LAG_STEPS}" / "actor" / "hf" / "model.safetensors")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_lag_0_is_the_synchronous_run_bit_for_bit(ray_session, tmp_path, monkeypatch):
    staged_dir, whole_dir = tmp_path / "staged", tmp_path / "whole"
    fit(GRPO, [*LAG_RUN, "algorithm.policy_lag=0"], staged_dir)
    # The synchronous run as it was issued before policy lags existed: each iteration whole.
    monkeypatch.setattr(LaggedIssuer, "issue", lambda self, step, source: self.runner.submit(next(source), step=step))
    fit(GRPO, [*LAG_RUN, "algorithm.policy_lag=0"], whole_dir)
    staged, whole = final_weights(staged_dir), final_weights(whole_dir)
    assert sorted(staged) == sorted(whole)
    assert all(torch.equal(staged[k], whole[k]) for k in staged)
    initial = load_file(staged_dir / "models" / "actor" / "model.safetensors")
    assert any(not torch.equal(initial[k], staged[k]) for k in initial), (
        "the weights must move for this to test anything"
    )
    deterministic = ("actor_train/loss", "actor_train/grad_norm", "actor_train/entropy", "reward_inf/score_mean")
    for step, record in step_metrics(staged_dir).items():
        other = step_metrics(whole_dir)[step]
        assert {k: record[k] for k in deterministic} == {k: other[k] for k in deterministic}
        assert record["actor_train/policy_lag"] == 0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_lag_1_samples_with_weights_a_step_old_on_its_own_mesh_while_the_previous_step_trains(ray_session, tmp_path):
    trainer, result = fit(GRPO, [*LAG_RUN, "algorithm.policy_lag=1"], tmp_path)
    assert result.steps == LAG_STEPS
    metrics = step_metrics(tmp_path)
    # Step 1's rollout has nothing older to use; every later one was sampled before the step
    # in front of it trained.
    assert [metrics[s]["actor_train/policy_lag"] for s in range(1, LAG_STEPS + 1)] == [0, 1, 1, 1]
    assert all(metrics[s]["actor_train/policy_lag_max"] == 1 for s in range(2, LAG_STEPS + 1))
    for step in range(2, LAG_STEPS + 1):
        record = metrics[step]
        # Stale rows: the proximal policy (the weights training) differs from the behaviour one.
        assert record["actor_train/behaviour_kl"] > 0
        assert record["actor_train/is_weight_max"] != 1.0
        assert 0.0 <= record["actor_train/is_truncated_fraction"] <= 1.0
    # The rollout of step t+1 (worker 1) does not wait for step t's train step (worker 0): it
    # starts before that ends (synchronously it could only start after), so the two can overlap.
    calls = [i for i in trainer._intervals if i.kind == "call"]
    gens = {i.iteration: i for i in calls if i.label == "actor_gen" and i.device == 1}
    trains = {i.iteration: i for i in calls if i.label == "actor_train" and i.device == 0}
    for step in range(1, LAG_STEPS):
        assert gens[step + 1].start < trains[step].end, (step, gens, trains)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_resume_trains_on_the_rollouts_its_checkpoint_sampled_ahead(ray_session, tmp_path):
    """Lag 1, a checkpoint at step 2: step 3's rollout was sampled before step 2 trained. The
    checkpoint keeps its rows, so a run resumed from it trains as the uninterrupted run did."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    every = ["algorithm.policy_lag=1", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0"]
    fit(GRPO, [*LAG_RUN, *every], whole)
    checkpoint = whole / "checkpoints" / "step_2"
    assert (checkpoint / "rollouts_ahead" / "step_3" / "actor_gen.safetensors").is_file()
    fit(GRPO, [*LAG_RUN, *every, f"checkpoint.resume={checkpoint}"], resumed)
    want, got = final_weights(whole), final_weights(resumed)
    assert sorted(want) == sorted(got)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-6
    expected, metrics = step_metrics(whole), step_metrics(resumed)
    # Step 3's rollout and its rewards came with the checkpoint (the resumed run logs no calls for them).
    assert "actor_gen/tokens" not in metrics[3] and "reward_inf/score_mean" not in metrics[3]
    for step in (3, 4):
        keys = ["actor_train/policy_lag", "actor_train/loss", "actor_train/is_weight_mean", "actor_train/score_mean"]
        for key in keys + (["actor_gen/tokens", "reward_inf/score_mean"] if step == 4 else []):
            assert metrics[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lag_1_learns_on_the_main_jobs_task(ray_session, tmp_path):
    """The main job (SFT warm-up, then GRPO on 2-digit addition) with every rollout one step
    stale: 20 GRPO steps lift the held-out score as on-policy ones do (72.4% -> 83.4% at step 20
    of the on-policy run, docs/benchmarks.md): 5 points, or a quarter of the gap to 100% when the
    warm-up left less room (where it stops varies with the compute dtype)."""
    _, result = fit(
        GRPO,
        [
            "algorithm.policy_lag=1",
            "trainer.total_steps=20",
            "trainer.eval_every=20",
            "logging.console=false",
            "logging.tensorboard=false",
            "checkpoint.save_final=false",
        ],
        tmp_path,
    )
    metrics = step_metrics(tmp_path)
    assert [metrics[s]["actor_train/policy_lag"] for s in (1, 2, 20)] == [0, 1, 1]
    assert result.score_before is not None and result.score_after is not None
    gain = min(0.05, (1 - result.score_before) / 4)
    assert result.score_after >= result.score_before + gain, result.eval_history
