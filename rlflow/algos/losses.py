"""Losses: PPO policy and value losses, entropy bonus, DPO, SFT and Bradley–Terry reward
losses, and the aggregation of a per-token loss matrix into a scalar.

Policy losses sit behind a registry (:func:`register_policy_loss`) because users add their
own; each takes ``(log_prob, old_log_prob, advantages, response_mask, **options)`` and returns
a :class:`PolicyLossOutput`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlflow.algos.utils import entropy_from_logits, logprobs_from_logits, masked_mean

__all__ = [
    "AMBIGUOUS_POLICY_LOSSES",
    "LOSS_AGG_MODES",
    "DPOLossOutput",
    "PolicyLossOutput",
    "agg_loss",
    "behaviour_weights",
    "bradley_terry_loss",
    "cispo_policy_loss",
    "dpo_loss",
    "entropy_bonus",
    "get_policy_loss",
    "gspo_policy_loss",
    "list_policy_losses",
    "logp_mismatch",
    "ppo_policy_loss",
    "register_policy_loss",
    "sft_loss",
    "unclipped_policy_loss",
    "value_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# exp() of a log-ratio beyond ±20 is either 0 or inf in practice; clamping keeps one stale
# token from turning the whole loss into NaN.
_MAX_LOG_RATIO = 20.0


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss_mat: ``(B, T)`` loss per token.
        mask: ``(B, T)`` 1 on tokens that count.
        mode: ``"token-mean"`` (every token weighs the same), ``"seq-mean-token-mean"`` (every
            sequence weighs the same; sequences without tokens are left out) or
            ``"seq-mean-token-sum"`` (sum over each sequence's tokens, mean over sequences).

    Returns:
        A scalar tensor.

    >>> loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]]); m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [round(agg_loss(loss, m, mode).item(), 4) for mode in LOSS_AGG_MODES]
    [1.75, 2.5, 3.5]
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must be equal (B, T) shapes")
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = (loss_mat * mask).sum(dim=-1)  # (B,)
    seq_len = mask.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        has_tokens = seq_len > 0
        return masked_mean(seq_sum / seq_len.clamp_min(1.0), has_tokens)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")


class PolicyLossOutput(NamedTuple):
    """What a policy loss returns; unpacks like a tuple."""

    loss: Tensor  # () the loss to backpropagate
    clip_fraction: Tensor  # () share of tokens where the ratio clip is active
    approx_kl: Tensor  # () k3 estimate of KL(pi_old || pi) over the masked tokens
    dual_clip_fraction: Tensor  # () share of tokens where the dual clip (A < 0) is active
    # further statistics of a loss (detached scalars), logged under their names
    metrics: Mapping[str, Tensor] = MappingProxyType({})


PolicyLossFn = Callable[..., PolicyLossOutput]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}
# Names other libraries give other losses: refused, never registered, with what to choose instead.
AMBIGUOUS_POLICY_LOSSES = {
    "vanilla": (
        "'vanilla' names two losses: verl's is PPO's clipped surrogate, rlflow's 'ppo' (with "
        "algorithm.dual_clip_c=3 for verl's default dual clip); the unclipped importance-weighted gradient "
        "-A * pi / pi_old is rlflow's 'unclipped'"
    ),
}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``; refuses duplicate names."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in AMBIGUOUS_POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is refused as ambiguous: {AMBIGUOUS_POLICY_LOSSES[name]}")
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered ({_POLICY_LOSSES[name].__qualname__})")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; ``KeyError`` lists the registered names."""
    if name in AMBIGUOUS_POLICY_LOSSES:
        raise KeyError(f"policy loss {AMBIGUOUS_POLICY_LOSSES[name]}")
    if name not in _POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; registered: {sorted(_POLICY_LOSSES)}")
    return _POLICY_LOSSES[name]


def list_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


