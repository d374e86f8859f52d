"""Losses against hand-worked examples (numbers derived in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlflow.algos import (
    agg_loss,
    bradley_terry_loss,
    dpo_loss,
    entropy_bonus,
    get_policy_loss,
    list_policy_losses,
    ppo_policy_loss,
    register_policy_loss,
    sft_loss,
    unclipped_policy_loss,
    value_loss,
)


def ppo_case():
    # Tokens: (A=+1, r=1.5) upper clip; (A=+2, r=0.9) inside; (A=-1, r=0.5) lower clip;
    # (A=-1, r=5) dual clip; the fifth is masked out and must not count.
    ratio = torch.tensor([[1.5, 0.9, 0.5, 5.0, 10.0]])
    log_prob = ratio.log().requires_grad_(True)
    advantages = torch.tensor([[1.0, 2.0, -1.0, -1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return log_prob, torch.zeros(1, 5), advantages, mask


def test_ppo_loss_clip_dual_clip_and_stats():
    log_prob, old, adv, mask = ppo_case()
    out = ppo_policy_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_c=3.0)
    # per-token: max(-1.5, -1.2) = -1.2; -1.8; max(0.5, 0.8) = 0.8; min(max(5, 1.2), 3) = 3.
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 - 1.8 + 0.8 + 3.0) / 4))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(0.5))  # tokens 1 and 3
    torch.testing.assert_close(out.dual_clip_fraction, torch.tensor(0.25))  # token 4
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.9, 0.5, 5.0)]
    torch.testing.assert_close(out.approx_kl, torch.tensor(sum(k3) / 4))
    out.loss.backward()
    # Only the unclipped token carries gradient: d(-A * r)/d log r = -A * r = -1.8, over 4 tokens.
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -1.8 / 4, 0.0, 0.0, 0.0]]))


def test_ppo_without_dual_clip_and_with_clip_higher():
    log_prob, old, adv, mask = ppo_case()
    no_dual = ppo_policy_loss(log_prob, old, adv, mask, clip_ratio_c=None)
    torch.testing.assert_close(no_dual.loss, torch.tensor((-1.2 - 1.8 + 0.8 + 5.0) / 4))
    higher = ppo_policy_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(higher.loss, torch.tensor((-1.28 - 1.8 + 0.8 + 3.0) / 4))
    with pytest.raises(ValueError, match="clip_ratio_c=0.5 must be > 1"):
        ppo_policy_loss(log_prob, old, adv, mask, clip_ratio_c=0.5)


def test_unclipped_policy_gradient_is_reinforce_on_policy():
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = unclipped_policy_loss(log_prob, log_prob.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    out.loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.0, 0.5]]))  # -A / num_tokens


def test_agg_loss_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third sequence is empty
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4 + 0) / 3)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        agg_loss(loss, mask, "mean")


def test_value_loss_clipped_by_hand():
    values = torch.tensor([[2.0, 0.5, 0.0]])
    old = torch.tensor([[1.0, 0.4, 1.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    loss, clip_fraction = value_loss(values, old, returns, torch.ones(1, 3), clip_range_value=0.2)
    # squared errors 4, 0.25, 0; clipped predictions 1.2, 0.5, 0.8 -> 1.44, 0.25, 0.64; max 4, 0.25, 0.64.
    torch.testing.assert_close(loss, torch.tensor(0.5 * (4 + 0.25 + 0.64) / 3))
    torch.testing.assert_close(clip_fraction, torch.tensor(1 / 3))
    plain, _ = value_loss(values, old, returns, torch.ones(1, 3), clip_range_value=None)
    torch.testing.assert_close(plain, torch.tensor(0.5 * (4 + 0.25 + 0.0) / 3))


def test_entropy_bonus_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    bonus = entropy_bonus(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(bonus, torch.tensor(1.5 * math.log(2)))  # 0.5 ln 2 + 2 * 0.25 ln 4


def test_dpo_sigmoid_ipo_and_label_smoothing_by_hand():
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.0))  # h = (-1 + 3) - 0 = 2
    out = dpo_loss(pc, pr, rc, rr, beta=0.5)
    torch.testing.assert_close(out.losses, torch.tensor([math.log(1 + math.exp(-1.0))]))  # -log sigmoid(1)
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.5]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.5]))
    smooth = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1).losses
    torch.testing.assert_close(smooth, torch.tensor([0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.e)]))
    ipo = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo").losses
    torch.testing.assert_close(ipo, torch.tensor([1.0]))  # (2 - 1 / (2 * 0.5))^2
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge2'"):
        dpo_loss(pc, pr, rc, rr, loss_type="hinge2")


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    dpo_loss(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).losses.mean().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


def test_sft_loss_equals_cross_entropy_with_ignored_positions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    reference = F.cross_entropy(logits.reshape(-1, 11), labels.masked_fill(loss_mask == 0, -100).reshape(-1))
    torch.testing.assert_close(sft_loss(logits, labels, loss_mask), reference)


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2  # gaps 1 and -1
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected)
    with_margin = (math.log(2) + math.log(1 + math.e)) / 2  # gaps 0 and -1
    assert bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0])).item() == pytest.approx(with_margin)


def test_policy_loss_registry(monkeypatch):
    from rlflow.algos import losses

    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    assert {"ppo", "unclipped", "gspo", "cispo"} <= set(list_policy_losses())
    assert get_policy_loss("ppo") is ppo_policy_loss
    with pytest.raises(ValueError, match="'ppo' is already registered"):
        register_policy_loss("ppo")(unclipped_policy_loss)
    with pytest.raises(KeyError, match="registered: \\['cispo', 'gspo', 'ppo', 'unclipped'\\]"):
        get_policy_loss("grpo-typo")


def test_vanilla_is_refused_naming_both_meanings():
    # verl's "vanilla" is the clipped PPO surrogate; rlflow's unclipped loss is "unclipped".
    with pytest.raises(KeyError, match="verl's is PPO's clipped surrogate, rlflow's 'ppo'.*rlflow's 'unclipped'"):
        get_policy_loss("vanilla")
    with pytest.raises(ValueError, match="'vanilla' is refused as ambiguous"):
        register_policy_loss("vanilla")(ppo_policy_loss)
