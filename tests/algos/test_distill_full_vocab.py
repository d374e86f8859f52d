"""Full-vocabulary on-policy distillation (``algorithm.distill_loss: full_vocab``): the exact
KL(student || teacher) over the vocabulary at each sampled position, the forward KL and GKD's
generalised Jensen-Shannon divergence, their alignment and gradients checked against plain-Python
and numpy arithmetic; the policy loss they enter; the teacher call's extra key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_distill import CTX, rows

from rlflow.algos import (
    agg_loss,
    vocab_divergence,
    vocab_forward_kl,
    vocab_jsd,
    vocab_log_probs,
    vocab_reverse_kl,
)
from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow.algorithms import algorithm_graph, algorithm_mfcs
from rlflow.workers.advantage import AdvantageEstimator
from rlflow.workers.losses import policy_loss_fn

# One row of three tokens over a vocabulary of three: the logits at t predict token t + 1.
STUDENT_LOGITS = [[[0.0, 1.0, 2.0], [1.5, -0.5, 0.0], [3.0, 0.0, 0.0]]]
TEACHER_LOGITS = [[[2.0, 0.0, 0.0], [0.0, 0.0, 4.0], [1.0, 1.0, 1.0]]]


def softmax(xs: list[float]) -> list[float]:
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def reference_kl(student: list[float], teacher: list[float]) -> float:
    """sum_v p(v) log(p(v) / q(v)) of two logit rows, in plain Python."""
    p, q = softmax(student), softmax(teacher)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def test_position_t_holds_the_distribution_token_t_was_drawn_from():
    logp = vocab_log_probs(torch.tensor(STUDENT_LOGITS))
    assert logp.shape == (1, 3, 3) and logp[0, 0].abs().sum() == 0  # a sequence start has no prediction
    for t in (1, 2):
        assert logp[0, t].exp().tolist() == pytest.approx(softmax(STUDENT_LOGITS[0][t - 1]))


def test_the_vocabulary_kl_is_the_exact_reverse_kl_at_each_position():
    s, t = (vocab_log_probs(torch.tensor(x)) for x in (STUDENT_LOGITS, TEACHER_LOGITS))
    kl = vocab_reverse_kl(s, t)
    expected = [0.0] + [reference_kl(STUDENT_LOGITS[0][i], TEACHER_LOGITS[0][i]) for i in (0, 1)]
    assert kl[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert vocab_reverse_kl(t, t).abs().max() < 1e-6  # the teacher against itself: 0
    with pytest.raises(ValueError, match="same \\(B, T, V\\) shape"):
        vocab_reverse_kl(s, t[..., :2])


def test_the_gradient_is_the_analytic_one_and_never_reaches_the_teacher():
    # d KL(p || q) / d z_i = p_i (log p_i - log q_i - KL), with p = softmax(z).
    z = torch.tensor([[STUDENT_LOGITS[0][0], STUDENT_LOGITS[0][0]]], requires_grad=True)
    teacher = vocab_log_probs(torch.tensor([[TEACHER_LOGITS[0][0], TEACHER_LOGITS[0][0]]])).requires_grad_()
    vocab_reverse_kl(vocab_log_probs(z), teacher)[0, 1].backward()
    p, q = softmax(STUDENT_LOGITS[0][0]), softmax(TEACHER_LOGITS[0][0])
    kl = reference_kl(STUDENT_LOGITS[0][0], TEACHER_LOGITS[0][0])
    assert z.grad[0, 0].tolist() == pytest.approx([pi * (math.log(pi / qi) - kl) for pi, qi in zip(p, q)], rel=1e-5)
    assert teacher.grad is None


def test_the_forward_kl_weighs_tokens_by_the_teacher_and_its_gradient_is_softmax_minus_teacher():
    s, t = (vocab_log_probs(torch.tensor(x)) for x in (STUDENT_LOGITS, TEACHER_LOGITS))
    expected = [0.0] + [reference_kl(TEACHER_LOGITS[0][i], STUDENT_LOGITS[0][i]) for i in (0, 1)]
    assert vocab_forward_kl(s, t)[0].tolist() == pytest.approx(expected, rel=1e-5)
    # d KL(q || p) / d z = p - q (cross-entropy to soft labels), with p = softmax(z).
    z = torch.tensor([STUDENT_LOGITS[0][:2]], requires_grad=True)
    vocab_forward_kl(vocab_log_probs(z), t[:, :2])[0, 1].backward()
    p, q = softmax(STUDENT_LOGITS[0][0]), softmax(TEACHER_LOGITS[0][0])
    assert z.grad[0, 0].tolist() == pytest.approx([pi - qi for pi, qi in zip(p, q)], rel=1e-5)


def reference_jsd(student: list[float], teacher: list[float], beta: float) -> float:
    """beta KL(q || m) + (1 - beta) KL(p || m), m = beta q + (1 - beta) p, of two logit rows (p the
    student's, q the teacher's), with numpy's probabilities."""
    p, q = (np.exp(x) / np.exp(x).sum() for x in (np.array(student), np.array(teacher)))
    m = beta * q + (1 - beta) * p
    return float(beta * np.sum(q * np.log(q / m)) + (1 - beta) * np.sum(p * np.log(p / m)))


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_the_jsd_is_gkds_generalised_jensen_shannon_divergence(beta):
    s, t = (vocab_log_probs(torch.tensor(x)) for x in (STUDENT_LOGITS, TEACHER_LOGITS))
    expected = [0.0] + [reference_jsd(STUDENT_LOGITS[0][i], TEACHER_LOGITS[0][i], beta) for i in (0, 1)]
    jsd = vocab_jsd(s, t, beta)
    assert jsd[0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)  # start: 0 up to rounding
    assert torch.equal(vocab_divergence(s, t, "jsd", beta), jsd)
    # Bounded by the entropy of (beta, 1 - beta), where the KLs are not; 0 against itself.
    assert float(jsd.max()) < -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert vocab_jsd(t, t, beta).abs().max() < 1e-6