@register_policy_loss("ppo")
def ppo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with the dual clip of Ye et al. (2020).

    With ``ratio = pi / pi_old``, the per-token loss is
    ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``; for ``A < 0`` it is further
    capped at ``-A * c``, so a token whose ratio exploded cannot dominate the batch.

    Args:
        log_prob: ``(B, T)`` log-probs under the policy being trained (carries gradient).
        old_log_prob: ``(B, T)`` log-probs under the policy that sampled the tokens.
        advantages: ``(B, T)`` advantage per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        clip_ratio_low: lower clip ``eps_low``.
        clip_ratio_high: upper clip ``eps_high`` (DAPO's clip-higher); ``None`` uses ``eps_low``.
        clip_ratio_c: dual-clip bound ``c > 1``; ``None`` disables the dual clip.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        A :class:`PolicyLossOutput`.

    >>> out = ppo_policy_loss(torch.log(torch.tensor([[1.5]])), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    >>> out.loss, out.clip_fraction  # ratio 1.5 clipped to 1.2 for A = 1
    (tensor(-1.2000), tensor(1.))
    """
    clip_ratio_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (the dual clip bounds ratios above 1)")
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B, T)
    ratio = log_ratio.exp()  # (B, T) pi / pi_old
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clip_fraction = masked_mean((clipped > unclipped).float(), response_mask)
    dual_clip_fraction = torch.zeros_like(clip_fraction)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        dual_active = (advantages < 0) & (loss_mat > dual_bound)
        loss_mat = torch.where(dual_active, dual_bound, loss_mat)
        dual_clip_fraction = masked_mean(dual_active.float(), response_mask)
    approx_kl = masked_mean((ratio - 1.0) - log_ratio, response_mask).detach()  # k3 of KL(pi_old || pi)
    return PolicyLossOutput(
        agg_loss(loss_mat, response_mask, loss_agg_mode), clip_fraction.detach(), approx_kl, dual_clip_fraction
    )


@register_policy_loss("unclipped")
def unclipped_policy_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean"
) -> PolicyLossOutput:
    """Unclipped importance-weighted policy gradient ``-A * pi / pi_old``.

    On-policy (one update per batch, ``log_prob == old_log_prob`` numerically) its gradient is
    REINFORCE's ``-A * grad log pi``; ReMax and RLOO are usually trained this way. (verl's
    ``vanilla`` is the clipped :func:`ppo_policy_loss`; rlflow refuses that name.)

    Args:
        log_prob: ``(B, T)`` log-probs under the policy being trained.
        old_log_prob: ``(B, T)`` log-probs under the sampling policy.
        advantages: ``(B, T)`` advantage per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        A :class:`PolicyLossOutput` (both clip fractions 0).

    >>> unclipped_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]), torch.ones(1, 2)).loss
    tensor(-2.)
    """
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    loss = agg_loss(-advantages * ratio, response_mask, loss_agg_mode)
    approx_kl = masked_mean((ratio - 1.0) - log_ratio, response_mask).detach()
    zero = loss.new_zeros(())
    return PolicyLossOutput(loss, zero, approx_kl, zero)


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): PPO's clip on a sequence-level, length-normalised ratio.

    ``s_i = exp(mean_t(log pi - log pi_old))`` over sequence ``i``'s response tokens; in the
    GSPO-token form each token carries ``s_it = sg(s_i) * pi_t / sg(pi_t)`` (value ``s_i``,
    gradient ``s_i * grad log pi_t``), and the per-token loss is
    ``max(-A_t * s_it, -A_t * clip(s_it, 1 - low, 1 + high))``. With one advantage per sequence
    and ``seq-mean-token-mean`` (the paper's mean over sequences) it is GSPO itself.

    Args:
        log_prob: ``(B, T)`` log-probs under the policy being trained (carries gradient).
        old_log_prob: ``(B, T)`` log-probs under the policy that sampled the tokens.
        advantages: ``(B, T)`` advantage per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        clip_ratio_low: lower clip of the sequence ratio (the paper uses 3e-4).
        clip_ratio_high: upper clip (the paper: 4e-4); ``None`` uses ``clip_ratio_low``.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        A :class:`PolicyLossOutput`; ``clip_fraction`` counts tokens (of clipped sequences),
        ``metrics`` holds ``seq_ratio_mean`` / ``seq_ratio_min`` / ``seq_ratio_max`` and
        ``seq_clip_fraction`` over the sequences with response tokens.

    >>> out = gspo_policy_loss(torch.log(torch.tensor([[2.0, 0.5]])), torch.zeros(1, 2), torch.ones(1, 2),
    ...                        torch.ones(1, 2))
    >>> out.loss, out.metrics["seq_ratio_mean"]  # s = exp((log 2 + log 0.5) / 2) = 1
    (tensor(-1.), tensor(1.))
    """
    clip_ratio_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,) log s_i
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # value log s_i
    seq_ratio = token_log_ratio.exp()  # (B, T) s_it
    unclipped = -advantages * seq_ratio
    clipped = -advantages * seq_ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).float()
    has_tokens = mask.sum(dim=-1) > 0  # (B,)
    s = seq_log_ratio.detach().exp()[has_tokens]  # sequences without tokens have no ratio
    metrics = dict.fromkeys(("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "seq_clip_fraction"), s.new_zeros(()))
    if s.numel():
        seq_clipped = (is_clipped * mask).sum(dim=-1)[has_tokens] > 0  # a token of the sequence was clipped
        metrics.update(
            seq_ratio_mean=s.mean(),
            seq_ratio_min=s.min(),
            seq_ratio_max=s.max(),
            seq_clip_fraction=seq_clipped.float().mean(),
        )
    approx_kl = masked_mean(log_ratio.exp() - 1.0 - log_ratio, mask).detach()
    clip_fraction = masked_mean(is_clipped, mask).detach()
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode)
    return PolicyLossOutput(loss, clip_fraction, approx_kl, torch.zeros_like(clip_fraction), metrics)


@register_policy_loss("cispo")
def cispo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    loss_agg_mode: str = "token-mean",
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by a clipped, stop-gradient importance ratio.

    The per-token loss is ``-sg(clip(r_t, 1 - low, 1 + high)) * A_t * log pi_t`` with
    ``r_t = pi_t / pi_old_t``: a clipped token still carries gradient (its weight is bounded),
    where PPO's clip drops it.

    Args:
        log_prob: ``(B, T)`` log-probs under the policy being trained (carries gradient).
        old_log_prob: ``(B, T)`` log-probs under the policy that sampled the tokens.
        advantages: ``(B, T)`` advantage per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        clip_ratio_low: the weight is kept above ``1 - clip_ratio_low``.
        clip_ratio_high: the weight is kept below ``1 + clip_ratio_high``; ``None`` uses ``clip_ratio_low``.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        A :class:`PolicyLossOutput`; ``clip_fraction`` is the share of tokens whose weight was
        clipped, ``metrics`` holds ``is_weight_mean`` (after clipping).

    >>> out = cispo_policy_loss(torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]])),
    ...                         torch.ones(1, 1), torch.ones(1, 1))
    >>> out.loss, out.clip_fraction  # r = 2 clipped to 1.2: -1.2 * 1 * log 0.5
    (tensor(0.8318), tensor(1.))
    """
    clip_ratio_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_prob - old_log_prob).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()  # (B, T), no gradient
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = agg_loss(-weight * advantages * log_prob, response_mask, loss_agg_mode)
    clip_fraction = masked_mean((weight != ratio).float(), response_mask)
    approx_kl = masked_mean((ratio - 1.0) - log_ratio, response_mask)
    metrics = {"is_weight_mean": masked_mean(weight, response_mask)}
    return PolicyLossOutput(loss, clip_fraction, approx_kl, torch.zeros_like(clip_fraction), metrics)


def behaviour_weights(
    prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_prox / pi_behaviour, cap)`` per token, and their statistics.

    Args:
        prox_logp: log-probs under the proximal policy (the weights before this update), ``(b, t)``.
        behaviour_logp: log-probs under the policy that sampled the tokens (the rollout's), ``(b, t)``.
        mask: the tokens that count (response tokens).
        cap: the truncation; the weight is detached (it corrects the sampling, not the gradient's direction).

    Returns:
        ``(weights, metrics)``: ``is_weight_mean`` / ``is_weight_max`` (before truncation),
        ``is_truncated_fraction`` (tokens whose weight hit ``cap``) and ``behaviour_kl`` (k3 estimate
        of KL(behaviour || proximal) over the masked tokens).

    >>> w, m = behaviour_weights(torch.log(torch.tensor([[0.5, 0.4]])), torch.log(torch.tensor([[0.5, 0.1]])),
    ...                          torch.ones(1, 2), cap=2.0)
    >>> w.tolist(), m["is_truncated_fraction"]
    ([[1.0, 2.0]], 0.5)
    """
    log_ratio = (prox_logp - behaviour_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    real = mask.bool()
    weights = torch.where(real, ratio.clamp(max=cap), torch.zeros_like(ratio))
    count = real.sum().clamp(min=1)
    metrics = {
        "is_weight_mean": float(ratio[real].sum() / count),
        "is_weight_max": float(ratio[real].max()) if bool(real.any()) else 0.0,
        "is_truncated_fraction": float((ratio[real] > cap).sum() / count),
        "behaviour_kl": float(masked_mean((ratio - 1.0) - log_ratio, mask)),
    }
    return weights, metrics


def logp_mismatch(recomputed: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far a rollout engine's log-probs are from the trainer's recomputed ones, over the masked tokens.

    Args:
        recomputed: log-probs of the sampled tokens under the training engine, ``(b, t)``.
        rollout: the rollout engine's log-probs of the same tokens, ``(b, t)``.
        mask: the tokens that count (response tokens).

    Returns:
        ``logp_mismatch_mean`` and ``logp_mismatch_max``: the mean and the largest ``|recomputed - rollout|``
        (nats; 0 without masked tokens).

    >>> logp_mismatch(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.0, 0.0]]), torch.tensor([[1, 1, 0]]))
    {'logp_mismatch_mean': 0.25, 'logp_mismatch_max': 0.5}
    """
    real = mask.bool()
    delta = (recomputed.detach().float() - rollout.float()).abs()[real]
    if delta.numel() == 0:
        return {"logp_mismatch_mean": 0.0, "logp_mismatch_max": 0.0}
    return {"logp_mismatch_mean": float(delta.mean()), "logp_mismatch_max": float(delta.max())}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range_value: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old ± eps) - R)^2)``.

    Args:
        values: ``(B, T)`` critic predictions being trained.
        old_values: ``(B, T)`` predictions at rollout time.
        returns: ``(B, T)`` regression targets.
        response_mask: ``(B, T)`` 1 on response tokens.
        clip_range_value: ``eps``; ``None`` gives the plain squared error.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``(loss, clip_fraction)``: scalars; ``clip_fraction`` is the share of tokens where the
        clipped branch is the larger one.

    >>> value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    (tensor(2.), tensor(0.))
    """
    errors = (values - returns).square()  # (B, T)
    if clip_range_value is None:
        return 0.5 * agg_loss(errors, response_mask, loss_agg_mode), values.new_zeros(())
    clipped_values = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    clipped_errors = (clipped_values - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(errors, clipped_errors), response_mask, loss_agg_mode)
    clip_fraction = masked_mean((clipped_errors > errors).float(), response_mask).detach()
    return loss, clip_fraction


