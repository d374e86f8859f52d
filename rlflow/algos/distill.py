"""On-policy distillation: a frozen teacher's per-token log-probs of the student's own samples as
the learning signal (Agarwal et al. 2024 "GKD"; Thinking Machines' "on-policy distillation").

At each sampled token ``a_t`` the signal is the negative reverse-KL sample
``log pi_teacher(a_t) - log pi_student(a_t)``, undiscounted and without a gradient: the student
is pushed toward tokens the teacher finds likelier than it does. It is the whole advantage of the
``reverse_kl`` estimator (algorithm ``distill``), or ``distill_coef`` times it is added to a reward
estimator's advantages. With ``algorithm.distill_loss: full_vocab`` the teacher's whole next-token
distribution is read instead: the exact divergence at each sampled position is a loss term, the
reverse KL (:func:`vocab_reverse_kl`, a lower-variance form of the one-token estimate), the forward
KL (:func:`vocab_forward_kl`) or GKD's generalised Jensen-Shannon divergence between them
(:func:`vocab_jsd`), chosen by ``algorithm.distill_divergence`` (:func:`vocab_divergence`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlflow.algos.advantages import register_adv_estimator
from rlflow.algos.utils import masked_mean

__all__ = [
    "DEFAULT_JSD_BETA",
    "DISTILL_DIVERGENCES",
    "DISTILL_LOSSES",
    "distill_metrics",
    "distill_signal",
    "reverse_kl_advantages",
    "vocab_divergence",
    "vocab_forward_kl",
    "vocab_jsd",
    "vocab_log_probs",
    "vocab_reverse_kl",
]

# How the teacher's signal enters: ``sampled`` (the advantage of each sampled token) or ``full_vocab``
# (the exact KL over the vocabulary at each sampled position, a loss term).
DISTILL_LOSSES = ("sampled", "full_vocab")
# Which divergence over the vocabulary full_vocab takes: KL(student || teacher), KL(teacher || student),
# or the generalised Jensen-Shannon divergence JSD_beta between them (GKD).
DISTILL_DIVERGENCES = ("reverse", "forward", "jsd")
# JSD_beta's default weight of the teacher: the symmetric Jensen-Shannon divergence (TRL GKDConfig's beta).
DEFAULT_JSD_BETA = 0.5


def distill_signal(old_logp: Tensor, teacher_logp: Tensor, response_mask: Tensor) -> Tensor:
    """``(B, T)`` per-token advantage of distillation: ``log pi_teacher - log pi_student``, 0 outside the mask.

    Args:
        old_logp: ``(B, T)`` log-prob of each sampled token under the student that sampled it.
        teacher_logp: ``(B, T)`` log-prob of the same tokens under the teacher.
        response_mask: ``(B, T)`` 1 on the tokens the student sampled.

    >>> distill_signal(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -3.0]]), torch.tensor([[1.0, 0.0]]))
    tensor([[0.5000, 0.0000]])
    """
    if old_logp.shape != teacher_logp.shape or old_logp.shape != response_mask.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, teacher_logp {tuple(teacher_logp.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same shape"
        )
    diff = (teacher_logp.float() - old_logp.float()).detach()
    return torch.where(response_mask.bool(), diff, torch.zeros_like(diff))


@register_adv_estimator("reverse_kl")
def reverse_kl_advantages(response_mask: Tensor, old_logp: Tensor, teacher_logp: Tensor) -> tuple[Tensor, Tensor]:
    """On-policy distillation alone: advantages and returns are :func:`distill_signal` (discount 0,
    no baseline, no whitening); no reward is read.

    >>> m = torch.ones(1, 2)
    >>> reverse_kl_advantages(m, torch.tensor([[-1.0, -1.0]]), torch.tensor([[-0.2, -3.0]]))[0]
    tensor([[ 0.8000, -2.0000]])
    """
    signal = distill_signal(old_logp, teacher_logp, response_mask)
    return signal, signal.clone()


def distill_metrics(signal: Tensor, task_advantages: Tensor | None, coef: float, mask: Tensor) -> dict[str, float]:
    """The reverse KL to the teacher and the distillation's share of the advantage.

    Args:
        signal: ``(B, T)`` :func:`distill_signal`.
        task_advantages: ``(B, T)`` the reward estimator's advantages it is mixed with; None: none.
        coef: the weight of ``signal`` in the advantage.
        mask: ``(B, T)`` response mask.

    Returns:
        ``distill_reverse_kl``: mean over response tokens of ``log pi_student - log pi_teacher``
        (the k1 estimate of KL(student || teacher) per token); ``distill_share``: the signal's share
        of the advantage's magnitude, ``sum|coef * signal| / (sum|coef * signal| + sum|task|)`` over
        response tokens (1 alone, 0 when both are 0).

    >>> m = torch.ones(1, 2)
    >>> distill_metrics(torch.tensor([[-1.0, -1.0]]), torch.tensor([[2.0, 2.0]]), 0.5, m)
    {'distill_reverse_kl': 1.0, 'distill_share': 0.2}
    """
    mask = mask.float()
    weighted = float((coef * signal.abs() * mask).sum())
    task = 0.0 if task_advantages is None else float((task_advantages.float().abs() * mask).sum())
    total = weighted + task
    return {
        "distill_reverse_kl": float(-masked_mean(signal, mask)),
        "distill_share": weighted / total if total > 0 else (1.0 if task_advantages is None else 0.0),
    }


def vocab_log_probs(logits: Tensor) -> Tensor:
    """``(B, T, V)`` next-token log-probs aligned with the tokens: position ``t`` holds
    ``log_softmax(logits[:, t - 1])``, the distribution token ``t`` was drawn from; 0 at ``t = 0``.

    Args:
        logits: ``(B, T, V)`` a model's logits of a row of tokens (``logits[:, t]`` predicts token ``t + 1``).

    >>> vocab_log_probs(torch.zeros(1, 2, 2)).exp()[0, 1]
    tensor([0.5000, 0.5000])
    """
    # float32: the softmax of a bf16 forward loses the small probabilities the KL weighs.
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.nn.functional.pad(logp[:, :-1], (0, 0, 1, 0))


def _teacher_like(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """``teacher_logp`` detached, in the student's dtype; refuses a shape other than the student's."""
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(
            f"student_logp {tuple(student_logp.shape)} and teacher_logp {tuple(teacher_logp.shape)} must have the "
            "same (B, T, V) shape: the teacher must share the student's vocabulary"
        )
    return teacher_logp.detach().to(student_logp.dtype)


def vocab_reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """``(B, T)`` ``KL(pi_student || pi_teacher)`` over the whole vocabulary at each position:
    ``sum_v pi_student(v) (log pi_student(v) - log pi_teacher(v))``.

    The gradient flows through the student's log-probs only. Positions whose rows are all zeros in
    both (a sequence start, see :func:`vocab_log_probs`) give ``sum_v 1 * 0 = 0``; the caller masks
    the rest of the non-response positions.

    Args:
        student_logp: ``(B, T, V)`` :func:`vocab_log_probs` of the student (with its gradient).
        teacher_logp: ``(B, T, V)`` the same of the teacher, on the same tokens.

    >>> s = torch.log(torch.tensor([[[0.5, 0.5]]]))
    >>> round(float(vocab_reverse_kl(s, torch.log(torch.tensor([[[0.9, 0.1]]])))), 4)
    0.5108
    """
    teacher = _teacher_like(student_logp, teacher_logp)
    return (student_logp.exp() * (student_logp - teacher)).sum(-1)


def vocab_forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """``(B, T)`` ``KL(pi_teacher || pi_student)`` over the whole vocabulary at each position:
    ``sum_v pi_teacher(v) (log pi_teacher(v) - log pi_student(v))``, the cross-entropy to the teacher's
    distribution less its entropy. Shapes and masking as :func:`vocab_reverse_kl`.

    Unlike the reverse KL it weighs each token by the teacher's probability: the tokens the teacher
    all but excludes, whose log-probs span tens of nats, pull on the student no harder than in SFT.

    >>> s = torch.log(torch.tensor([[[0.5, 0.5]]]))
    >>> round(float(vocab_forward_kl(s, torch.log(torch.tensor([[[0.9, 0.1]]])))), 4)
    0.3681
    """
    teacher = _teacher_like(student_logp, teacher_logp)
    return (teacher.exp() * (teacher - student_logp)).sum(-1)


def vocab_jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """``(B, T)`` GKD's generalised Jensen-Shannon divergence over the whole vocabulary at each position:
    ``beta KL(pi_teacher || m) + (1 - beta) KL(pi_student || m)``, ``m = beta pi_teacher + (1 - beta) pi_student``.
    Shapes and masking as :func:`vocab_reverse_kl` (a sequence start, all zeros in both, gives 0 up to rounding).

    ``beta`` 0 and 1 are the forward and reverse KL (:func:`vocab_forward_kl`, :func:`vocab_reverse_kl`),
    as TRL's ``GKDTrainer`` takes them: the divergence itself tends to 0 there, as ``beta`` times the
    forward KL and ``1 - beta`` times the reverse KL. In between it is bounded (by ``log 2`` at 0.5):
    a token the teacher all but excludes costs the student its own mass times ``log(1 / (1 - beta))``,
    not the tens of nats of the reverse KL.

    Args:
        student_logp: ``(B, T, V)`` :func:`vocab_log_probs` of the student (with its gradient).
        teacher_logp: ``(B, T, V)`` the same of the teacher, on the same tokens.
        beta: the teacher's weight in the mixture ``m``, in ``[0, 1]``.

    >>> s = torch.log(torch.tensor([[[0.5, 0.5]]]))
    >>> round(float(vocab_jsd(s, torch.log(torch.tensor([[[0.9, 0.1]]])), 0.5)), 4)
    0.1017
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta!r}; expected 0 <= beta <= 1")
    if beta == 0.0:
        return vocab_forward_kl(student_logp, teacher_logp)
    if beta == 1.0:
        return vocab_reverse_kl(student_logp, teacher_logp)
    teacher = _teacher_like(student_logp, teacher_logp)
    # log m by log-sum-exp of the weighted log-probs: the mixture of two near-zero probabilities
    # underflows where its log does not.
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student_logp + math.log1p(-beta)]), dim=0)
    to_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    to_student = (student_logp.exp() * (student_logp - mixture)).sum(-1)
    return beta * to_teacher + (1.0 - beta) * to_student


def vocab_divergence(
    student_logp: Tensor, teacher_logp: Tensor, divergence: str, jsd_beta: float = DEFAULT_JSD_BETA
) -> Tensor:
    """``(B, T)`` the divergence named by ``algorithm.distill_divergence`` (:data:`DISTILL_DIVERGENCES`)
    of the student from the teacher at each position; ``jsd_beta`` is :func:`vocab_jsd`'s ``beta``.

    >>> s = torch.log(torch.tensor([[[0.5, 0.5]]]))
    >>> round(float(vocab_divergence(s, torch.log(torch.tensor([[[0.9, 0.1]]])), "forward")), 4)
    0.3681
    """
    if divergence == "reverse":  # KL(student || teacher)
        return vocab_reverse_kl(student_logp, teacher_logp)
    if divergence == "forward":  # KL(teacher || student)
        return vocab_forward_kl(student_logp, teacher_logp)
    if divergence == "jsd":  # beta KL(teacher || m) + (1 - beta) KL(student || m)
        return vocab_jsd(student_logp, teacher_logp, jsd_beta)
    raise ValueError(f"divergence={divergence!r}; expected one of {list(DISTILL_DIVERGENCES)}")
