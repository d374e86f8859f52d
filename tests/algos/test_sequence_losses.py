"""GSPO and CISPO against reference arithmetic written out in the tests (numbers in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.algos import cispo_policy_loss, get_policy_loss, gspo_policy_loss
from rlflow.algos.params import AlgorithmParams


def gspo_case():
    # Sequence 0: token ratios (2, 1, 1), A = +1: s0 = 2^(1/3) ~ 1.26, above 1 + 0.2: clipped.
    # Sequence 1: ratios (0.9, 0.9, masked 10), A = -1: s1 = 0.9, inside [0.8, 1.2].
    ratio = torch.tensor([[2.0, 1.0, 1.0], [0.9, 0.9, 10.0]])
    log_prob = ratio.log().requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return log_prob, torch.zeros(2, 3), advantages, mask


def test_gspo_clips_the_length_normalised_sequence_ratio():
    log_prob, old, adv, mask = gspo_case()
    out = gspo_policy_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    s0 = 2.0 ** (1 / 3)
    # seq-mean-token-mean: sequence 0's tokens each max(-1.26, -1.2) = -1.2; sequence 1's 0.9.
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 + 0.9) / 2))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(3 / 5))  # the 3 tokens of sequence 0
    torch.testing.assert_close(out.metrics["seq_clip_fraction"], torch.tensor(0.5))
    torch.testing.assert_close(out.metrics["seq_ratio_mean"], torch.tensor((s0 + 0.9) / 2))
    torch.testing.assert_close(out.metrics["seq_ratio_min"], torch.tensor(0.9))
    torch.testing.assert_close(out.metrics["seq_ratio_max"], torch.tensor(s0))
    out.loss.backward()
    # Sequence 1's tokens: d(-A * s1)/d log pi_t = s1 = 0.9, over 2 tokens and 2 sequences.
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 0.0], [0.225, 0.225, 0.0]]))
    token_mean = gspo_policy_loss(log_prob, old, adv, mask, 0.2, 0.2, loss_agg_mode="token-mean")
    torch.testing.assert_close(token_mean.loss, torch.tensor((-1.2 * 3 + 0.9 * 2) / 5))


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
    # The paper's GSPO: J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log ratio), as a
    # function of the log-probs; GSPO-token with one advantage per sequence is the same gradient.
    g = torch.Generator().manual_seed(0)
    log_prob = (torch.rand(3, 5, generator=g).log() * 0.3).requires_grad_(True)
    old = log_prob.detach() + 0.1 * torch.randn(3, 5, generator=g)
    adv = torch.tensor([1.5, -0.5, 0.7]).unsqueeze(-1).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    out = gspo_policy_loss(log_prob, old, adv, mask, 0.05, 0.08)
    (grad,) = torch.autograd.grad(out.loss, log_prob)
    ref_logp = log_prob.detach().clone().requires_grad_(True)
    terms = []
    for i in range(3):
        n = int(mask[i].sum())
        s = ((ref_logp[i, :n] - old[i, :n]).sum() / n).exp()
        a = adv[i, 0]
        terms.append(torch.maximum(-a * s, -a * s.clamp(0.95, 1.08)))
    reference = torch.stack(terms).mean()
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, ref_logp)[0])


def test_cispo_weights_reinforce_by_the_clipped_detached_ratio():
    # Tokens: r = 1.5 (clipped to 1.2), 0.9 (kept), 0.5 (clipped to 0.8); the fourth is masked.
    p = torch.tensor([[0.3, 0.6, 0.2, 0.5]])
    ratio = torch.tensor([[1.5, 0.9, 0.5, 9.0]])
    log_prob = p.log().requires_grad_(True)
    old = (p / ratio).log()
    adv = torch.tensor([[1.0, 2.0, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = get_policy_loss("cispo")(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    weights, a = [1.2, 0.9, 0.8], [1.0, 2.0, -1.0]
    expected = sum(-w * ai * math.log(pi) for w, ai, pi in zip(weights, a, [0.3, 0.6, 0.2])) / 3
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(out.clip_fraction, torch.tensor(2 / 3))
    torch.testing.assert_close(out.metrics["is_weight_mean"], torch.tensor((1.2 + 0.9 + 0.8) / 3))
    out.loss.backward()
    # A clipped token keeps its gradient: -w * A / 3 for every counted token.
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.2 / 3, -1.8 / 3, 0.8 / 3, 0.0]]))


def test_cispo_clip_higher_and_default_clip():
    log_prob = torch.log(torch.tensor([[0.5]]))
    old = torch.log(torch.tensor([[0.25]]))  # r = 2
    one = torch.ones(1, 1)
    higher = cispo_policy_loss(log_prob, old, one, one, clip_ratio_low=0.2, clip_ratio_high=5.0)
    assert float(higher.loss) == pytest.approx(-2.0 * math.log(0.5))  # 2 < 6: unclipped
    assert float(higher.clip_fraction) == 0.0
    assert float(cispo_policy_loss(log_prob, old, one, one).loss) == pytest.approx(-1.2 * math.log(0.5))


def test_a_dual_clip_on_a_loss_without_one_is_refused():
    with pytest.raises(ValueError, match="AlgorithmParams.dual_clip_c=3.0: policy loss 'gspo' has no dual clip"):
        AlgorithmParams(policy_loss="gspo", dual_clip_c=3.0)
    assert AlgorithmParams(policy_loss="ppo", dual_clip_c=3.0).dual_clip_c == 3.0


def test_gspo_without_response_tokens_reports_zeros():
    zeros = torch.zeros(2, 3)
    out = gspo_policy_loss(zeros.clone().requires_grad_(True), zeros, torch.ones(2, 3), torch.zeros(2, 3))
    assert float(out.loss.detach()) == 0.0 and all(float(v) == 0.0 for v in out.metrics.values())
