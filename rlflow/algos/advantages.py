"""Advantage estimators: GAE, GRPO, RLOO, ReMax and REINFORCE++, behind a small registry.

Every estimator takes ``token_level_rewards`` ``(B, T)`` — the reward of each response
token, usually zero except the last one (the outcome reward, minus a KL penalty when one is
applied in the reward) — and ``response_mask`` ``(B, T)``, plus the inputs it needs
(``values``, ``index``, ``baseline_rewards``, ``gamma``, ``lam``). It returns
``(advantages, returns)``, both ``(B, T)`` and zero outside the mask.

Users add estimators with :func:`register_adv_estimator`; the trainer calls
:func:`compute_advantages`, which hands each estimator the inputs it declares.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlflow.algos.utils import masked_whiten

__all__ = [
    "compute_advantages",
    "discounted_returns",
    "gae_advantages",
    "get_adv_estimator",
    "grpo_advantages",
    "list_adv_estimators",
    "register_adv_estimator",
    "reinforce_plus_plus_advantages",
    "remax_advantages",
    "rloo_advantages",
]

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
_ADV_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADV_ESTIMATORS:
            raise ValueError(
                f"advantage estimator {name!r} is already registered ({_ADV_ESTIMATORS[name].__qualname__})"
            )
        _ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvantageFn:
    """The estimator registered under ``name``; ``KeyError`` lists the registered names."""
    if name not in _ADV_ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_ADV_ESTIMATORS)}")
    return _ADV_ESTIMATORS[name]


def list_adv_estimators() -> list[str]:
    return sorted(_ADV_ESTIMATORS)


def compute_advantages(name: str, **inputs: Any) -> tuple[Tensor, Tensor]:
    """Run estimator ``name`` on the subset of ``inputs`` it declares as parameters.

    The trainer passes everything it has (``values`` exists only with a critic, ``index``
    only with grouped rollouts), so inputs an estimator does not take are dropped here;
    a parameter it needs but did not get raises ``TypeError``.

    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]]); m = torch.ones(2, 2)
    >>> compute_advantages("grpo", token_level_rewards=r, response_mask=m, index=[0, 0], gamma=1.0)[0]
    tensor([[ 0.7071,  0.7071],
            [-0.7071, -0.7071]])
    """
    fn = get_adv_estimator(name)
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**inputs)
    return fn(**{key: value for key, value in inputs.items() if key in params})


@register_adv_estimator("gae")
def gae_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where ``t + 1`` is the next *masked* token and the value after the last one is 0.

    Args:
        token_level_rewards: ``(B, T)`` reward per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        values: ``(B, T)`` critic values ``V_t``.
        gamma: discount factor.
        lam: GAE lambda (1 gives Monte-Carlo returns minus values, 0 one-step TD).
        whiten: normalise the advantages batch-wide over the mask (PPO's usual practice).

    Returns:
        ``(advantages, returns)``, each ``(B, T)``; ``returns = advantages + values`` before
        whitening (the critic's regression target).

    >>> r = torch.tensor([[0.0, 1.0]]); v = torch.tensor([[0.5, 0.5]]); m = torch.ones(1, 2)
    >>> gae_advantages(r, m, v, gamma=1.0, lam=1.0, whiten=False)
    (tensor([[0.5000, 0.5000]]), tensor([[1., 1.]]))
    """
    _check_shapes(token_level_rewards, response_mask, values=values)
    mask = response_mask.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(token_level_rewards[:, 0])  # (B,) V of the next masked token
    last_adv = torch.zeros_like(next_value)  # (B,) A of the next masked token
    advantages = torch.zeros_like(token_level_rewards)  # (B, T)
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        # Unmasked positions (padding inside the response) carry the recursion through unchanged.
        next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
        last_adv = mask[:, t] * adv_t + (1 - mask[:, t]) * last_adv
        advantages[:, t] = last_adv
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns


