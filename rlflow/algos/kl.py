"""KL divergence to the reference policy: per-token estimators, the penalty in the reward or
in the loss, and the fixed and adaptive coefficient controllers.

The estimators approximate ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman 2020,
"Approximating KL divergence"): with ``log r = log pi_ref(y) - log pi(y)``,

- ``k1 = -log r``: unbiased, high variance, can be negative per token;
- ``k2 = (log r)^2 / 2``: biased, low variance, non-negative;
- ``k3 = (r - 1) - log r``: unbiased, low variance, non-negative.

``k1+`` and ``k3+`` are straight-through variants for the KL loss (verl's ``k3+``): the value of
``k1`` / ``k3`` with the gradient of ``k2``, whose expected gradient under samples of ``pi`` is
the gradient of ``KL(pi || pi_ref)`` (those of ``k1`` and ``k3`` are not).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rlflow.algos.losses import agg_loss
from rlflow.algos.utils import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "apply_kl_penalty",
    "build_kl_controller",
    "kl_estimate",
    "kl_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+")

# exp() of a log-ratio beyond ±20 overflows fp16 and dominates any batch; such tokens are
# clamped rather than allowed to produce inf.
_MAX_LOG_RATIO = 20.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)``.

    Args:
        logp: ``(B, T)`` log-prob of the sampled tokens under the policy.
        ref_logp: ``(B, T)`` log-prob of the same tokens under the reference.
        estimator: ``"k1"``, ``"k2"``, ``"k3"``, or ``"k1+"`` / ``"k3+"`` (value of ``k1`` / ``k3``,
            gradient of ``k2``).

    Returns:
        ``(B, T)`` estimates (not masked).

    Raises:
        ValueError: unknown estimator.

    >>> kl_estimate(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), "k3")  # e^-1 - 1 + 1
    tensor([[0.3679]])
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must have the same shape")
    if estimator in ("k1+", "k3+"):
        value = kl_estimate(logp, ref_logp, estimator[:-1]).detach()
        k2 = kl_estimate(logp, ref_logp, "k2")
        return k2 - k2.detach() + value  # straight-through: forward value, k2's gradient
    log_ratio = logp - ref_logp  # log pi - log pi_ref
    if estimator == "k1":
        return log_ratio  # k1 = log pi - log pi_ref
    if estimator == "k2":
        return 0.5 * log_ratio.square()  # k2 = (log pi - log pi_ref)^2 / 2
    if estimator == "k3":
        ref_log_ratio = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return ref_log_ratio.exp() - 1 - ref_log_ratio  # k3 = pi_ref/pi - 1 - log(pi_ref/pi)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def apply_kl_penalty(
    token_rewards: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, kl_coef: float, estimator: str = "k1"
) -> tuple[Tensor, Tensor]:
    """Subtract ``kl_coef * KL`` from every response token's reward (KL in the reward, as in
    InstructGPT-style PPO).

    Args:
        token_rewards: ``(B, T)`` reward per token (typically the outcome reward on the last
            token, 0 elsewhere).
        logp: ``(B, T)`` policy log-probs of the response tokens (at rollout time).
        ref_logp: ``(B, T)`` reference log-probs of the same tokens.
        mask: ``(B, T)`` 1 on response tokens.
        kl_coef: penalty coefficient (from a :class:`KLController`).
        estimator: see :func:`kl_estimate`.

    Returns:
        ``(rewards, mean_kl)``: the penalised ``(B, T)`` rewards (0 outside the mask) and a
        scalar — the batch mean of the per-sequence mean KL, what an adaptive controller
        tracks.

    >>> r = torch.tensor([[0.0, 1.0]])
    >>> apply_kl_penalty(r, torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -1.0]]), torch.ones(1, 2), 0.1)
    (tensor([[-0.1000,  1.0000]]), tensor(0.5000))
    """
    if token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and mask {tuple(mask.shape)} must match")
    kl = kl_estimate(logp, ref_logp, estimator) * mask  # (B, T)
    rewards = (token_rewards - kl_coef * kl) * mask
    mean_kl = masked_mean(kl, mask, dim=-1).mean()
    return rewards, mean_kl


def kl_loss(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str = "k3", loss_agg_mode: str = "token-mean"
) -> Tensor:
    """KL penalty as a loss term (GRPO-style), to be added as ``kl_coef * kl_loss(...)``.

    Args:
        logp: ``(B, T)`` log-probs under the policy being trained (carries gradient).
        ref_logp: ``(B, T)`` reference log-probs.
        mask: ``(B, T)`` 1 on response tokens.
        estimator: see :func:`kl_estimate`; ``k3`` is the usual choice here.
        loss_agg_mode: see :func:`rlflow.algos.losses.agg_loss`.

    Returns:
        A scalar tensor.

    >>> kl_loss(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    tensor(0.)
    """
    return agg_loss(kl_estimate(logp, ref_logp, estimator), mask, loss_agg_mode)


class KLController:
    """Holds the KL coefficient ``value``; ``update`` is called once per training step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError


@dataclass
class FixedKLController(KLController):
    """A constant coefficient.

    >>> FixedKLController(0.05).value
    0.05
    """

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""


@dataclass
class AdaptiveKLController(KLController):
    """The adaptive coefficient of Ziegler et al. (2019): push the observed KL toward
    ``target_kl``, moving the coefficient by at most ±20% per ``horizon`` samples.

    ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + error * n_steps / horizon``.

    Args:
        value: initial coefficient.
        target_kl: the KL (nats per sequence token average) to hold.
        horizon: samples over which a ±20% error changes the coefficient by ±20%.

    >>> ctl = AdaptiveKLController(0.1, target_kl=1.0, horizon=100)
    >>> ctl.update(current_kl=2.0, n_steps=50); round(ctl.value, 4)
    0.11
    """

    value: float
    target_kl: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(f"target_kl={self.target_kl} and horizon={self.horizon} must be positive")

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """Build a ``"fixed"`` or ``"adaptive"`` controller starting at ``kl_coef``.

    >>> build_kl_controller("adaptive", 0.1, target_kl=6.0, horizon=10000).value
    0.1
    """
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(f"an adaptive KL controller needs target_kl and horizon, got {target_kl}, {horizon}")
        return AdaptiveKLController(kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; expected 'fixed' or 'adaptive'")
