"""Mismatch corrections between the rollout engine's and the trainer's log-probs (sequence TIS,
masked IS, token masking) against hand-worked weights, alone and in the actor's loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.algos import get_policy_loss, mismatch_weights, sequence_log_ratio
from rlflow.algos.params import AlgorithmParams
from rlflow.workers.losses import policy_loss_fn


def case():
    # Token ratios pi_old / pi_rollout: sequence 0 (1, 4) -> product 4, geometric mean 2;
    # sequence 1 (0.5, 1, masked 100) -> product 0.5, geometric mean 0.7071; sequence 2 has no tokens.
    ratios = torch.tensor([[1.0, 4.0, 1.0], [0.5, 1.0, 100.0], [1.0, 1.0, 1.0]])
    rollout = torch.full((3, 3), math.log(0.1))
    old = rollout + ratios.log()
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    return old, rollout, mask


def test_sequence_ratio_forms():
    old, rollout, mask = case()
    product = sequence_log_ratio(old, rollout, mask, "product").exp()
    torch.testing.assert_close(product, torch.tensor([4.0, 0.5, 1.0]))
    geo = sequence_log_ratio(old, rollout, mask, "geometric_mean").exp()
    torch.testing.assert_close(geo, torch.tensor([2.0, math.sqrt(0.5), 1.0]))
    with pytest.raises(ValueError, match="unknown sequence ratio form 'mean'"):
        sequence_log_ratio(old, rollout, mask, "mean")


def test_sequence_tis_truncates_the_sequence_weight():
    old, rollout, mask = case()
    w, m = mismatch_weights(old, rollout, mask, seq_tis_cap=1.5, seq_ratio="product")
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert m["mismatch_seq_truncated_fraction"] == 0.5  # of the two sequences with tokens
    assert m["mismatch_seq_ratio_mean"] == pytest.approx(2.25)
    assert (m["mismatch_seq_ratio_min"], m["mismatch_seq_ratio_max"]) == pytest.approx((0.5, 4.0))
    w, _ = mismatch_weights(old, rollout, mask, seq_tis_cap=3.0)  # geometric mean: 2 and 0.707, both under
    torch.testing.assert_close(w[:2, :2], torch.tensor([[2.0, 2.0], [math.sqrt(0.5)] * 2]))


def test_masked_is_drops_sequences_outside_the_band():
    old, rollout, mask = case()
    w, m = mismatch_weights(old, rollout, mask, seq_ratio="product", seq_mask_low=0.6, seq_mask_high=5.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert m["mismatch_seq_masked_fraction"] == 0.5
    w, m = mismatch_weights(old, rollout, mask, seq_mask_high=1.5)  # geometric mean 2 > 1.5: sequence 0 out
    torch.testing.assert_close(w[:2, :2], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert "mismatch_seq_truncated_fraction" not in m and "mismatch_token_masked_fraction" not in m


def test_token_masking_drops_tokens_outside_the_band():
    old, rollout, mask = case()
    w, m = mismatch_weights(old, rollout, mask, token_mask_low=0.6, token_mask_high=2.0)
    # Ratios 4 (too high) and 0.5 (too low) are dropped; the masked 100 was never counted.
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert m["mismatch_token_masked_fraction"] == 0.5


def rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    log_prob = torch.log(torch.rand(4, 6, generator=g) * 0.8 + 0.1).requires_grad_(True)
    old = (log_prob.detach() + 0.05 * torch.randn(4, 6, generator=g)).clamp(max=0.0)
    rollout = (old + 0.4 * torch.randn(4, 6, generator=g)).clamp(max=0.0)
    mask = (torch.rand(4, 6, generator=g) > 0.2).long()
    return log_prob, {"old_logp": old, "rollout_logp": rollout, "advantages": torch.randn(4, 6, generator=g),
                      "response_mask": mask}  # fmt: skip


def test_the_actor_loss_multiplies_tis_and_the_corrections_into_the_advantages():
    log_prob, batch = rows()
    algo = AlgorithmParams(
        tis_cap=1.5, seq_tis_cap=1.2, seq_is_ratio="product", token_mask_low=0.5, token_mask_high=2.0
    ).resolved()
    outputs = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    loss, metrics = policy_loss_fn(algo, kl_coef=0.0)(outputs, batch)
    old, rollout, mask = batch["old_logp"], batch["rollout_logp"], batch["response_mask"]
    r = (old - rollout).exp()  # by hand
    seq = torch.where(mask.bool(), old - rollout, 0.0).sum(-1).exp()
    keep = ((r >= 0.5) & (r <= 2.0)).float()
    weights = torch.minimum(r, torch.tensor(1.5)) * seq.clamp(max=1.2).unsqueeze(-1) * keep * mask
    ppo = get_policy_loss("ppo")(log_prob, old, batch["advantages"] * weights, mask, 0.2, 0.2, None, "token-mean")
    torch.testing.assert_close(loss, ppo.loss)
    real = mask.bool()
    assert metrics["mismatch_token_masked_fraction"] == pytest.approx(float(1 - keep[real].mean()))
    assert metrics["mismatch_seq_ratio_max"] == pytest.approx(float(seq.max()), rel=1e-5)
    assert 0 < metrics["mismatch_token_masked_fraction"] < 1 and "is_weight_mean" in metrics


def test_corrections_are_off_by_default_and_refused_with_the_decoupled_correction():
    assert AlgorithmParams().mismatch_options() == {}
    log_prob, batch = rows()
    outputs = {"log_probs": log_prob, "entropy": torch.zeros_like(log_prob)}
    _, metrics = policy_loss_fn(AlgorithmParams().resolved(), kl_coef=0.0)(outputs, batch)
    assert not any(k.startswith(("mismatch_", "is_")) for k in metrics)
    with pytest.raises(ValueError, match="AlgorithmParams.seq_mask_high=3.0: the mismatch corrections"):
        AlgorithmParams(policy_lag=1, seq_mask_high=3.0)
    with pytest.raises(ValueError, match=r"AlgorithmParams.token_mask_low=1.5; expected < 1"):
        AlgorithmParams(token_mask_low=1.5)
