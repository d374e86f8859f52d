"""DAPO's overlong handling: a soft length penalty near the generation limit, and which samples
the limit cut off (truncated: no stop token), so that the policy loss can leave them out."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["overlong_penalty", "response_lengths", "truncated_rows"]


def response_lengths(response_mask: Tensor) -> Tensor:
    """``(N,)`` int64: the number of response tokens of each row of ``response_mask`` ``(N, T)``."""
    return response_mask.bool().sum(dim=1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment of each response (added to its reward).

    ``0`` up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at ``max_len``
    (and held there beyond it): ``-factor * clamp((length - (max_len - buffer)) / buffer, 0, 1)``.

    Args:
        lengths: ``(N,)`` response lengths in tokens.
        max_len: the generation limit (``rollout.max_new_tokens``).
        buffer: tokens before ``max_len`` over which the penalty grows; ``1 <= buffer <= max_len``.
        factor: the penalty at ``max_len``.

    Returns:
        ``(N,)`` float32 penalties in ``[-factor, 0]``.

    >>> overlong_penalty(torch.tensor([4, 6, 7, 8]), max_len=8, buffer=4)
    tensor([ 0.0000, -0.5000, -0.7500, -1.0000])
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer} must be in [1, max_len={max_len}]")
    excess = (lengths.float() - (max_len - buffer)) / buffer
    return 0.0 - factor * excess.clamp(0.0, 1.0)  # 0 - x, not -x: no -0.0 below the buffer


def truncated_rows(input_ids: Tensor, response_mask: Tensor, max_len: int, stop_token_ids: Sequence[int]) -> Tensor:
    """``(N,)`` bool: the responses the generation limit cut off.

    A response is truncated when it holds ``max_len`` tokens and its last one is not a stop
    token (a response that ends on its stop token exactly at the limit finished).

    Args:
        input_ids: ``(N, T)`` token ids, aligned with ``response_mask``.
        response_mask: ``(N, T)`` 1 on response tokens.
        max_len: the generation limit (``rollout.max_new_tokens``).
        stop_token_ids: the tokens that end a response.

    >>> ids = torch.tensor([[5, 7, 2], [5, 7, 9], [5, 2, 0]]); mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 0]])
    >>> truncated_rows(ids, mask, max_len=2, stop_token_ids=[2])
    tensor([False,  True, False])
    """
    mask = response_mask.bool()
    width = mask.shape[1]
    last = width - 1 - mask.flip(dims=[1]).int().argmax(dim=1)  # (N,) column of the last response token
    last_token = input_ids.gather(1, last[:, None]).squeeze(1)
    stopped = torch.isin(last_token, torch.tensor(list(stop_token_ids), dtype=input_ids.dtype))
    return (response_lengths(mask) >= max_len) & ~stopped
