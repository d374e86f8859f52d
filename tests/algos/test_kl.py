"""KL estimators, the KL penalty in the reward and in the loss, and the coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_estimate,
    kl_loss,
)


def test_estimators_by_hand():
    logp, ref_logp = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-2.0, -0.5]])
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k1"), torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k2"), torch.tensor([[0.5, 0.0]]))
    # k3 with log(ref/pi) = -1: e^-1 - 1 + 1.
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k3"), torch.tensor([[math.exp(-1.0), 0.0]]))
    with pytest.raises(
        ValueError, match="unknown KL estimator 'k4'; expected one of \\('k1', 'k2', 'k3', 'k1\\+', 'k3\\+'\\)"
    ):
        kl_estimate(logp, ref_logp, "k4")


def test_k1_and_k3_are_unbiased_for_sampled_tokens():
    gen = torch.Generator().manual_seed(0)
    policy = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    ref = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])
    true_kl = (policy * (policy / ref).log()).sum().item()
    tokens = torch.multinomial(policy, 200_000, replacement=True, generator=gen)
    logp, ref_logp = policy.log()[tokens].unsqueeze(0), ref.log()[tokens].unsqueeze(0)
    for estimator in ("k1", "k3"):
        assert kl_estimate(logp, ref_logp, estimator).mean().item() == pytest.approx(true_kl, abs=5e-3)
    assert kl_estimate(logp, ref_logp, "k3").min() >= 0  # k3 is non-negative per token


def test_apply_kl_penalty_in_the_reward():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, -9.0]])
    ref_logp = torch.tensor([[-1.5, -1.0, -0.5], [-1.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, mean_kl = apply_kl_penalty(token_rewards, logp, ref_logp, mask, kl_coef=0.1, estimator="k1")
    # k1 per token: row 0: 0.5, 0, -0.5; row 1: 1, 0, (masked).
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]]))
    torch.testing.assert_close(mean_kl, torch.tensor((0.0 / 3 + 1.0 / 2) / 2))


def test_kl_loss_uses_aggregation_and_carries_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = kl_loss(logp, torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2), estimator="k2")
    torch.testing.assert_close(loss, torch.tensor(0.25))  # (0 + 0.5 * 1) / 2
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5]]))  # d/dx 0.5 x^2 / 2 at x = -1


def test_adaptive_controller_follows_ziegler_update():
    ctl = AdaptiveKLController(0.2, target_kl=1.0, horizon=10)
    ctl.update(current_kl=1.1, n_steps=5)  # error 0.1 -> x1.05
    assert ctl.value == pytest.approx(0.21)
    ctl.update(current_kl=0.0, n_steps=10)  # error -1 clipped to -0.2 -> x0.8
    assert ctl.value == pytest.approx(0.168)
    ctl.update(current_kl=3.0, n_steps=2)  # error 2 clipped to 0.2 -> x1.04
    assert ctl.value == pytest.approx(0.17472)
    with pytest.raises(ValueError, match="target_kl=0"):
        AdaptiveKLController(0.1, target_kl=0, horizon=10)


def test_fixed_controller_and_builder():
    fixed = build_kl_controller("fixed", 0.05)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    assert isinstance(build_kl_controller("adaptive", 0.1, target_kl=6.0, horizon=10_000), AdaptiveKLController)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        build_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="unknown KL controller kind 'pid'"):
        build_kl_controller("pid", 0.1)


@pytest.mark.parametrize("estimator", ["k1+", "k3+"])
def test_straight_through_estimators_have_the_value_of_k1_k3_and_the_gradient_of_k2(estimator):
    logp = torch.tensor([[-1.0, -0.5, -3.0]], requires_grad=True)
    ref_logp = torch.tensor([[-2.0, -0.5, -1.0]])
    value = kl_estimate(logp, ref_logp, estimator)
    torch.testing.assert_close(value, kl_estimate(logp, ref_logp, estimator[:-1]))
    # k2 = (log pi - log pi_ref)^2 / 2 has gradient log pi - log pi_ref: 1, 0, -2.
    (grad,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[1.0, 0.0, -2.0]]))
    # k3's own gradient is 1 - pi_ref/pi: 1 - e^-1 for the first token, unlike k3+'s.
    (k3_grad,) = torch.autograd.grad(kl_estimate(logp, ref_logp, "k3").sum(), logp)
    assert float(k3_grad[0, 0]) == pytest.approx(1 - math.exp(-1.0))
    loss = kl_loss(logp, ref_logp, torch.tensor([[1, 1, 0]]), estimator=estimator)
    torch.testing.assert_close(loss, kl_estimate(logp, ref_logp, estimator)[0, :2].mean())
