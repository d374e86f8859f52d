"""Micro-batches balanced by tokens.

A mini-batch (the rows of one optimizer step on one dp rank) is cut into micro-batches that
run forward/backward one at a time. RL batches mix short and long sequences, so cutting by
row count gives micro-batches of very different cost; here rows are assigned to micro-
batches by a longest-first greedy partition of their valid-token counts (the lengths read
from ``attention_mask``), which keeps the token sums within one longest row of each other.

Under pipeline parallelism every micro-batch must have the same shape (the stages exchange
fixed-size activation buffers), so the partition can also be asked for equal row counts
(``equal_rows=True``: parts differ by at most one row; the engine pads the short ones).

Each micro-batch is trimmed to the columns where any of its rows has a valid token, so a
micro-batch of short sequences does not pay for the padding of long ones.

Per-token tensors are the entries of the batch whose first two dims equal
``attention_mask.shape``; other tensors are per-row and only have their rows selected.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MicroBatch",
    "balanced_partition",
    "num_micro_batches_for",
    "select",
    "sequence_lengths",
    "split_micro_batches",
]


def sequence_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Valid tokens per row of a ``(B, T)`` mask.

    >>> sequence_lengths(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    [2, 3]
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, T), got shape {tuple(attention_mask.shape)}")
    return [int(n) for n in attention_mask.bool().sum(dim=1).tolist()]


def balanced_partition(weights: Sequence[int], num_parts: int, *, equal_rows: bool = False) -> list[list[int]]:
    """Split item indices into ``num_parts`` non-empty groups with near-equal weight sums.

    Longest-processing-time greedy: items in decreasing weight go to the lightest group
    (ties: the group with fewer items, then the lower index). With ``equal_rows`` a group
    takes at most ``ceil(n / num_parts)`` items.

    Args:
        weights: non-negative weight (token count) of every item.
        num_parts: number of groups, ``1 <= num_parts <= len(weights)``.
        equal_rows: cap the group sizes so they differ by at most one item.

    Returns:
        ``num_parts`` lists of item indices, each sorted ascending.

    >>> balanced_partition([5, 1, 4, 2], 2)
    [[0, 1], [2, 3]]
    """
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"num_parts={num_parts} must be in [1, {n}] (the number of rows)")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative, got {list(weights)}")
    capacity = math.ceil(n / num_parts) if equal_rows else n
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0, 0, p) for p in range(num_parts)]  # (weight sum, item count, part index)
    for i in order:
        load, count, p = heapq.heappop(heap)
        parts[p].append(i)
        if count + 1 < capacity:
            heapq.heappush(heap, (load + weights[i], count + 1, p))
    return [sorted(p) for p in parts]


def num_micro_batches_for(lengths: Sequence[int], max_tokens: int) -> int:
    """Fewest micro-batches whose balanced partition keeps every part's tokens <= ``max_tokens``.

    A row longer than ``max_tokens`` gets a micro-batch of its own (it cannot be split).

    >>> num_micro_batches_for([6, 5, 4, 3], max_tokens=9)
    2
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    n = len(lengths)
    k = max(1, min(n, math.ceil(sum(lengths) / max_tokens)))
    while k < n:
        parts = balanced_partition(lengths, k)
        if max(sum(lengths[i] for i in p) for p in parts) <= max(max_tokens, max(lengths)):
            break
        k += 1
    return k


@dataclass
class MicroBatch:
    """Rows ``indices`` of a mini-batch, restricted to columns ``[col_start, col_stop)``.

    Attributes:
        indices: ``(b,)`` int64 row indices into the mini-batch.
        data: the selected (and column-trimmed) tensors, same keys as the mini-batch.
        col_start: first kept column of the mini-batch's ``(B, T)`` tensors.
        col_stop: one past the last kept column.
    """

    indices: torch.Tensor
    data: dict[str, torch.Tensor]
    col_start: int
    col_stop: int


def select(batch: Mapping[str, torch.Tensor], rows: torch.Tensor, cols: slice | None = None) -> dict[str, torch.Tensor]:
    """Rows ``rows`` (and for per-token tensors columns ``cols``) of every tensor of ``batch``."""
    mask = batch["attention_mask"]
    out = {}
    for key, value in batch.items():
        value = value[rows.to(value.device)]
        if cols is not None and value.dim() >= 2 and value.shape[1] == mask.shape[1]:
            value = value[:, cols]
        out[key] = value
    return out


def _valid_columns(attention_mask: torch.Tensor) -> tuple[int, int]:
    cols = attention_mask.bool().any(dim=0).nonzero().flatten()
    if cols.numel() == 0:
        return 0, attention_mask.shape[1]
    return int(cols[0]), int(cols[-1]) + 1


def split_micro_batches(
    batch: Mapping[str, torch.Tensor],
    *,
    num_micro_batches: int | None = None,
    max_tokens: int | None = None,
    equal_rows: bool = False,
    trim: bool = True,
    groups: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """Cut a mini-batch into token-balanced micro-batches.

    Args:
        batch: tensors with a leading row dim ``B``; must hold ``attention_mask`` ``(B, T)``.
        num_micro_batches: how many micro-batches (clamped to ``B``); or
        max_tokens: the token budget of one micro-batch (the count follows from it).
            Exactly one of the two must be given.
        equal_rows: give every micro-batch ``ceil(B / n)`` or ``floor(B / n)`` rows (pipelining).
        trim: drop the columns where no row of the micro-batch has a valid token.
        groups: ``(B,)`` group ids (from 0) of rows that stay in one micro-batch (the rows of a
            prompt, :func:`rlflow.engine.shared_prefix.prompt_groups`): the groups are balanced,
            at most one micro-batch per group; not with ``equal_rows``.

    Returns:
        Micro-batches covering every row exactly once, in order of their first row.
    """
    if (num_micro_batches is None) == (max_tokens is None):
        raise ValueError(f"give exactly one of num_micro_batches={num_micro_batches} and max_tokens={max_tokens}")
    mask = batch["attention_mask"]
    for key, value in batch.items():
        if value.shape[0] != mask.shape[0]:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, attention_mask has {mask.shape[0]}")
    lengths = sequence_lengths(mask)
    members = [[i] for i in range(len(lengths))]
    if groups is not None:
        if equal_rows:
            raise ValueError("groups and equal_rows do not go together")
        members = [[] for _ in range(int(groups.max()) + 1)]
        for row, group in enumerate(groups.tolist()):
            members[group].append(row)
        lengths = [sum(lengths[row] for row in rows) for rows in members]
    if num_micro_batches is None:
        num = num_micro_batches_for(lengths, max_tokens)
    else:
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
        num = min(num_micro_batches, len(lengths))
    parts = balanced_partition(lengths, num, equal_rows=equal_rows)
    parts = sorted(sorted(row for item in part for row in members[item]) for part in parts)
    out = []
    for part in parts:
        rows = torch.tensor(part, dtype=torch.long)
        start, stop = _valid_columns(mask[rows.to(mask.device)]) if trim else (0, mask.shape[1])
        out.append(MicroBatch(rows, select(batch, rows, slice(start, stop)), start, stop))
    return out