@register_adv_estimator("grpo")
def grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | np.ndarray | Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages (Shao et al. 2024): each response's outcome reward minus
    its group's mean, divided by the group's std when ``norm_by_std`` (Dr. GRPO drops it).

    The outcome reward of a response is the sum of its token rewards. A group of one has no
    relative signal and gets advantage 0.

    Args:
        token_level_rewards: ``(B, T)`` reward per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        index: ``(B,)`` group id (uid of the prompt) of each response; any hashable values.
        norm_by_std: divide by the group's unbiased standard deviation (+ ``eps``).
        eps: keeps groups with equal rewards finite (their advantage is 0).

    Returns:
        ``(advantages, returns)``, each ``(B, T)``; the per-sequence advantage broadcast over
        the mask, and ``returns`` equal to it (there is no critic).

    >>> r = torch.tensor([[1.0], [0.0], [5.0]])
    >>> grpo_advantages(r, torch.ones(3, 1), index=["a", "a", "b"])[0].squeeze(-1)
    tensor([ 0.7071, -0.7071,  0.0000])
    """
    _check_shapes(token_level_rewards, response_mask)
    scores = (token_level_rewards * response_mask).sum(dim=-1)  # (B,) outcome reward
    advantages = torch.zeros_like(scores)  # (B,)
    for rows in _groups(index, scores.shape[0]).values():
        group = scores[rows]
        if len(rows) == 1:
            continue
        centred = group - group.mean()
        advantages[rows] = centred / (group.std() + eps) if norm_by_std else centred
    token_adv = advantages.unsqueeze(-1) * response_mask  # (B, T)
    return token_adv, token_adv


@register_adv_estimator("rloo")
def rloo_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | np.ndarray | Tensor
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each response's outcome reward minus
    the mean reward of the *other* responses of its group.

    Args:
        token_level_rewards: ``(B, T)`` reward per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        index: ``(B,)`` group id of each response; every group needs at least 2 members.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, the per-sequence advantage broadcast.

    Raises:
        ValueError: a group has a single response (its leave-one-out baseline is undefined).

    >>> r = torch.tensor([[3.0], [1.0], [2.0]])
    >>> rloo_advantages(r, torch.ones(3, 1), index=[0, 0, 0])[0].squeeze(-1)
    tensor([ 1.5000, -1.5000,  0.0000])
    """
    _check_shapes(token_level_rewards, response_mask)
    scores = (token_level_rewards * response_mask).sum(dim=-1)  # (B,)
    advantages = torch.zeros_like(scores)
    for group_id, rows in _groups(index, scores.shape[0]).items():
        if len(rows) < 2:
            raise ValueError(f"rloo: group {group_id!r} has 1 response; leave-one-out needs at least 2")
        group = scores[rows]
        baseline = (group.sum() - group) / (len(rows) - 1)  # mean of the others
        advantages[rows] = group - baseline
    token_adv = advantages.unsqueeze(-1) * response_mask
    return token_adv, token_adv


@register_adv_estimator("remax")
def remax_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, baseline_rewards: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the reward of a greedy rollout of the
    same prompt.

    Args:
        token_level_rewards: ``(B, T)`` reward per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        baseline_rewards: ``(B,)`` outcome reward of the greedy response to each prompt.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``; ``returns[t]`` is the undiscounted sum
        of rewards from ``t`` on.

    >>> remax_advantages(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), torch.tensor([0.25]))[0]
    tensor([[0.7500, 0.7500]])
    """
    _check_shapes(token_level_rewards, response_mask)
    if baseline_rewards.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"baseline_rewards {tuple(baseline_rewards.shape)} must be ({token_level_rewards.shape[0]},)")
    returns = discounted_returns(token_level_rewards, response_mask, gamma=1.0)  # (B, T)
    advantages = returns - baseline_rewards.unsqueeze(-1) * response_mask
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the whole batch.

    Args:
        token_level_rewards: ``(B, T)`` reward per token (KL penalty usually included).
        response_mask: ``(B, T)`` 1 on response tokens.
        gamma: discount factor.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``; ``returns`` before whitening.

    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    >>> reinforce_plus_plus_advantages(r, torch.ones(2, 2))[0]
    tensor([[ 0.8660,  0.8660],
            [-0.8660, -0.8660]])
    """
    _check_shapes(token_level_rewards, response_mask)
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def discounted_returns(token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` over masked tokens, 0 outside the mask.

    Args:
        token_level_rewards: ``(B, T)`` reward per token.
        response_mask: ``(B, T)`` 1 on response tokens.
        gamma: discount factor.

    Returns:
        ``(B, T)`` returns.

    >>> discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.ones(1, 3), gamma=0.5)
    tensor([[1.5000, 1.0000, 2.0000]])
    """
    mask = response_mask.to(token_level_rewards.dtype)
    running = torch.zeros_like(token_level_rewards[:, 0])  # (B,)
    returns = torch.zeros_like(token_level_rewards)  # (B, T)
    for t in reversed(range(token_level_rewards.shape[1])):
        # Unmasked positions pass the running return through without discounting it.
        running = mask[:, t] * (token_level_rewards[:, t] + gamma * running) + (1 - mask[:, t]) * running
        returns[:, t] = running
    return returns * mask


def _groups(index: Sequence[Any] | np.ndarray | Tensor, batch_size: int) -> dict[Any, list[int]]:
    """Row numbers of each group id, in first-seen order."""
    ids = index.tolist() if isinstance(index, (Tensor, np.ndarray)) else list(index)
    if len(ids) != batch_size:
        raise ValueError(f"index has {len(ids)} entries for a batch of {batch_size} responses")
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, group_id in enumerate(ids):
        groups[group_id].append(row)
    return groups


def _check_shapes(token_level_rewards: Tensor, response_mask: Tensor, **others: Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be (B, T), got {tuple(token_level_rewards.shape)}")
    for name, tensor in {"response_mask": response_mask, **others}.items():
        if tensor.shape != token_level_rewards.shape:
            raise ValueError(
                f"{name} {tuple(tensor.shape)} must match token_level_rewards {tuple(token_level_rewards.shape)}"
            )
