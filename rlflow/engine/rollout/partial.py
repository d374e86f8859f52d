"""Partial (interruptible) rollouts: the tensor work of sampling a response over several calls.

With ``rollout.partial_tokens`` N a generate call samples at most N new tokens per response. A
response that neither stopped nor reached ``max_new_tokens`` is carried to a later call, which
prefills its prompt and the tokens sampled so far under that call's weights (a KV cache cannot
outlive a weight change) and samples on. Tokens already sampled stay as they were, with their
log-probs and the version of the weights that sampled them (``token_version``), so the decoupled
correction weighs every token against the weights that actually sampled it.

Rows are rollout rows (:func:`rlflow.workers.interfaces.actor.rollout_rows`), all ``(M, P+R)``:
``input_ids``, ``attention_mask``, ``response_mask``, ``old_logp`` and ``token_version``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlflow.dataflow.algorithms import TOKEN_VERSION

__all__ = ["TOKEN_VERSION", "PartialCall", "append_tokens", "prefix_prompts", "unfinished_rows", "widen_rows"]


@dataclass(frozen=True)
class PartialCall:
    """One generate call of a partial rollout.

    Attributes:
        max_tokens: new tokens per response at most in this call (``rollout.partial_tokens``).
        version: the weights version sampling them (recorded in ``token_version``).
        resume: the call's rows are carried responses to continue, not prompts.
    """

    max_tokens: int
    version: int
    resume: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"PartialCall.max_tokens={self.max_tokens} must be >= 1")


def prefix_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real tokens (its prompt, then its response so far) as a left-padded prompt.

    Positions are counted over real tokens (``position_ids_from_mask``), so the continuation sees
    every token at the position it had when it was sampled.

    Args:
        input_ids, attention_mask: ``(M, P+R)`` rows (left-padded prompt, right-padded response).

    Returns:
        ``(ids, mask)``, ``(M, W)`` with ``W`` the longest row's real tokens.

    >>> ids, mask = prefix_prompts(torch.tensor([[0, 5, 6, 0], [7, 8, 9, 4]]), torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]]))
    >>> ids.tolist(), mask.tolist()
    ([[0, 0, 5, 6], [7, 8, 9, 4]], [[0, 0, 1, 1], [1, 1, 1, 1]])
    """
    order = torch.argsort(attention_mask.long(), dim=1, stable=True)  # padding first, real tokens in order
    ids, mask = input_ids.gather(1, order), attention_mask.gather(1, order)
    width = int(mask.sum(dim=1).max())
    return ids[:, ids.shape[1] - width :], mask[:, mask.shape[1] - width :]


def widen_rows(rows: dict[str, torch.Tensor], width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rows right-padded to ``width`` columns (``input_ids`` with ``pad_token_id``, the rest with 0):
    a call that sampled fewer than ``max_new_tokens`` tokens gives rows as wide as a whole response's."""
    extra = width - rows["input_ids"].shape[1]
    if extra < 0:
        raise ValueError(f"widen_rows: rows are {rows['input_ids'].shape[1]} wide, more than {width}")
    return {
        k: torch.nn.functional.pad(t, (0, extra), value=pad_token_id if k == "input_ids" else 0)
        for k, t in rows.items()
    }


def append_tokens(
    rows: dict[str, torch.Tensor],
    prompt_width: int,
    tokens: torch.Tensor,
    token_mask: torch.Tensor,
    logp: torch.Tensor,
    version: int,
) -> None:
    """Write each row's newly sampled tokens after its response so far, in place; tokens that
    would land past the row's last column (``max_new_tokens``) are dropped.

    Args:
        rows: ``(M, P+R)`` rows being continued (the module docstring's keys).
        prompt_width: ``P``.
        tokens, token_mask, logp: ``(M, K)`` what the call sampled for each row.
        version: the weights version that sampled them.
    """
    start = rows["response_mask"].sum(dim=1)  # (M,) response tokens so far
    cols = prompt_width + start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    keep = token_mask.bool() & (cols < rows["input_ids"].shape[1])
    row_index = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(cols)[keep]
    col_index = cols[keep]
    rows["input_ids"][row_index, col_index] = tokens[keep]
    rows["attention_mask"][row_index, col_index] = 1
    rows["response_mask"][row_index, col_index] = 1
    rows["old_logp"][row_index, col_index] = logp[keep].to(rows["old_logp"].dtype)
    rows[TOKEN_VERSION][row_index, col_index] = version


def unfinished_rows(
    input_ids: torch.Tensor, response_mask: torch.Tensor, prompt_width: int, stop_token_ids: Sequence[int]
) -> torch.Tensor:
    """``(M,)`` bool: rows whose response neither ended with a stop token nor filled its ``R`` columns.

    >>> ids, mask = torch.tensor([[1, 4, 2, 0], [1, 4, 4, 0], [1, 4, 4, 4]]), torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 1]])
    >>> unfinished_rows(ids, mask, 1, stop_token_ids=[2]).tolist()
    [False, True, False]
    """
    length = response_mask[:, prompt_width:].sum(dim=1)
    last = input_ids.gather(1, (prompt_width + length - 1).clamp(min=prompt_width)[:, None]).squeeze(1)
    stopped = torch.isin(last, torch.tensor(list(stop_token_ids), dtype=last.dtype)) & (length > 0)
    return (length < input_ids.shape[1] - prompt_width) & ~stopped