def test_the_jsd_ends_are_the_forward_and_reverse_kl():
    s, t = (vocab_log_probs(torch.tensor(x)) for x in (STUDENT_LOGITS, TEACHER_LOGITS))
    # At beta 0 and 1 exactly, TRL's convention: the KL the divergence tends to (up to its factor).
    assert torch.equal(vocab_jsd(s, t, 0.0), vocab_forward_kl(s, t))
    assert torch.equal(vocab_jsd(s, t, 1.0), vocab_reverse_kl(s, t))
    eps = 1e-3
    assert (vocab_jsd(s, t, eps) / eps)[0, 1:].tolist() == pytest.approx(
        vocab_forward_kl(s, t)[0, 1:].tolist(), rel=1e-2
    )
    assert (vocab_jsd(s, t, 1 - eps) / eps)[0, 1:].tolist() == pytest.approx(
        vocab_reverse_kl(s, t)[0, 1:].tolist(), rel=1e-2
    )
    with pytest.raises(ValueError, match="beta=1.5; expected 0 <= beta <= 1"):
        vocab_jsd(s, t, 1.5)
    with pytest.raises(ValueError, match="divergence='tv'; expected one of"):
        vocab_divergence(s, t, "tv")


def test_the_jsd_gradient_is_the_analytic_one_and_never_reaches_the_teacher():
    # d JSD / d p_v = (1 - beta) log(p_v / m_v); through the softmax:
    # d JSD / d z_i = (1 - beta) p_i (log(p_i / m_i) - KL(p || m)).
    beta = 0.3
    z = torch.tensor([STUDENT_LOGITS[0][:2]], requires_grad=True)
    teacher = vocab_log_probs(torch.tensor([TEACHER_LOGITS[0][:2]])).requires_grad_()
    vocab_jsd(vocab_log_probs(z), teacher, beta)[0, 1].backward()
    p, q = (np.exp(x) / np.exp(x).sum() for x in (np.array(STUDENT_LOGITS[0][0]), np.array(TEACHER_LOGITS[0][0])))
    m = beta * q + (1 - beta) * p
    expected = (1 - beta) * p * (np.log(p / m) - np.sum(p * np.log(p / m)))
    assert z.grad[0, 0].tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert teacher.grad is None


def loss_inputs(mask: list[list[int]], forward: bool = False) -> tuple[dict, dict, torch.Tensor]:
    """Engine outputs and a train batch for one row of three tokens; the expected masked mean KL
    (reverse, or ``forward``)."""
    logits = torch.tensor(STUDENT_LOGITS, requires_grad=True)
    logp = vocab_log_probs(logits)
    ids = torch.tensor([[0, 2, 0]])
    token_logp = logp.gather(-1, ids[..., None])[..., 0]
    outputs = {"log_probs": token_logp, "entropy": torch.zeros(1, 3), "logits": logits}
    response = torch.tensor(mask, dtype=torch.float32)
    batch = {
        "response_mask": response,
        "old_logp": token_logp.detach(),
        "advantages": torch.tensor([[0.0, 2.0, -1.0]]),
        "teacher_vocab_logp": vocab_log_probs(torch.tensor(TEACHER_LOGITS)),
    }
    pairs = [(STUDENT_LOGITS[0][i], TEACHER_LOGITS[0][i]) for i in (0, 1)]
    kl = [reference_kl(*(pair[::-1] if forward else pair)) for pair in pairs]
    expected = torch.tensor(sum(k * m for k, m in zip(kl, mask[0][1:])) / sum(mask[0][1:]))
    return outputs, batch, expected


def test_alone_the_vocabulary_kl_is_the_whole_loss():
    algo = AlgorithmParams("distill", distill_loss="full_vocab").resolved()
    outputs, batch, expected = loss_inputs([[0, 1, 1]])
    loss, metrics = policy_loss_fn(algo, 0.0)(outputs, batch)
    # The sampled advantages (2, -1) would move the loss: at ratio 1 the PPO term is -mean(A) = -0.5.
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert metrics["distill_vocab_kl"] == pytest.approx(float(expected), rel=1e-5)
    assert "pg_loss" not in metrics and "clip_fraction" in metrics