def entropy_bonus(logits: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """Mean policy entropy over the response tokens, to be *subtracted* from the loss as
    ``loss - entropy_coef * entropy_bonus(...)``.

    Args:
        logits: ``(B, T, V)`` policy logits at the response positions.
        response_mask: ``(B, T)`` 1 on response tokens.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        A scalar tensor, in nats.

    >>> entropy_bonus(torch.zeros(1, 1, 2), torch.ones(1, 1))  # uniform over 2 tokens
    tensor(0.6931)
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


class DPOLossOutput(NamedTuple):
    losses: Tensor  # (B,) loss of each preference pair; .mean() to backpropagate
    chosen_rewards: Tensor  # (B,) implicit reward beta * (log pi - log pi_ref) of the chosen
    rejected_rewards: Tensor  # (B,) the same for the rejected response


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOLossOutput:
    """Direct preference optimisation (Rafailov et al. 2023) and IPO (Azar et al. 2023).

    With ``h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l))``:
    ``sigmoid``: ``-log sigmoid(beta * h)`` (with label smoothing ``e``:
    ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)``);
    ``ipo``: ``(h - 1 / (2 * beta))^2``.

    Args:
        policy_chosen_logps: ``(B,)`` summed log-prob of each chosen response under the policy.
        policy_rejected_logps: ``(B,)`` the same for the rejected responses.
        ref_chosen_logps: ``(B,)`` chosen responses under the reference model.
        ref_rejected_logps: ``(B,)`` rejected responses under the reference model.
        beta: inverse temperature (DPO) or regularisation strength (IPO).
        loss_type: ``"sigmoid"`` or ``"ipo"``.
        label_smoothing: assumed label-noise rate for ``sigmoid`` (cDPO), in ``[0, 0.5)``.

    Returns:
        A :class:`DPOLossOutput`.

    >>> z = torch.zeros(1)
    >>> dpo_loss(z, z, z, z).losses  # no preference yet: log 2
    tensor([0.6931])
    """
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)  # (B,)
    if loss_type == "sigmoid":
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5)")
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected 'sigmoid' or 'ipo'")
    chosen_rewards = (beta * (policy_chosen_logps - ref_chosen_logps)).detach()
    rejected_rewards = (beta * (policy_rejected_logps - ref_rejected_logps)).detach()
    return DPOLossOutput(losses, chosen_rewards, rejected_rewards)


def sft_loss(logits: Tensor, labels: Tensor, loss_mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """Cross-entropy of ``labels`` under ``logits`` over the tokens of ``loss_mask``.

    ``logits[:, t]`` scores ``labels[:, t]``: for next-token prediction over ``input_ids``
    call ``sft_loss(logits[:, :-1], input_ids[:, 1:], loss_mask[:, 1:])``.

    Args:
        logits: ``(B, T, V)`` model outputs.
        labels: ``(B, T)`` target token ids.
        loss_mask: ``(B, T)`` 1 on target tokens (e.g. the answer, not the prompt or padding).
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        A scalar tensor, in nats per token for ``token-mean``.

    >>> sft_loss(torch.zeros(1, 2, 4), torch.tensor([[1, 3]]), torch.tensor([[0, 1]]))  # uniform: log 4
    tensor(1.3863)
    """
    return agg_loss(-logprobs_from_logits(logits, labels), loss_mask, loss_agg_mode)


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None) -> Tensor:
    """Pairwise reward-model loss ``-log sigmoid(r_chosen - r_rejected - margin)``, averaged.

    Args:
        chosen_rewards: ``(B,)`` scalar reward of each preferred response.
        rejected_rewards: ``(B,)`` scalar reward of each dispreferred response.
        margin: optional ``(B,)`` required gap (Llama 2's margin loss).

    Returns:
        A scalar tensor.

    >>> bradley_terry_loss(torch.tensor([1.0]), torch.tensor([1.0]))
    tensor(0.6931)
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(f"chosen {tuple(chosen_rewards.shape)} and rejected {tuple(rejected_rewards.shape)} differ")
    gap = chosen_rewards - rejected_rewards
    if margin is not None:
        gap = gap - margin
    return -F.logsigmoid(gap).mean()
