"""Recomputed old log-probs in the policy loss: the truncated importance weight against the rollout's
log-probs (TIS), its place beside the decoupled correction of ``policy_lag``, and the mismatch metric."""

from __future__ import annotations

import pytest
import torch

from rlflow.algos import get_policy_loss, logp_mismatch
from rlflow.algos.params import AlgorithmParams
from rlflow.workers.losses import policy_loss_fn


def rows(seed: int = 0, mismatch: float = 0.3):
    """A policy's log-probs (with gradient), recomputed old log-probs and the rollout engine's."""
    g = torch.Generator().manual_seed(seed)
    log_prob = torch.log(torch.rand(4, 6, generator=g) * 0.8 + 0.1).requires_grad_(True)
    old = (log_prob.detach() + 0.05 * torch.randn(4, 6, generator=g)).clamp(max=0.0)
    rollout = (old + mismatch * torch.randn(4, 6, generator=g)).clamp(max=0.0)
    mask = (torch.rand(4, 6, generator=g) > 0.2).long()
    batch = {
        "old_logp": old,
        "rollout_logp": rollout,
        "advantages": torch.randn(4, 6, generator=g),
        "response_mask": mask,
    }
    return log_prob, batch


def ppo(log_prob, old, advantages, mask):
    return get_policy_loss("ppo")(log_prob, old, advantages, mask, 0.2, 0.2, None, "token-mean").loss


def loss_and_grad(algo: AlgorithmParams, log_prob, batch):
    outputs = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    loss, metrics = policy_loss_fn(algo.resolved(), kl_coef=0.0)(outputs, batch)
    return loss, torch.autograd.grad(loss, log_prob)[0], metrics


def test_tis_weights_each_token_by_min_of_old_over_rollout_and_the_cap():
    log_prob, batch = rows()
    loss, grad, metrics = loss_and_grad(AlgorithmParams(tis_cap=1.5), log_prob, batch)
    old, rollout, mask = batch["old_logp"], batch["rollout_logp"], batch["response_mask"]
    weights = torch.minimum((old - rollout).exp(), torch.tensor(1.5)) * mask  # by hand
    expected = ppo(log_prob, old, batch["advantages"] * weights, mask)  # the ratio stays around old_logp
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, log_prob)[0])
    ratio = (old - rollout).exp()[mask.bool()]
    assert metrics["is_weight_mean"] == pytest.approx(float(ratio.mean()), rel=1e-5)
    assert metrics["is_weight_max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert metrics["is_truncated_fraction"] == pytest.approx(float((ratio > 1.5).float().mean()))
    assert 0 < metrics["is_truncated_fraction"] < 1, "the cap must bite on some tokens and not on others"


def test_without_tis_the_ratio_uses_the_recomputed_log_probs_unweighted():
    log_prob, batch = rows()
    loss, _, metrics = loss_and_grad(AlgorithmParams(), log_prob, batch)
    torch.testing.assert_close(loss, ppo(log_prob, batch["old_logp"], batch["advantages"], batch["response_mask"]))
    assert "is_weight_mean" not in metrics
    # Without recomputed log-probs in the batch, tis_cap has nothing to weigh against: today's loss.
    plain = {k: v for k, v in batch.items() if k != "rollout_logp"}
    with_cap, _, metrics = loss_and_grad(AlgorithmParams(tis_cap=1.5), log_prob, plain)
    torch.testing.assert_close(with_cap, loss)
    assert "is_weight_mean" not in metrics


def test_tis_on_equal_log_probs_is_the_plain_loss():
    log_prob, batch = rows(mismatch=0.0)
    batch["rollout_logp"] = batch["old_logp"].clone()
    tis, tis_grad, metrics = loss_and_grad(AlgorithmParams(tis_cap=2.0), log_prob, batch)
    plain, plain_grad, _ = loss_and_grad(AlgorithmParams(), log_prob, batch)
    torch.testing.assert_close(tis, plain)
    torch.testing.assert_close(tis_grad, plain_grad)
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_truncated_fraction"] == 0.0


def test_under_a_lag_the_recomputed_log_probs_are_the_proximal_policy_and_the_rollout_the_behaviour():
    log_prob, batch = rows()
    loss, grad, metrics = loss_and_grad(AlgorithmParams(policy_lag=1, is_cap=1.5), log_prob, batch)
    old, rollout, mask = batch["old_logp"], batch["rollout_logp"], batch["response_mask"]
    weights = (old - rollout).exp().clamp(max=1.5) * mask
    expected = ppo(log_prob, old, batch["advantages"] * weights, mask)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, log_prob)[0])
    assert metrics["behaviour_kl"] > 0


def test_tis_and_the_decoupled_correction_are_one_weight_not_two():
    with pytest.raises(ValueError, match=r"AlgorithmParams.tis_cap=2.0: the decoupled correction .* set is_cap"):
        AlgorithmParams(policy_lag=1, tis_cap=2.0)
    AlgorithmParams(policy_lag=1, behaviour_correction="none", tis_cap=2.0)  # no decoupled weight: allowed
    with pytest.raises(ValueError, match=r"AlgorithmParams.tis_cap=0.0; expected > 0"):
        AlgorithmParams(tis_cap=0.0)


def test_the_mismatch_metric_is_the_mean_and_max_over_response_tokens():
    recomputed = torch.tensor([[-1.0, -2.0, -3.0, -0.5], [-0.1, -0.2, -9.0, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0, -2.5, -9.0], [-0.1, -0.5, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    metrics = logp_mismatch(recomputed, rollout, mask)
    assert metrics["logp_mismatch_mean"] == pytest.approx((0.1 + 0.0 + 0.5 + 0.3 + 0.0) / 5)
    assert metrics["logp_mismatch_max"] == pytest.approx(0.5)  # the masked 8.5 left out
    assert logp_mismatch(recomputed, rollout, torch.zeros_like(mask)) == {
        "logp_mismatch_mean": 0.0,
        "logp_mismatch_max": 0.0,
    }
