"""Masked reductions and log-probability helpers shared by the advantage estimators and losses.

Shapes follow one convention across ``rlflow.algos``: ``B`` sequences, ``T`` response tokens,
``V`` vocabulary entries. A *mask* is a ``(B, T)`` tensor of 0/1 (bool, int or float) marking
the tokens that count; padding and prompt tokens carry 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["entropy_from_logits", "logprobs_from_logits", "masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set.

    Args:
        values: any shape.
        mask: same shape as ``values`` (0/1).
        dim: dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked sum, reduced over ``dim``.

    >>> masked_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 0, 1]))
    tensor(4.)
    """
    _check_same_shape(values, mask)
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set.

    An all-zero mask gives 0 rather than NaN, so an empty micro-batch adds nothing to a loss.

    Args:
        values: any shape.
        mask: same shape as ``values`` (0/1).
        dim: dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked mean, reduced over ``dim``.

    >>> masked_mean(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    tensor(1.5000)
    """
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    total = masked_sum(values, mask, dim)
    return torch.where(count > 0, total / torch.where(count > 0, count, 1.0), 0.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the positions where ``mask`` is set (all positions pooled).

    Args:
        values: any shape.
        mask: same shape as ``values`` (0/1).
        unbiased: apply Bessel's correction ``n / (n - 1)``.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: the mask selects no element, or one element with ``unbiased=True``.

    >>> masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]))
    tensor(2.)
    """
    count = mask.to(values.dtype).sum()
    if count.item() == 0:
        raise ValueError("masked_var: the mask selects no element")
    if unbiased and count.item() == 1:
        raise ValueError("masked_var: the mask selects a single element; the unbiased variance is undefined")
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return variance * count / (count - 1) if unbiased else variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``values`` to zero mean and unit variance over the masked positions.

    Mean and (unbiased) variance are pooled over every masked element of the batch, as PPO
    implementations whiten advantages batch-wide rather than per sequence.

    Args:
        values: any shape.
        mask: same shape as ``values`` (0/1).
        shift_mean: subtract the mean; ``False`` only rescales (keeps the mean).
        eps: added to the variance before the square root.

    Returns:
        Tensor of the shape of ``values``; unmasked positions are transformed too (callers
        multiply by the mask when they need zeros there).

    >>> masked_whiten(torch.tensor([1.0, 3.0]), torch.tensor([1, 1]))
    tensor([-0.7071,  0.7071])
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under ``softmax(logits)``.

    Args:
        logits: ``(..., V)`` unnormalised scores; ``logits[..., t, :]`` scores ``labels[..., t]``
            (shift before calling for next-token prediction).
        labels: ``(...)`` integer token ids.

    Returns:
        ``(...)`` float log-probabilities in the dtype of ``logits`` for fp32/fp64 input, fp32
        for fp16/bf16 input.

    >>> logits = torch.log(torch.tensor([[0.25, 0.75]]))
    >>> logprobs_from_logits(logits, torch.tensor([1])).exp()
    tensor([0.7500])
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree before the vocab dim")
    labels = labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        # log p(y) = z_y - logsumexp(z): only (...) values are materialised, never the
        # (..., V) log-softmax, which for a 150k vocabulary is the largest tensor of the step.
        return logits.gather(-1, labels).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # logsumexp in fp16/bf16 loses too many digits; upcast one row of the batch at a time so
    # the fp32 copy stays the size of one sequence.
    if logits.dim() == 1:
        return logprobs_from_logits(logits.unsqueeze(0), labels.squeeze(-1).unsqueeze(0)).squeeze(0)
    rows = [
        torch.log_softmax(row.float(), dim=-1).gather(-1, row_labels).squeeze(-1)
        for row, row_labels in zip(logits, labels)
    ]
    return torch.stack(rows)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` along the last dim.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which never takes the log of a
    probability and so stays finite where a probability underflows to 0.

    Args:
        logits: ``(..., V)`` unnormalised scores.

    Returns:
        ``(...)`` entropies in nats (fp32 for fp16/bf16 input).

    >>> entropy_from_logits(torch.zeros(1, 4))  # uniform over 4 tokens: log 4
    tensor([1.3863])
    """
    if logits.dtype in (torch.float32, torch.float64):
        return _entropy(logits)
    # As in ``logprobs_from_logits``: low precision is upcast one batch row at a time.
    if logits.dim() == 1:
        return _entropy(logits.float())
    return torch.stack([_entropy(row.float()) for row in logits])


def _entropy(logits: Tensor) -> Tensor:
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def _check_same_shape(values: Tensor, mask: Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