def test_the_forward_divergence_is_the_loss_when_chosen():
    algo = AlgorithmParams("distill", distill_loss="full_vocab", distill_divergence="forward").resolved()
    outputs, batch, expected = loss_inputs([[0, 1, 1]], forward=True)
    loss, metrics = policy_loss_fn(algo, 0.0)(outputs, batch)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert metrics["distill_vocab_kl"] == pytest.approx(float(expected), rel=1e-5)


def test_the_jsd_is_the_loss_when_chosen():
    algo = AlgorithmParams(
        "distill", distill_loss="full_vocab", distill_divergence="jsd", distill_jsd_beta=0.2
    ).resolved()
    outputs, batch, _ = loss_inputs([[0, 1, 1]])
    loss, metrics = policy_loss_fn(algo, 0.0)(outputs, batch)
    expected = sum(reference_jsd(STUDENT_LOGITS[0][i], TEACHER_LOGITS[0][i], 0.2) for i in (0, 1)) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert metrics["distill_vocab_kl"] == pytest.approx(expected, rel=1e-5)


def test_mixed_with_a_reward_it_is_added_to_the_policy_loss_with_its_coefficient():
    coef = 0.25
    algo = AlgorithmParams("grpo", n_samples=1, distill_coef=coef, distill_loss="full_vocab").resolved()
    outputs, batch, expected = loss_inputs([[0, 0, 1]])  # only the last token is a response token
    loss, metrics = policy_loss_fn(algo, 0.0)(outputs, batch)
    pg = -agg_loss(batch["advantages"], batch["response_mask"], "token-mean")  # ratio 1: -mean(A)
    assert float(loss.detach()) == pytest.approx(float(pg + coef * expected), rel=1e-5)
    assert metrics["pg_loss"] == pytest.approx(float(pg))
    # The sampled distillation default leaves the loss the policy term alone.
    plain, plain_metrics = policy_loss_fn(AlgorithmParams("grpo", n_samples=1, distill_coef=coef).resolved(), 0.0)(
        outputs, batch
    )
    assert float(plain.detach()) == pytest.approx(float(pg)) and "distill_vocab_kl" not in plain_metrics


def test_under_full_vocab_the_teacher_leaves_the_advantages_to_the_reward():
    mixed = AlgorithmParams("grpo", n_samples=2, distill_coef=0.3, distill_loss="full_vocab").resolved()
    adv, _, metrics = AdvantageEstimator(mixed)(rows(), CTX)
    plain, _, _ = AdvantageEstimator(AlgorithmParams("grpo", n_samples=2).resolved())(rows(), CTX)
    assert torch.equal(adv, plain) and "distill_reverse_kl" in metrics and "distill_share" not in metrics


def test_the_teacher_call_also_writes_its_distributions_for_the_train_step():
    mfcs = {m.name: m for m in algorithm_mfcs("distill", use_ref=False, teacher_vocab=True)}
    assert mfcs["teacher_inf"].output_keys == ("teacher_logp", "teacher_vocab_logp")
    assert mfcs["teacher_inf"].output_key_remap["vocab_logp"] == "teacher_vocab_logp"
    assert "teacher_vocab_logp" in mfcs["actor_train"].input_keys
    assert "teacher_vocab_logp" not in {k for m in algorithm_mfcs("distill", use_ref=False) for k in m.output_keys}
    with pytest.raises(ValueError, match="teacher_vocab=True needs the teacher's call"):
        algorithm_graph("grpo", teacher_vocab=True)


def test_full_vocab_without_a_teacher_is_refused():
    with pytest.raises(ValueError, match="AlgorithmParams.distill_loss='full_vocab': no teacher is read"):
        AlgorithmParams("grpo", distill_loss="full_vocab")
    with pytest.raises(ValueError, match="AlgorithmParams.distill_divergence='forward': .* needs the teacher's whole"):
        AlgorithmParams("distill", distill_divergence="forward")
    with pytest.raises(ValueError, match="AlgorithmParams.distill_divergence='jsd': .* needs the teacher's whole"):
        AlgorithmParams("distill", distill_divergence="jsd")


def test_the_jsd_beta_is_refused_outside_0_1_and_without_the_jsd():
    full = {"distill_loss": "full_vocab", "distill_divergence": "jsd"}
    for beta in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match=f"AlgorithmParams.distill_jsd_beta={beta!r}; expected"):
            AlgorithmParams("distill", **full, distill_jsd_beta=beta)
    with pytest.raises(ValueError, match="AlgorithmParams.distill_jsd_beta=0.2: only distill_divergence jsd reads"):
        AlgorithmParams("distill", distill_loss="full_vocab", distill_divergence="forward", distill_jsd_beta=0.2)
    assert AlgorithmParams("distill", **full).resolved().distill_jsd_beta == 0.5
